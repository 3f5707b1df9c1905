"""Lengths on the host (shared.forward.row_lengths) and the functions that take them: same values as the device-read
versions, one copy to the host for tensors, and the same errors."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.config.schema import LossConfig
from shared.forward.logprobs import sequence_logprobs
from shared.forward.packing import pack_rows
from shared.forward.prefix_sharing import prefix_rows
from shared.forward.row_lengths import ragged_positions, row_lengths
from shared.grpo.losses import compute_policy_loss
from shared.grpo.off_policy import off_policy_weights
from shared.tensors.masks import lengths_to_mask, masked_min_max
from shared.tensors.transfers import host_values, to_device


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [0, 0], [], [7]])
def test_ragged_positions_are_the_mask_nonzero_in_order(lengths):
    rows, positions = ragged_positions(lengths, torch.tensor(lengths, dtype=torch.long))
    want_rows, want_positions = lengths_to_mask(torch.tensor(lengths, dtype=torch.long)).nonzero(as_tuple=True)
    assert rows.tolist() == want_rows.tolist() and positions.tolist() == want_positions.tolist()


def test_host_values_bring_tensors_back_in_one_copy(monkeypatch):
    copies = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: copies.append(self.numel()) or original(self))
    prompt, completion, given = host_values(torch.tensor([4, 2]), torch.tensor([1, 0], dtype=torch.int32), [5, 6])
    assert (prompt, completion, given) == ([4, 2], [1, 0], [5, 6])
    assert copies == [4]  # both tensors together


def test_row_lengths_from_lists_and_tensors_agree_and_default_the_completion():
    ids = torch.zeros(3, 9, dtype=torch.long)
    from_lists = row_lengths(ids, [2, 4, 1], [5, 0, 8])
    from_tensors = row_lengths(ids, torch.tensor([2, 4, 1]), torch.tensor([5, 0, 8]))
    for lengths in (from_lists, from_tensors):
        assert lengths.prompt == [2, 4, 1] and lengths.completion == [5, 0, 8] and lengths.totals == [7, 4, 9]
        assert lengths.prompt_on_device.tolist() == [2, 4, 1] and lengths.completion_on_device.tolist() == [5, 0, 8]
    rest = row_lengths(ids, [2, 4, 1])
    assert rest.completion == [7, 5, 8] and rest.completion_on_device.tolist() == [7, 5, 8]


@pytest.mark.parametrize("prompts, completions, message", [
    ([0, 2], [3, 3], "at least one token"),
    ([2, 2], [-1, 3], ">= 0"),
    ([4, 2], [5, 3], "exceeds the sequence length"),
    ([4], [1], r"must be \[B\]"),
])
def test_row_lengths_refuse_bad_lengths_by_name(prompts, completions, message):
    ids = torch.zeros(2, 8, dtype=torch.long)
    for kind in (list, torch.tensor):
        with pytest.raises(ValueError, match=message):
            row_lengths(ids, kind(prompts), kind(completions))


def test_to_device_keeps_values_and_dtype_on_the_cpu():
    assert to_device([3, 1], torch.device("cpu")).dtype == torch.long
    got = to_device([0.5, 2.0], torch.device("cpu"), torch.float64)
    assert got.dtype == torch.float64 and got.tolist() == [0.5, 2.0]
    tensor = torch.tensor([1, 2], dtype=torch.int32)
    assert to_device(tensor, torch.device("cpu"), None) is tensor


def test_pack_rows_from_a_list_and_refuses_a_row_longer_than_the_width():
    ids = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]])
    packed = pack_rows(ids, [3, 0, 4])
    assert packed.input_ids.tolist() == [[1, 2, 3, 5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]] and packed.offsets.tolist() == [0, 3, 3]
    with pytest.raises(ValueError, match="within 0..4"):
        pack_rows(ids, [3, 5, 1])


def test_masked_min_max_without_boolean_indexing():
    values = torch.tensor([[1.5, float("nan"), -2.0], [7.0, 3.0, float("inf")]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    low, high = masked_min_max(values, mask)
    assert (low.item(), high.item()) == (-2.0, 3.0)  # the NaN and the inf are masked out
    assert [t.item() for t in masked_min_max(values, torch.zeros_like(mask))] == [0.0, 0.0]
    assert [t.item() for t in masked_min_max(torch.tensor([4, -9, 2]), torch.tensor([True, False, True]))] == [2, 4]
    assert [t.item() for t in masked_min_max(torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))] == [0.0, 0.0]


def _tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("layout", ["padded", "packed", "prefix"])
def test_sequence_logprobs_from_host_lists_equal_the_tensor_path(layout):
    """Logprobs and entropies, from lists and from tensors, bit for bit, whichever forward runs."""
    model = _tiny()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (6, 14), generator=gen)
    ids[3:, :4] = ids[0, :4]  # rows 3-5 continue row 0's prompt (4 tokens)
    prompts, completions = [4, 2, 5, 4, 4, 4], [6, 12, 0, 10, 3, 7]
    prefix = prefix_rows(ids, torch.tensor(prompts)) if layout == "prefix" else None
    kwargs = dict(temperature=0.7, with_entropy=True, chunk_tokens=5,
                  layout="padded" if layout == "prefix" else layout, prefix=prefix)
    with torch.no_grad():
        lists = sequence_logprobs(model, ids, prompts, completions, **kwargs)
        tensors = sequence_logprobs(model, ids, torch.tensor(prompts), torch.tensor(completions), **kwargs)
    assert lists.logprobs.shape == (6, 12)
    assert torch.equal(lists.logprobs, tensors.logprobs) and torch.equal(lists.entropy, tensors.entropy)
    assert torch.equal(lists.completion_lengths, tensors.completion_lengths)
    assert (lists.logprobs[2] == 0).all() and (lists.logprobs[4, 3:] == 0).all() and (lists.logprobs[4, :3] < 0).all()


def test_policy_loss_from_host_lengths_and_device_normalisers_equals_the_tensor_path():
    gen = torch.Generator().manual_seed(2)
    logprobs = -torch.rand(3, 5, generator=gen)
    old = logprobs - 0.1 * torch.rand(3, 5, generator=gen)
    advantages = torch.tensor([1.0, -0.5, 2.0])
    cfg = LossConfig(beta=0.0, aggregation="seq-mean-token-mean")
    lengths = [5, 0, 2]
    correction = off_policy_weights(logprobs, old, torch.tensor(lengths), mode="token_tis", low=0.5, high=2.0)
    reference = compute_policy_loss(logprobs, advantages, torch.tensor(lengths), cfg, correction=correction,
                                    old_logprobs=logprobs, num_tokens=9.0, num_seqs=4.0)
    hosted = compute_policy_loss(logprobs, advantages, lengths, cfg, correction=correction, old_logprobs=logprobs,
                                 num_tokens=torch.tensor(9.0, dtype=torch.float64),
                                 num_seqs=torch.tensor(4.0, dtype=torch.float64))
    assert torch.equal(hosted.loss, reference.loss) and hosted.loss.dtype == reference.loss.dtype
    assert reference.metrics["is_weight_max"].item() > 1.0  # the weights differ from 1, so the metric is exercised
    for key, value in reference.metrics.items():
        assert torch.equal(hosted.metrics[key], value), key
    with pytest.raises(ValueError, match="within 0..5"):
        compute_policy_loss(logprobs, advantages, [6, 0, 2], cfg)
