"""The multi-turn loss mask: its record and wire form, the hub's checks and batch layout, and the loss over model
tokens only (shared/protocol/loss_mask.py, shared/grpo/losses.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ref_server.hub.rollout_hub import RolloutHub
from shared.config.schema import LossConfig
from shared.grpo.losses import compute_policy_loss, loss_normalizers
from shared.protocol.errors import ProtocolError
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.protocol.wire import decode, encode

from .groups import random_group

LENGTHS = (5, 2, 6, 3)
MASKS = ([1, 1, 0, 0, 1], [1, 1], [1, 0, 0, 0, 1, 1], [0, 1, 1])


def masked_group(masks=MASKS, lengths=LENGTHS, seed=0, temperature=1.0) -> RolloutGroup:
    return random_group(lengths, seed, temperature=temperature, masks=masks)


def test_mask_round_trips_and_an_absent_mask_costs_nothing():
    group = masked_group()
    back = RolloutGroup.from_bytes(group.to_bytes())
    assert back.completion_mask.dtype == torch.bool
    assert [back.completion_mask[i, :n].int().tolist() for i, n in enumerate(LENGTHS)] == list(MASKS)
    plain = masked_group(masks=None)
    assert plain.completion_mask is None
    tensors, _ = decode(plain.to_bytes(), "rollout_group/v1")
    assert "completion_mask" not in tensors  # a single-turn group encodes exactly as before masks existed
    assert RolloutGroup.from_bytes(plain.to_bytes()).completion_mask is None


def _with_mask_tensor(mask: torch.Tensor) -> bytes:
    group = masked_group(masks=None)
    tensors, fields = decode(group.to_bytes(), "rollout_group/v1")
    tensors["completion_mask"] = mask
    return encode("rollout_group/v1", tensors, fields)


@pytest.mark.parametrize("mask, reason", [
    (torch.ones(4, 5, dtype=torch.bool), "must have the shape of the completions"),
    (torch.full((4, 6), 2, dtype=torch.uint8), "is 2, not 0 or 1"),
    (torch.ones(4, 6, dtype=torch.float32), "must be a bool"),
    (torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1], [1] * 6, [1] * 6], dtype=torch.bool), "completion 1 has 2 tokens "
     "but none written by the model"),
])
def test_hub_refuses_a_bad_mask_naming_it(mask, reason):
    hub = RolloutHub(capacity=4, max_staleness=1, scorer=None)
    with pytest.raises(ProtocolError, match=reason):
        hub.put(_with_mask_tensor(mask))
    assert hub.counters.rejected == 1 and hub.depth() == 0
    # in a batch upload it is refused alone, with a 4xx status and the reason; the good group is queued
    good, bad = masked_group(seed=5).to_bytes(), _with_mask_tensor(mask)
    answers = hub.put_many([bad, good])
    assert answers[0]["accepted"] is False and answers[0]["status"] == 422 and reason in answers[0]["refused"]
    assert answers[1]["accepted"] is True and hub.depth() == 1


def test_from_samples_refuses_mask_rows_that_do_not_fit():
    with pytest.raises(ProtocolError, match="completion 1: 3 mask values for 2 tokens"):
        masked_group(masks=([1] * 5, [1, 1, 1], [1] * 6, [1] * 3))
    with pytest.raises(ProtocolError, match="mask values must be 0 or 1, got 2"):
        masked_group(masks=([1] * 5, [1, 2], [1] * 6, [1] * 3))


def test_hub_batches_masked_and_plain_groups_like_from_groups():
    """A masked group and a single-turn group leased together: the plain rows are all ones, the masked rows are the
    mask (False past each row's end), exactly as TrainBatch.from_groups lays them out; the train-batch wire keeps
    it."""
    masked, plain = masked_group(seed=1), masked_group(masks=None, seed=2, lengths=(7, 1, 2, 2))
    hub = RolloutHub(capacity=4, max_staleness=1, scorer=None)
    for group in (masked, plain):
        hub.put(group.to_bytes())
    batch = hub.take(2)
    reference = TrainBatch.from_groups([masked, plain], None)
    assert torch.equal(batch.completion_mask, reference.completion_mask)
    assert batch.completion_mask.shape == batch.behaviour_logprobs.shape == (8, 7)
    assert batch.completion_mask[:4, :6].int().tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0],
                                                            [1, 0, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert batch.completion_mask[4:].all()
    assert torch.equal(TrainBatch.from_bytes(batch.to_bytes()).completion_mask, batch.completion_mask)
    assert torch.equal(batch.select_groups([0]).completion_mask, batch.completion_mask[:4, :6])
    assert TrainBatch.from_groups([plain], None).completion_mask is None
    from learner.metrics import batch_metrics

    assert batch_metrics(batch, torch.zeros(8), 0)["env_token_frac"] == pytest.approx(6 / 28)
    assert "env_token_frac" not in batch_metrics(TrainBatch.from_groups([plain], None), torch.zeros(4), 0)


def _loss(logits, mask, cfg, lengths, advantages, old, ref):
    logprobs = logits.log_softmax(-1)[..., 0]  # the "sampled" token is 0 everywhere
    return compute_policy_loss(logprobs, advantages, lengths, cfg, old_logprobs=old, ref_logprobs=ref,
                               token_mask=mask)


@pytest.mark.parametrize("policy_loss", ["grpo", "gspo"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_at_environment_tokens_is_exactly_zero(policy_loss, aggregation):
    torch.manual_seed(0)
    logits = torch.randn(3, 6, 11, requires_grad=True)
    lengths = torch.tensor([6, 4, 5])
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    norm_len = 8 if aggregation == "seq-mean-token-sum-norm" else None
    cfg = LossConfig(beta=0.1, policy_loss=policy_loss, aggregation=aggregation, dual_clip=3.0, norm_len=norm_len)
    out = _loss(logits, mask, cfg, lengths, torch.tensor([1.0, -0.5, 2.0]), torch.randn(3, 6) - 2,
                torch.randn(3, 6) - 2)
    out.loss.backward()
    environment = ~mask & (torch.arange(6) < lengths.unsqueeze(1))
    assert environment.sum() == 6
    assert (logits.grad[environment] == 0).all()
    model = mask & (torch.arange(6) < lengths.unsqueeze(1))
    assert (logits.grad[model].abs().sum(-1) > 0).all()
    # the loss does not depend on the logits at environment positions at all
    moved = logits.detach().clone()
    moved[environment] += 100 * torch.randn(int(environment.sum()), 11)
    again = _loss(moved, mask, cfg, lengths, torch.tensor([1.0, -0.5, 2.0]), out.token_loss * 0 - 2,
                  torch.zeros(3, 6) - 2)
    first = _loss(logits.detach(), mask, cfg, lengths, torch.tensor([1.0, -0.5, 2.0]), out.token_loss * 0 - 2,
                  torch.zeros(3, 6) - 2)
    assert torch.equal(again.loss, first.loss)
    assert all(torch.equal(again.metrics[k], first.metrics[k]) for k in first.metrics)
    assert first.metrics["num_tokens"] == 9


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=1, max_size=5), st.integers(0, 2**31))
def test_an_all_ones_mask_gives_bitwise_the_loss_without_a_mask(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), max(max(lengths), 1)
    logprobs = -torch.rand(rows, width, generator=gen) * 3
    old, ref = -torch.rand(rows, width, generator=gen) * 3, -torch.rand(rows, width, generator=gen) * 3
    advantages = torch.randn(rows, generator=gen)
    lengths_t = torch.tensor(lengths)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        cfg = LossConfig(beta=0.05, aggregation=aggregation)
        plain = compute_policy_loss(logprobs, advantages, lengths_t, cfg, old_logprobs=old, ref_logprobs=ref)
        ones = compute_policy_loss(logprobs, advantages, lengths_t, cfg, old_logprobs=old, ref_logprobs=ref,
                                   token_mask=torch.ones(rows, width, dtype=torch.bool))
        assert torch.equal(plain.loss, ones.loss) and torch.equal(plain.token_loss, ones.token_loss)
        assert all(torch.equal(plain.metrics[k], ones.metrics[k]) for k in plain.metrics)
    assert loss_normalizers(lengths_t, torch.ones(rows, width, dtype=torch.bool)) == loss_normalizers(lengths_t)


def test_normalizers_count_model_tokens_and_sequences_with_one():
    mask = torch.tensor([[1, 0, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    # row 1 has 2 tokens, both environment's: no model token, not a sequence of the loss
    assert loss_normalizers(torch.tensor([4, 2, 3]), mask) == (2 + 0 + 3, 2)


def test_a_spooled_masked_group_comes_back_with_its_mask_after_a_hub_restart(tmp_path):
    group = masked_group(seed=3)
    first = RolloutHub(capacity=4, max_staleness=1, scorer=None, spool_dir=tmp_path / "spool")
    first.put(group.to_bytes())
    first.close()
    again = RolloutHub(capacity=4, max_staleness=1, scorer=None, spool_dir=tmp_path / "spool")
    batch = again.take(1)
    assert torch.equal(batch.completion_mask, TrainBatch.from_groups([group], None).completion_mask)
    again.close()


@st.composite
def masked_rows(draw):
    lengths = draw(st.lists(st.integers(0, 9), min_size=1, max_size=4))
    masks = []
    for n in lengths:
        row = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
        if n and not any(row):
            row[draw(st.integers(0, n - 1))] = 1  # every non-empty completion has a model token
        masks.append(row)
    return lengths, masks


@settings(max_examples=40, deadline=None)
@given(masked_rows(), masked_rows())
def test_masks_survive_the_wire_the_spool_format_and_both_batch_layouts(first, second):
    from ref_server.hub.batching import GroupRows, assemble_batch

    groups = [RolloutGroup.from_bytes(masked_group(masks=m, lengths=n, seed=i).to_bytes())
              for i, (n, m) in enumerate((first, second))]
    for group, (lengths, masks) in zip(groups, (first, second)):
        assert [group.completion_mask[i, :n].int().tolist() for i, n in enumerate(lengths)] == masks
    reference = TrainBatch.from_groups(groups, None)
    laid_out = assemble_batch(groups, [GroupRows.of(g, None) for g in groups], batch_id="b")
    assert torch.equal(reference.completion_mask, laid_out.completion_mask)
    assert torch.equal(TrainBatch.from_bytes(laid_out.to_bytes()).completion_mask, laid_out.completion_mask)
    counted = loss_normalizers(reference.completion_lengths, reference.completion_mask)
    assert counted == (sum(map(sum, first[1] + second[1])), sum(any(m) for m in first[1] + second[1]))
