"""The learner's per-token advantages (issue 23 item 3): process supervision and the KL penalty in the reward give
exactly the pure functions' values (hand-computed here too), pass through micro-batches, and feed the loss."""

import json
import logging
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.advantages import AdvantageLog, advantage_record, batch_advantages
from learner.metrics import batch_metrics
from learner.step import micro_batch_loss, split_micro_batches
from shared.config.loader import load_config
from shared.config.schema import AdvantageConfig, AlgorithmConfig, KLConfig, LossConfig
from shared.grpo.advantages import (
    compute_advantages,
    kl_in_reward_advantages,
    normalised_step_rewards,
    outcome_token_rewards,
    process_advantages,
    step_token_rewards,
)
from shared.grpo.losses import loss_normalizers
from shared.protocol.records import RolloutGroup, TrainBatch

from .batches import sampled_groups

CPU = torch.device("cpu")
R = 0.5773503  # r~ of the issue's worked example: R = [1, 0, 1], mean 2/3, std 0.57735


def group(group_id, completions, rewards, steps, behaviour=None, finish=None):
    behaviour = behaviour or [[-1.0] * len(c) for c in completions]
    return RolloutGroup.from_samples(
        prompt_ids=[1, 2], completion_ids=completions, behaviour_logprobs=behaviour, rewards=rewards,
        finish_reasons=finish or ["stop"] * len(completions), policy_version=0, generator_id="gen",
        group_id=group_id, steps=steps)


def worked_example(ref=None):
    """The issue's example: completion 0 has 5 tokens, steps (end 1, reward 1), (end 3, reward 0); completion 1
    has 3 tokens and one step (end 2, reward 1). Outcome rewards 1 and 0. Behaviour logprobs all -1."""
    g = group("worked", [[3, 4, 5, 6, 7], [8, 9, 10]], [1.0, 0.0], [[(1, 1.0), (3, 0.0)], [(2, 1.0)]])
    return TrainBatch.from_bytes(TrainBatch.from_groups([g], None if ref is None else [ref]).to_bytes())


def process(**kw):
    return AdvantageConfig(**{"supervision": "process", "eps": 1e-6, **kw})


def test_worked_example_through_the_learner_equals_the_issue_and_the_pure_function():
    batch = worked_example()
    advantages = batch_advantages(batch, process())
    expected = torch.tensor([[-R, -R, -2 * R, -2 * R, 0.0], [R, R, R, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    pure = process_advantages(batch.step_rewards, batch.step_index, batch.step_end, batch.group_index,
                              batch.completion_lengths, scale="group", eps=1e-6)
    assert torch.equal(advantages, pure)


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_rows_without_steps_and_a_step_at_the_last_token(scale):
    """Group a: unequal step counts, a step on the last token (row 1, end 3 of 4 tokens), a row without steps.
    Group b: all-equal step rewards, so its advantages are 0. Group c carries no steps at all."""
    a = group("a", [[5, 6, 7], [8, 9, 10, 11], [12, 13]], [1.0, 0.0, 1.0],
              [[(0, 1.0), (2, 0.0)], [(3, 1.0)], []])
    b = group("b", [[5, 6], [7, 8, 9]], [0.0, 1.0], [[(1, 0.5)], [(0, 0.5), (2, 0.5)]])
    c = group("c", [[5], [6, 7]], [1.0, 0.0], None)
    batch = TrainBatch.from_groups([a, b, c], None)
    advantages = batch_advantages(batch, process(scale=scale))
    # group a: R = [1, 0, 1], centred [1/3, -2/3, 1/3], divided by its std 0.57735 (group), by nothing (none), or
    # by the std of all six step rewards of the batch (batch)
    every_step = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.5, 0.5], dtype=torch.float64)
    divisor = {"group": R + 1e-6, "none": 1.0, "batch": float(every_step.std()) + 1e-6}[scale]
    r = torch.tensor([1 / 3, -2 / 3, 1 / 3]) / divisor
    expected = torch.zeros(7, 4)
    expected[0, :3] = torch.tensor([r[0] + r[1], r[1], r[1]])
    expected[1, :4] = r[2]
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    batch_std = float(every_step.std()) if scale == "batch" else None
    pure = process_advantages(batch.step_rewards, batch.step_index, batch.step_end, batch.group_index,
                              batch.completion_lengths, scale=scale, eps=1e-6, batch_std=batch_std)
    torch.testing.assert_close(advantages, pure, atol=1e-7, rtol=0)
    metrics = batch_metrics(batch, advantages, 0, AlgorithmConfig(advantage=process(scale=scale)))
    assert metrics["steps_per_completion"] == pytest.approx(6 / 7)
    assert metrics["rows_without_steps_frac"] == pytest.approx(3 / 7)  # a's third row and both rows of c
    assert metrics["groups_without_steps_frac"] == pytest.approx(1 / 3)
    assert metrics["step_reward_mean"] == pytest.approx(3.5 / 6)
    assert metrics["step_reward_std"] == pytest.approx(float(every_step.std()))
    # advantage metrics over the 17 real tokens, not the padded 7 x 4
    real = expected[torch.arange(4) < batch.completion_lengths.unsqueeze(1)]
    assert real.numel() == 17
    assert metrics["advantage_mean"] == pytest.approx(float(real.mean()), abs=1e-6)
    assert metrics["advantage_min"] == pytest.approx(float(real.min()), abs=1e-5)


def test_process_batch_without_any_step_is_all_zero_and_said_aloud(caplog):
    batch = TrainBatch.from_groups([group("c", [[5], [6, 7]], [1.0, 0.0], None)], None)
    with caplog.at_level(logging.WARNING, logger="grpo.learner"):
        advantages = batch_advantages(batch, process(scale="batch"))
    assert torch.equal(advantages, torch.zeros(2, 2))
    assert "no completion of batch" in caplog.text and "teaches nothing" in caplog.text
    metrics = batch_metrics(batch, advantages, 0, AlgorithmConfig(advantage=process()))
    assert metrics["rows_without_steps_frac"] == 1.0 and metrics["steps_per_completion"] == 0.0


def test_kl_in_reward_with_outcome_supervision_by_hand():
    """rewards [1, 0] -> outcome advantages +-0.70711 at each completion's last token; k1 = old - ref:
    row 0 [1, 0, 2], row 1 [0, -1]; beta 0.1: r_0 = [-0.1, 0, 0.50711], r_1 = [0, -0.60711]; A = return to go."""
    g = group("o", [[3, 4, 5], [6, 7]], [1.0, 0.0], None)
    ref = torch.tensor([[-2.0, -1.0, -3.0], [-1.0, 0.0, 0.0]])
    batch = TrainBatch.from_groups([g], [ref])
    kl = KLConfig(in_reward=True, beta=0.1, estimator="k1")
    advantages = batch_advantages(batch, AdvantageConfig(eps=1e-6), kl)
    a = 0.7071063  # 0.70711 / (0.70711 + 1e-6)
    expected = torch.tensor([[-0.3 + a, -0.2 + a, -0.2 + a], [0.1 - a, 0.1 - a, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    outcome = compute_advantages(batch.rewards, batch.group_index, "grpo", scale="group", eps=1e-6)
    pure = kl_in_reward_advantages(outcome_token_rewards(outcome, batch.completion_lengths, width=3),
                                   batch.behaviour_logprobs, batch.ref_logprobs, batch.completion_lengths,
                                   beta=0.1, estimator="k1")
    assert torch.equal(advantages, pure)
    metrics = batch_metrics(batch, advantages, 0, AlgorithmConfig(kl=kl, loss=LossConfig(beta=0.0)))
    assert metrics["kl_reward_mean"] == pytest.approx((1 + 0 + 2 + 0 - 1) / 5)
    assert metrics["return_min"] == pytest.approx(0.1 - a, abs=1e-5)
    assert metrics["return_max"] == pytest.approx(-0.2 + a, abs=1e-5)
    assert "step_reward_mean" not in metrics


def test_kl_in_reward_with_process_supervision_by_hand():
    """The worked example with k1 row 0 [0.5, 0, 0, 1, 0], row 1 [0, 0, 2], beta 0.1:
    r_0 = [-0.05, R, 0, -0.1 - 2R, 0], r_1 = [0, 0, -0.2 + R]; A = return to go."""
    ref = torch.tensor([[-1.5, -1.0, -1.0, -2.0, -1.0], [-1.0, -1.0, -3.0, 0.0, 0.0]])
    batch = worked_example(ref)
    kl = KLConfig(in_reward=True, beta=0.1)
    advantages = batch_advantages(batch, process(), kl)
    expected = torch.tensor([[-0.05 + R - 0.1 - 2 * R, R - 0.1 - 2 * R, -0.1 - 2 * R, -0.1 - 2 * R, 0.0],
                             [-0.2 + R, -0.2 + R, -0.2 + R, 0.0, 0.0]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    normalised = normalised_step_rewards(batch.step_rewards, batch.step_index, batch.group_index, scale="group",
                                         eps=1e-6)
    tokens = step_token_rewards(normalised, batch.step_index, batch.step_end, batch.completion_lengths, width=5)
    pure = kl_in_reward_advantages(tokens, batch.behaviour_logprobs, batch.ref_logprobs, batch.completion_lengths,
                                   beta=0.1, estimator="k1")
    assert torch.equal(advantages, pure)
    k3 = batch_advantages(batch, process(), KLConfig(in_reward=True, beta=0.1, estimator="k3"))
    assert not torch.allclose(k3, advantages)  # the estimator reaches the advantages


def test_kl_in_reward_without_reference_logprobs_is_a_clear_error():
    with pytest.raises(ValueError, match="algorithm.kl.in_reward needs reference logprobs"):
        batch_advantages(worked_example(), process(), KLConfig(in_reward=True))


def test_outcome_path_ignores_the_kl_section_when_it_is_off():
    batch = worked_example()
    assert torch.equal(batch_advantages(batch, AdvantageConfig()), batch_advantages(batch, AdvantageConfig(),
                                                                                    KLConfig()))
    assert batch_advantages(batch, AdvantageConfig(), KLConfig()).shape == (2,)


def test_token_advantages_are_split_by_rows_and_trimmed_to_each_micro_batch():
    a = group("a", [[5, 6, 7, 8, 9, 10], [8, 9]], [1.0, 0.0], [[(2, 1.0), (5, 0.0)], [(1, 1.0)]])
    b = group("b", [[5, 6], [7]], [0.0, 1.0], [[(1, 0.0)], [(0, 1.0)]])
    batch = TrainBatch.from_groups([a, b], None)
    advantages = batch_advantages(batch, process())
    first, second = split_micro_batches(batch, advantages, 2, False, CPU)
    assert first.advantages.shape == (2, 6) and second.advantages.shape == (2, 2)
    assert torch.equal(first.advantages, advantages[:2]) and torch.equal(second.advantages, advantages[2:, :2])
    assert not advantages[2:, 2:].any()  # what was trimmed was padding


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("policy_loss", ["grpo", "gspo"])
def test_token_advantages_loss_is_the_same_split_or_whole(tiny_model_dir, aggregation, policy_loss):
    """Real tiny-model forward: the micro-batches' losses (global normalisers) sum to the whole batch's loss, with
    per-token advantages from process supervision and the KL in the reward; truncated rows masked."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], seed=6, max_tokens=8)
    for g in groups:
        assert int(g.completion_lengths.min()) > 1
        g.step_rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
        g.step_index = torch.tensor([0, 0, 1, 2])
        g.step_end = torch.tensor([0, int(g.completion_lengths[0]) - 1, 0, int(g.completion_lengths[2]) - 1])
    refs = [g.behaviour_logprobs - 0.1 * torch.arange(g.behaviour_logprobs.shape[1]) for g in groups]
    batch = TrainBatch.from_groups(groups, refs)
    batch.truncated = torch.tensor([False, True, False, False, False, True])
    advantages = batch_advantages(batch, process(), KLConfig(in_reward=True, beta=0.05))
    assert advantages.dim() == 2 and advantages.abs().sum() > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LossConfig(beta=0.0, aggregation=aggregation, policy_loss=policy_loss, norm_len=8)

    def total(parts):
        micro = split_micro_batches(batch, advantages, parts, True, CPU)
        num_tokens, num_seqs = (sum(loss_normalizers(mb.loss_lengths)[i] for mb in micro) for i in (0, 1))
        losses = [micro_batch_loss(model, mb, cfg, temperature=1.0, old_mode="behaviour", num_tokens=num_tokens,
                                   num_seqs=num_seqs)[0].loss for mb in micro]
        return sum(float(x.detach()) for x in losses)

    whole = total(1)
    assert whole == pytest.approx(total(2), abs=1e-6)
    assert abs(whole) > 1e-4


def test_advantages_jsonl_records_what_the_loss_used(tmp_path):
    config = load_config(None, ["algorithm.advantage.supervision=process", "algorithm.advantage.eps=1e-6"])
    batch = replace(worked_example(), batch_id="b-1")
    batch.truncated = torch.tensor([False, True])
    advantages = batch_advantages(batch, config.algorithm.advantage, config.algorithm.kl)
    log = AdvantageLog(str(tmp_path / "adv" / "a.jsonl"), 0, config.algorithm, mask_truncated=True)
    log.write(3, batch, advantages)
    log.write(4, batch, advantages)
    log.close()
    lines = (tmp_path / "adv" / "a.jsonl").read_text().splitlines()
    assert len(lines) == 2
    record = json.loads(lines[0])
    assert {k: record[k] for k in ("step", "rank", "batch_id", "supervision", "scale", "kl_in_reward")} == {
        "step": 3, "rank": 0, "batch_id": "b-1", "supervision": "process", "scale": "group", "kl_in_reward": False}
    first, second = record["rows"]
    assert first == {"row": 0, "group_id": "worked", "group_index": 0, "row_in_group": 0, "completion_length": 5,
                     "reward": 1.0, "truncated": False, "in_loss": True, "step_ends": [1, 3],
                     "step_rewards": [1.0, 0.0], "advantages": [round(v, 6) for v in advantages[0].tolist()]}
    assert first["advantages"][1] == pytest.approx(-R, abs=1e-5) and first["advantages"][4] == 0.0
    assert second["advantages"] == [round(v, 6) for v in advantages[1, :3].tolist()]
    assert second["in_loss"] is False and second["row_in_group"] == 1
    outcome = advantage_record(1, batch, torch.tensor([0.5, -0.5]), AlgorithmConfig(), rank=2)
    assert outcome["rows"][1]["advantages"] == [-0.5] * 3 and outcome["rank"] == 2
    other_rank = AdvantageLog(str(tmp_path / "adv" / "a.jsonl"), 1, config.algorithm, mask_truncated=False)
    other_rank.close()
    assert (tmp_path / "adv" / "a.jsonl.rank1").exists()
