"""The entropy bonus (issue 40, item 3): its term in the loss by hand, the adaptive coefficient's update rule, and
on the tiny model a step whose only signal is the bonus widening the policy's next-token distributions."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.entropy_control import EntropyControl, next_coef
from learner.step import micro_batch_loss, split_micro_batches
from shared.config.schema import GRPOConfig, LossConfig
from shared.config.schema.algorithm import EntropyConfig
from shared.grpo.losses import compute_policy_loss

from .batches import batch_of, sampled_groups

CPU = torch.device("cpu")


def test_the_bonus_is_minus_coef_times_the_entropy_aggregated_like_the_loss():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    entropy = torch.tensor([[2.0, 1.0, 9.0], [3.0, 9.0, 9.0]], requires_grad=True)   # 9: padding, never counted
    advantages = torch.tensor([1.0, -1.0])
    plain = compute_policy_loss(logprobs, advantages, [2, 1], LossConfig(beta=0.0))
    bonus = compute_policy_loss(logprobs, advantages, [2, 1], LossConfig(beta=0.0), entropy=entropy,
                                entropy_coef=0.1)
    # token-mean over 3 tokens: -0.1 * (2 + 1 + 3) / 3
    assert bonus.loss.item() == pytest.approx(plain.loss.item() - 0.2)
    assert bonus.metrics["entropy_bonus"].item() == pytest.approx(0.2)
    (grad,) = torch.autograd.grad(bonus.loss, entropy)
    torch.testing.assert_close(grad, torch.tensor([[-0.1 / 3, -0.1 / 3, 0.0], [-0.1 / 3, 0.0, 0.0]]))


def test_the_adaptive_coefficient_follows_the_target_within_its_bounds():
    cfg = EntropyConfig(coef=0.01, target=1.0, adapt_rate=0.01, max_coef=0.02)
    assert next_coef(0.01, 0.5, cfg) == pytest.approx(0.015)    # below target: the bonus grows
    assert next_coef(0.015, 0.2, cfg) == pytest.approx(0.02)    # ... up to max_coef
    assert next_coef(0.01, 1.6, cfg) == pytest.approx(0.004)    # above: it shrinks
    assert next_coef(0.002, 3.0, cfg) == 0.0                    # ... down to min_coef
    assert next_coef(0.01, math.nan, cfg) == 0.01                # no entropy this step: unchanged
    assert next_coef(0.01, 0.0, EntropyConfig(coef=0.01)) == 0.01   # no target: fixed


def test_the_control_records_the_coefficient_each_step_used_and_resumes_from_its_state():
    control = EntropyControl(EntropyConfig(coef=0.01, target=1.0, adapt_rate=0.01))
    metrics = {"entropy": 0.5}
    control.after_step(metrics)
    assert metrics["entropy_coef"] == 0.01 and control.coef == pytest.approx(0.015)
    resumed = EntropyControl(EntropyConfig(coef=0.01, target=1.0, adapt_rate=0.01), control.state())
    assert resumed.coef == pytest.approx(0.015)
    off = EntropyControl(EntropyConfig())
    metrics = {"entropy": 0.5}
    off.after_step(metrics)
    assert not off.active and "entropy_coef" not in metrics


def test_config_bounds_are_checked():
    with pytest.raises(ValueError, match="min_coef"):
        GRPOConfig.model_validate({"algorithm": {"entropy": {"min_coef": 0.2, "max_coef": 0.1}}})
    with pytest.raises(ValueError, match="entropy.colour|colour"):
        GRPOConfig.model_validate({"algorithm": {"entropy": {"colour": 1}}})


def test_with_zero_advantages_only_the_bonus_moves_the_model_and_it_widens_the_distributions(tiny_model_dir):
    """All-equal rewards give zero advantages: without the bonus the gradient is 0; with it, a few SGD steps raise
    the mean entropy of the policy on the batch's tokens."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 1.0, 1.0, 1.0]], seed=3)
    batch = batch_of(groups)
    zero = torch.zeros(len(batch.rewards))

    def mean_entropy_and_grad_norm(model, coef):
        model.zero_grad()
        (mb,) = split_micro_batches(batch, zero, 1, False, CPU)
        result, entropy = micro_batch_loss(model, mb, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour",
                                           num_tokens=float(mb.loss_lengths.sum()), num_seqs=4.0,
                                           log_entropy=True, entropy_coef=coef)
        result.loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None))
        mask = torch.arange(entropy.shape[1])[None, :] < mb.completion_lengths[:, None]
        return float(entropy.detach()[mask].mean()), norm

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert mean_entropy_and_grad_norm(model, 0.0)[1] == 0.0
    before, norm = mean_entropy_and_grad_norm(model, 0.5)
    assert norm > 0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(5):
        optimizer.zero_grad()
        mean_entropy_and_grad_norm(model, 0.5)
        optimizer.step()
    after, _ = mean_entropy_and_grad_norm(model, 0.5)
    assert after > before, (before, after)


@pytest.mark.slow
def test_the_steps_metrics_carry_the_bonus_as_coef_times_the_entropy(distributed, tiny_model_dir):
    from learner.engine import create_engine
    from learner.step import grpo_step
    from shared.config.schema import LearnerConfig

    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=4))
    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None)
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), CPU)
    micro = split_micro_batches(batch, torch.tensor([1.0, -1.0, -1.0, 1.0]), 1, False, CPU)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=False, chunk_tokens=None, entropy_coef=0.2)
    assert outcome.finite and outcome.metrics["entropy"] > 0
    assert outcome.metrics["entropy_bonus"] == pytest.approx(0.2 * outcome.metrics["entropy"], rel=1e-5)
