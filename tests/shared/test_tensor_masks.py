"""The ground floor's masks (shared/tensors/masks.py): ``completion_mask`` is ``lengths_to_mask`` without the checks
and without reading the lengths back, and with a loss mask keeps only the model's tokens."""

import pytest
import torch

from shared.tensors.masks import completion_mask, lengths_to_mask, model_token_mask


def test_completion_mask_is_lengths_to_mask_for_valid_lengths():
    lengths = torch.tensor([3, 0, 5, 1])
    want = torch.tensor([[1, 1, 1, 0, 0, 0], [0] * 6, [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(completion_mask(lengths, 6), want)
    assert torch.equal(lengths_to_mask(lengths, 6), want)
    assert torch.equal(completion_mask([3, 0, 5, 1], 6), want)                    # host lists too
    assert torch.equal(completion_mask(lengths.int(), 6), want)                   # any integer dtype
    assert completion_mask(torch.zeros(0, dtype=torch.long), 4).shape == (0, 4)


def test_with_a_loss_mask_only_the_models_tokens_count():
    loss_mask = torch.tensor([[1, 0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1, 1]], dtype=torch.uint8)  # wider: cut
    got = completion_mask(torch.tensor([4, 2]), 5, loss_mask)
    assert got.tolist() == [[True, False, True, True, False], [False, True, False, False, False]]
    valid = completion_mask(torch.tensor([4, 2]), 5)
    assert torch.equal(model_token_mask(loss_mask, valid), got) and model_token_mask(None, valid) is valid


def test_completion_mask_never_reads_the_lengths_back():
    """On the meta device nothing can be read: a check (``int(lengths.max())``) would raise, a comparison does not.
    This is what keeps the learner's step from waiting for the GPU (tests/learner/test_host_syncs.py)."""
    lengths = torch.tensor([2, 3], device="meta")
    mask = completion_mask(lengths, 4, torch.ones(2, 4, dtype=torch.bool))
    assert mask.device.type == "meta" and mask.shape == (2, 4) and mask.dtype == torch.bool
    with pytest.raises((RuntimeError, NotImplementedError)):
        lengths_to_mask(lengths, 4)


def test_lengths_to_mask_checks_what_completion_mask_takes_on_trust():
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        lengths_to_mask(torch.tensor([1, -1]), 3)
    with pytest.raises(ValueError, match="a length 4 exceeds max_len 3"):
        lengths_to_mask(torch.tensor([4]), 3)
    with pytest.raises(ValueError, match="must be 1-D"):
        lengths_to_mask(torch.ones(2, 2, dtype=torch.long))
    assert lengths_to_mask(torch.tensor([2, 1])).shape == (2, 2)                  # width: the longest
