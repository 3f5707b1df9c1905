import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.advantages import batch_advantages
from learner.engine import (
    create_engine,
    deepspeed_config,
    lr_multiplier,
)
from learner.step import (
    grpo_step,
    micro_batch_loss,
    recompute_old_logprobs,
    split_micro_batches,
)
from ref_server.hub.rollout_hub import RolloutHub
from shared.config.schema import AdvantageConfig, LearnerConfig, LossConfig
from shared.forward.logprobs import naive_sequence_logprobs
from shared.grpo.losses import loss_normalizers
from tests.ref_server.helpers import make_group

from .batches import advantages_of, batch_of, sampled_groups

CPU = torch.device("cpu")


def make_engine(model_dir, **learner):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LearnerConfig(model=str(model_dir), tensorboard_dir=None, metrics_jsonl=None, **learner)
    return create_engine(cfg, model, CPU)


def completion_logprob_sums(model, batch):
    with torch.no_grad():
        lp = naive_sequence_logprobs(model, batch.input_ids, batch.prompt_lengths, batch.completion_lengths)
    return lp.sum(dim=1)


@pytest.mark.parametrize("scale, magnitudes", [
    ("group", [0.866025] * 8),                     # each group by its own std: both +-0.866
    ("batch", [0.5 / 4.49603] * 4 + [5.0 / 4.49603] * 4),  # one std for the batch: +-0.11 and +-1.11
    ("none", [0.5] * 4 + [5.0] * 4),               # Dr. GRPO: centred only
])
def test_advantages_through_the_learners_path_for_each_scale(scale, magnitudes):
    """Groups [0,1,0,1] and [0,10,0,10] as the hub hands them out, through the learner's advantage and
    micro-batch functions: ``scale: batch`` divides by the batch's std, not each group's."""
    hub = RolloutHub(capacity=4, max_staleness=1, scorer=None)
    for seed, rewards in ((0, [0.0, 1.0, 0.0, 1.0]), (1, [0.0, 10.0, 0.0, 10.0])):
        hub.put(make_group(seed=seed, rewards=rewards).to_bytes())
    batch = hub.take(2)
    advantages = batch_advantages(batch, AdvantageConfig(scale=scale, eps=1e-6))
    torch.testing.assert_close(advantages.abs(), torch.tensor(magnitudes), atol=1e-4, rtol=0)
    assert (advantages[batch.rewards > 0.5] > 0).all() and (advantages[batch.rewards < 0.5] < 0).all()
    first, second = split_micro_batches(batch, advantages, 2, False, CPU)
    assert torch.equal(torch.cat([first.advantages, second.advantages]), advantages)


@pytest.mark.slow
def test_one_step_moves_logprobs_the_way_the_advantages_say(distributed, tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=1)
    batch = batch_of(groups)
    engine = make_engine(tiny_model_dir, lr=1e-3, grad_clip=0.0, micro_batches=2, groups_per_step=2)
    before = completion_logprob_sums(engine.module, batch)
    micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour",
                        world_size=1, log_entropy=True, chunk_tokens=None)
    assert outcome.finite and math.isfinite(outcome.loss)
    assert outcome.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)  # sampled from this very model
    change = completion_logprob_sums(engine.module, batch) - before
    advantages = advantages_of(batch)
    positive, negative = advantages > 0, advantages < 0
    assert (change[positive] > 0).all() and (change[negative] < 0).all(), (advantages, change)


def hand_written_loss(model, batch, beta, eps):
    """Seed 001's objective written out token by token: token-mean of -min(rA, clip(r)A) + beta * k3."""
    logp_full = naive_sequence_logprobs(model, batch.input_ids, batch.prompt_lengths, batch.completion_lengths)
    total = torch.zeros(())
    count = 0
    for i in range(batch.batch_size):
        for t in range(int(batch.completion_lengths[i])):
            logp = logp_full[i, t]
            ratio = torch.exp(logp - batch.behaviour_logprobs[i, t])
            adv = advantages_of(batch)[i]
            surrogate = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
            log_r = batch.ref_logprobs[i, t] - logp
            k3 = torch.exp(log_r) - log_r - 1
            total = total - surrogate + beta * k3
            count += 1
    return total / count


def test_loss_and_gradients_equal_a_hand_written_reference(tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0]], seed=2)
    batch = batch_of(groups, with_ref=True)
    batch.behaviour_logprobs = batch.behaviour_logprobs - 0.2 * torch.rand(batch.behaviour_logprobs.shape)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LossConfig(beta=0.1, eps_low=0.2, eps_high=0.2, kl_estimator="k3")
    (mb,) = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    num_tokens, num_seqs = loss_normalizers(mb.loss_lengths)
    result, _ = micro_batch_loss(model, mb, cfg, temperature=1.0, old_mode="behaviour", num_tokens=num_tokens,
                                 num_seqs=num_seqs)
    result.loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = hand_written_loss(model, batch, beta=0.1, eps=0.2)
    reference.backward()
    assert result.loss.item() == pytest.approx(reference.item(), abs=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_mu_updates_keep_old_logprobs_fixed(distributed, tiny_model_dir):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=3))
    engine = make_engine(tiny_model_dir, lr=5e-3, groups_per_step=1, old_logprobs="recompute")
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    recompute_old_logprobs(engine.module, micro, 1.0, None)
    fixed = micro[0].old_logprobs.clone()
    first = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="recompute", world_size=1,
                      log_entropy=False, chunk_tokens=None)
    second = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="recompute", world_size=1,
                       log_entropy=False, chunk_tokens=None)
    assert torch.equal(micro[0].old_logprobs, fixed)
    assert first.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second.metrics["ratio_mean"] - 1.0) > 1e-4  # the policy moved away from the fixed pi_old
    # truncated IS weights compare the recomputed old logprobs with the sampler's: equal here -> 1
    assert first.metrics["is_weight_max"] == pytest.approx(1.0, abs=1e-3)


@pytest.mark.slow
def test_nonfinite_loss_skips_the_step_and_keeps_parameters(distributed, tiny_model_dir):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=4))
    batch.behaviour_logprobs[0, 0] = float("nan")  # poisons the ratio of a valid token
    engine = make_engine(tiny_model_dir, lr=1e-2, groups_per_step=1)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    outcome = grpo_step(engine, split_micro_batches(batch, advantages_of(batch), 1, False, CPU), LossConfig(beta=0.0), temperature=1.0,
                        old_mode="behaviour", world_size=1, log_entropy=False, chunk_tokens=None)
    assert not outcome.finite
    for name, param in engine.module.named_parameters():
        assert torch.equal(param, before[name]), name
    assert all(p.grad is None or not p.grad.abs().sum() for p in engine.module.parameters())


def test_mask_truncated_drops_cut_completions_from_the_loss(tiny_model_dir):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=5, max_tokens=3))
    batch.truncated = torch.tensor([True, False, True, False])
    (mb,) = split_micro_batches(batch, advantages_of(batch), 1, True, CPU)
    assert mb.loss_lengths.tolist() == [0, int(batch.completion_lengths[1]), 0, int(batch.completion_lengths[3])]


def test_lr_schedule_values():
    cfg = LearnerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", max_steps=6, min_lr_ratio=0.1)
    values = [lr_multiplier(cfg, s) for s in range(7)]
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[6] == pytest.approx(0.1)
    linear = LearnerConfig(lr=1.0, lr_schedule="linear", max_steps=4)
    assert [lr_multiplier(linear, s) for s in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_multiplier(LearnerConfig(), 0) == 1.0


def test_deepspeed_config_from_learner_config():
    config = deepspeed_config(LearnerConfig(zero_stage=2, offload_optimizer=True, groups_per_step=8,
                                            micro_batches=4, grad_clip=0.5, lr=3e-6), 2, CPU)
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert config["gradient_accumulation_steps"] == 4 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["gradient_clipping"] == 0.5 and config["optimizer"]["params"]["lr"] == 3e-6
    assert config["bf16"] == {"enabled": False} and config["managed_gradient_accumulation"] is False
    assert deepspeed_config(LearnerConfig(precision="bf16"), 1, CPU)["bf16"] == {"enabled": True}
    with pytest.raises(ValueError, match="micro_batches"):
        LearnerConfig(groups_per_step=2, micro_batches=3)
    with pytest.raises(ValueError, match="needs max_steps"):
        LearnerConfig(lr_schedule="cosine")


@pytest.mark.slow
def test_optimizer_needs_no_op_build(distributed, tiny_model_dir, monkeypatch):
    """torch's AdamW through DeepSpeed's torch_adam: no JIT compile of FusedAdam/CPU Adam at start-up (minutes of
    nvcc, and a crash where TORCH_CUDA_ARCH_LIST=9.0a), on the CPU, with offload, and in the config for a GPU."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"DeepSpeed tried to build or load the {self.name} op")

    monkeypatch.setattr(OpBuilder, "load", refuse)
    monkeypatch.setattr(OpBuilder, "jit_load", refuse)
    for learner in ({}, {"zero_stage": 2, "offload_optimizer": True}):
        engine = make_engine(tiny_model_dir, **learner)
        optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)
        assert isinstance(optimizer, torch.optim.AdamW), type(optimizer)
    gpu = deepspeed_config(LearnerConfig(zero_stage=3, offload_optimizer=True), 8, torch.device("cuda"))
    assert gpu["optimizer"]["params"]["torch_adam"] is True and gpu["bf16"] == {"enabled": True}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_stages_step_and_publish_full_parameters(distributed, tiny_model_dir, tmp_path, stage):
    from safetensors.torch import load_file

    from shared.weight_sync.export import write_safetensors

    engine = make_engine(tiny_model_dir, zero_stage=stage, lr=1e-3, groups_per_step=1)
    if stage == 3:
        assert all(hasattr(p, "ds_id") for p in engine.module.parameters())  # partitioned, gathered on demand
    write_safetensors(engine.module, tmp_path / "before.safetensors", is_writer=True)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = load_file(str(tmp_path / "before.safetensors"))
    for name, param in reference.named_parameters():
        assert torch.equal(before[name], param.detach()), name
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=6))
    outcome = grpo_step(engine, split_micro_batches(batch, advantages_of(batch), 1, False, CPU), LossConfig(beta=0.0), temperature=1.0,
                        old_mode="behaviour", world_size=1, log_entropy=True, chunk_tokens=None)
    assert outcome.finite and outcome.metrics["grad_norm"] > 0
    write_safetensors(engine.module, tmp_path / "after.safetensors", is_writer=True)
    after = load_file(str(tmp_path / "after.safetensors"))
    assert set(after) == set(before) and any(not torch.equal(after[n], before[n]) for n in before)


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update(distributed, tiny_model_dir):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=8))
    params = []
    for checkpointing in (False, True):
        engine = make_engine(tiny_model_dir, lr=1e-3, groups_per_step=1, gradient_checkpointing=checkpointing)
        engine.module.train()
        outcome = grpo_step(engine, split_micro_batches(batch, advantages_of(batch), 1, False, CPU), LossConfig(beta=0.0),
                            temperature=1.0, old_mode="behaviour", world_size=1, log_entropy=False,
                            chunk_tokens=None)
        assert outcome.finite
        params.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    for name, value in params[0].items():
        torch.testing.assert_close(params[1][name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_optimizer_offload_steps(distributed, tiny_model_dir):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=9))
    engine = make_engine(tiny_model_dir, lr=1e-3, groups_per_step=1, zero_stage=2, offload_optimizer=True)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    outcome = grpo_step(engine, split_micro_batches(batch, advantages_of(batch), 1, False, CPU), LossConfig(beta=0.0), temperature=1.0,
                        old_mode="behaviour", world_size=1, log_entropy=False, chunk_tokens=None)
    assert outcome.finite
    assert any(not torch.equal(p, before[n]) for n, p in engine.module.named_parameters())


@pytest.mark.slow
def test_zero3_accumulates_micro_batches_like_zero0(distributed, tiny_model_dir):
    """ZeRO-3's backward overwrites its gradient buffer unless told a new micro-batch began (DeepSpeed 0.19.8)."""
    from shared.weight_sync.params import iter_parameters

    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.5]], seed=6))
    params, norms = {}, {}
    for stage in (0, 3):
        # adam_eps=1 keeps the update proportional to the gradient, so a lost micro-batch shows in the parameters
        engine = make_engine(tiny_model_dir, zero_stage=stage, lr=1e-2, groups_per_step=2, micro_batches=2,
                             adam_eps=1.0, grad_clip=0.0)
        outcome = grpo_step(engine, split_micro_batches(batch, advantages_of(batch), 2, False, CPU), LossConfig(beta=0.0),
                            temperature=1.0, old_mode="behaviour", world_size=1, log_entropy=False,
                            chunk_tokens=None)
        assert outcome.finite
        norms[stage] = outcome.metrics.get("grad_norm")
        params[stage] = {n: t.detach().clone() for n, t in iter_parameters(engine.module)}
    assert norms[3] is not None and norms[3] > 0
    for name, value in params[0].items():
        torch.testing.assert_close(params[3][name], value, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_deepspeed_config_for_a_gpu_builds_without_any_op(distributed, tiny_model_dir, monkeypatch):
    """The config generated for device cuda (bf16, torch's fused AdamW) builds engines at ZeRO 0, 2 and 3 with
    every DeepSpeed op loader refusing: nothing in it asks for a compiled op. Built here on the CPU (DeepSpeed's
    accelerator), so no GPU is needed to know that the GPU learner starts without nvcc."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"DeepSpeed tried to build or load the {self.name} op")

    monkeypatch.setattr(OpBuilder, "load", refuse)
    monkeypatch.setattr(OpBuilder, "jit_load", refuse)
    cuda = torch.device("cuda")
    for stage in (0, 2, 3):
        cfg = LearnerConfig(model=str(tiny_model_dir), zero_stage=stage, tensorboard_dir=None, metrics_jsonl=None)
        config = deepspeed_config(cfg, 1, cuda)
        assert config["bf16"] == {"enabled": True}
        assert config["optimizer"]["params"]["torch_adam"] is True and config["optimizer"]["params"]["fused"] is True
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
        engine = create_engine(cfg, model, cuda)
        optimizer = engine.optimizer
        while hasattr(optimizer, "optimizer"):
            optimizer = optimizer.optimizer
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"] is True, stage
    # optimizer states in CPU memory: torch's AdamW there too (fused is for CUDA tensors)
    offload = deepspeed_config(LearnerConfig(zero_stage=2, offload_optimizer=True), 1, cuda)
    assert offload["optimizer"]["params"]["torch_adam"] is True and "fused" not in offload["optimizer"]["params"]


def _loss_and_grads(model, micro, loss_cfg):
    model.zero_grad()
    num_tokens, num_seqs = (sum(loss_normalizers(mb.loss_lengths)[i] for mb in micro) for i in (0, 1))
    total = 0.0
    for mb in micro:
        result, _ = micro_batch_loss(model, mb, loss_cfg, temperature=1.0, old_mode="behaviour",
                                     num_tokens=num_tokens, num_seqs=num_seqs)
        result.loss.backward()
        total += float(result.loss.detach())
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_packed_token_budget_micro_batches_equal_one_padded_batch(tiny_model_dir, aggregation):
    """Rows of different lengths: one padded micro-batch against micro-batches cut by a token budget (rows of
    mixed groups) run packed, and padded: the same loss (global normalisers) and gradients within 1e-5."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5, 0.2], [0.0, 2.0, 1.0, 0.3]], seed=4, max_tokens=12)
    batch = batch_of(groups, with_ref=True)
    # the untrained model rarely samples its end token: cut the completions to different lengths
    batch.completion_lengths = torch.minimum(batch.completion_lengths, torch.tensor([12, 3, 7, 1, 10, 5, 12, 8]))
    total = (batch.prompt_lengths + batch.completion_lengths).tolist()
    assert len(set(total)) > 2, total  # mixed lengths, or there is no padding to remove
    advantages = advantages_of(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LossConfig(beta=0.05, aggregation=aggregation)
    reference = _loss_and_grads(model, split_micro_batches(batch, advantages, 1, False, CPU), cfg)
    budget = 2 * max(total)
    for packing in ("packed", "padded"):
        micro = split_micro_batches(batch, advantages, 1, False, CPU, token_budget=budget, packing=packing)
        assert len(micro) >= 3 and all(mb.layout == packing for mb in micro)
        assert sum(mb.input_ids.shape[0] for mb in micro) == batch.batch_size
        for mb in micro:
            lengths = (mb.prompt_lengths + mb.completion_lengths).tolist()
            cost = sum(lengths) if packing == "packed" else len(lengths) * max(lengths)
            assert cost <= budget or len(lengths) == 1
        loss, grads = _loss_and_grads(model, micro, cfg)
        assert loss == pytest.approx(reference[0], abs=1e-5)
        for name, grad in reference[1].items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=f"{packing} {name}")


def test_token_budget_keeps_each_row_once_with_its_own_data(tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5], [0.0, 2.0, 1.0], [0.3, 0.1, 0.9]], seed=5,
                            max_tokens=10)
    batch = batch_of(groups)
    batch.completion_lengths = torch.minimum(batch.completion_lengths, torch.tensor([10, 2, 7, 1, 9, 5, 10, 4, 3]))
    advantages = advantages_of(batch)
    micro = split_micro_batches(batch, advantages, 2, False, CPU, token_budget=40, packing="packed")
    assert len(micro) >= 2
    seen = []
    for mb in micro:
        for i in range(mb.input_ids.shape[0]):
            # find the batch row this is: same ids over its length and the same advantage
            n = int(mb.prompt_lengths[i] + mb.completion_lengths[i])
            match = [r for r in range(batch.batch_size)
                     if int(batch.prompt_lengths[r] + batch.completion_lengths[r]) == n
                     and torch.equal(batch.input_ids[r, :n], mb.input_ids[i, :n])
                     and float(advantages[r]) == float(mb.advantages[i]) and r not in seen]
            assert match, (mb, i)
            seen.append(match[0])
            c = int(mb.completion_lengths[i])
            assert torch.equal(mb.behaviour_logprobs[i, :c], batch.behaviour_logprobs[match[0], :c])
    assert sorted(seen) == list(range(batch.batch_size))


@pytest.mark.slow
def test_step_reports_the_gap_to_the_behaviour_logprobs(distributed, tiny_model_dir):
    """logprob_diff_mean / _max: |learner logprob - generator logprob| over every sampled token, from the
    logprobs of the step's own forward (checked against a separate naive computation before the update)."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.5]], seed=11)
    batch = batch_of(groups)
    gen = torch.Generator().manual_seed(0)
    batch.behaviour_logprobs = batch.behaviour_logprobs - 0.3 * torch.rand(batch.behaviour_logprobs.shape,
                                                                            generator=gen)
    engine = make_engine(tiny_model_dir, lr=1e-3, groups_per_step=2, micro_batches=2)
    with torch.no_grad():
        learner = naive_sequence_logprobs(engine.module, batch.input_ids, batch.prompt_lengths,
                                          batch.completion_lengths)
    mask = torch.arange(learner.shape[1]) < batch.completion_lengths[:, None]
    gap = (learner - batch.behaviour_logprobs[:, :learner.shape[1]]).abs()[mask]
    micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU, token_budget=None)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=False, chunk_tokens=None)
    assert outcome.finite
    assert gap.mean() > 0.05  # the perturbation shows
    assert outcome.metrics["logprob_diff_mean"] == pytest.approx(float(gap.mean()), abs=1e-5)
    assert outcome.metrics["logprob_diff_max"] == pytest.approx(float(gap.max()), abs=1e-5)
    assert "sampled_tokens" not in outcome.metrics and "logprob_diff_sum" not in outcome.metrics


def test_cpu_device_selects_deepspeeds_cpu_accelerator():
    """On a GPU machine DeepSpeed picks CUDA and would move a ``device: cpu`` learner's model to the GPU (the CPU
    tests here would then mix devices). Simulated by installing DeepSpeed's CUDA accelerator object."""
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from learner.engine import match_accelerator

    original = get_accelerator()
    try:
        set_accelerator(CUDA_Accelerator())
        match_accelerator(torch.device("cuda"))
        assert get_accelerator().device_name() == "cuda"
        match_accelerator(CPU)
        assert get_accelerator().device_name() == "cpu"
    finally:
        set_accelerator(original)


@pytest.mark.slow
def test_attn_implementation_is_set_on_the_model_or_refused_by_name(distributed, tiny_model_dir):
    from learner.engine import LearnerSetupError

    engine = make_engine(tiny_model_dir, attn_implementation="eager")
    assert engine.module.config._attn_implementation == "eager"
    with pytest.raises(LearnerSetupError, match="learner.attn_implementation 'no_such_kernel'"):
        make_engine(tiny_model_dir, attn_implementation="no_such_kernel")


def test_batch_metrics_count_constant_groups_and_staleness():
    from learner.metrics import batch_metrics

    groups = [make_group(seed=0, rewards=[1.0, 1.0, 1.0, 1.0], version=2),   # constant
              make_group(seed=1, rewards=[0.0, 1.0, 0.0, 0.0], version=3),
              make_group(seed=2, rewards=[0.5, 0.5, 0.5, 0.5], version=3),   # constant
              make_group(seed=3, rewards=[-1.0, 2.0, 2.0, 2.0], version=1)]
    batch = batch_of(groups)
    metrics = batch_metrics(batch, torch.zeros(batch.batch_size), current_version=4)
    assert metrics["zero_variance_group_frac"] == 0.5
    assert metrics["staleness_max"] == 3.0 and metrics["staleness_mean"] == pytest.approx((2 + 1 + 1 + 3) / 4)
    assert metrics["reward_mean"] == pytest.approx(sum(sum(g.rewards.tolist()) for g in groups) / 16)


@pytest.mark.slow
def test_prefix_sharing_applies_the_padded_update_under_zero0_and_zero3(distributed, tiny_model_dir):
    """One prompt pass per group calls the body twice per micro-batch; ZeRO-3 gathers the parameters for both and
    the update equals the padded step's (two micro-batches, groups of 4 sharing a prompt)."""
    from shared.weight_sync.params import iter_parameters

    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.5]], seed=6))
    params = {}
    for stage, sharing in ((0, "off"), (0, "on"), (3, "on")):
        engine = make_engine(tiny_model_dir, zero_stage=stage, lr=1e-2, groups_per_step=2, micro_batches=2,
                             adam_eps=1.0, grad_clip=0.0)
        micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU, prefix_sharing=sharing)
        assert all((mb.prefix is not None) == (sharing == "on") for mb in micro)
        outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour",
                            world_size=1, log_entropy=True, chunk_tokens=None)
        assert outcome.finite
        params[stage, sharing] = {n: t.detach().clone() for n, t in iter_parameters(engine.module)}
    for name, value in params[0, "off"].items():
        torch.testing.assert_close(params[0, "on"][name], value, atol=1e-6, rtol=1e-5, msg=name)
        torch.testing.assert_close(params[3, "on"][name], value, atol=1e-6, rtol=1e-5, msg=name)
