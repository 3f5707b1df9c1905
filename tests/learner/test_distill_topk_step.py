"""Top-k logit distillation in the learner (algorithm.distill.mode topk_forward_kl): the loss term by hand on the
tiny model (coef x token-mean of the forward KL against the full log-softmax), the advantages left alone, and
steps whose only signal is the term moving the student's top-k distribution towards a teacher's."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model
from learner.advantages import batch_advantages
from learner.step import grpo_step, micro_batch_loss, split_micro_batches
from ref_server.scoring.top_logprobs import sequence_top_logprobs
from shared.config.schema import AdvantageConfig, DistillConfig, GRPOConfig, LossConfig
from shared.grpo.distill import topk_forward_kl_loss_terms

from .batches import batch_of, sampled_groups

CPU = torch.device("cpu")
K = 8


@pytest.fixture(scope="module")
def teacher():
    """Another tiny model (other weights, the tiny model's tokenizer)."""
    return build_tiny_model(build_char_tokenizer(), TinyModelSpec(seed=7)).float().eval()


def with_teacher_topk(batch, teacher, k=K):
    """The batch as the hub hands it out under topk_forward_kl: the teacher's top-k per completion token."""
    with torch.no_grad():
        top = sequence_top_logprobs(teacher, batch.input_ids, batch.prompt_lengths, batch.completion_lengths, k=k,
                                    temperature=batch.temperature)
    width = batch.behaviour_logprobs.shape[1]
    batch.teacher_topk_ids = top.top_ids[:, :width].int()
    batch.teacher_topk_logprobs = top.top_logprobs[:, :width]
    batch.teacher_logprobs = top.logprobs
    return batch


def student_forward_kl(model, batch) -> float:
    """The mean over completion tokens of the forward KL from the teacher's top-k to ``model``, from the full
    ``[B, T, V]`` log-softmax (not the chunked path under test)."""
    with torch.no_grad():
        mask = (torch.arange(batch.input_ids.shape[1])[None] <
                (batch.prompt_lengths + batch.completion_lengths)[:, None]).long()
        logp = model(input_ids=batch.input_ids, attention_mask=mask).logits.float().log_softmax(-1)
    width = batch.behaviour_logprobs.shape[1]
    student = torch.zeros(batch.batch_size, width, batch.teacher_topk_ids.shape[2])
    for i, (p, c) in enumerate(zip(batch.prompt_lengths.tolist(), batch.completion_lengths.tolist())):
        student[i, :c] = logp[i, p - 1:p - 1 + c].gather(-1, batch.teacher_topk_ids[i, :c].long())
    terms = topk_forward_kl_loss_terms(student, batch.teacher_topk_logprobs, batch.completion_lengths)
    return float(terms.sum() / batch.completion_lengths.sum())


def test_the_term_is_coef_times_the_token_mean_of_the_forward_kl(tiny_model_dir, teacher):
    batch = with_teacher_topk(batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=2)), teacher)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    (mb,) = split_micro_batches(batch, advantages, 1, False, CPU)
    tokens = float(mb.loss_lengths.sum())
    common = dict(temperature=1.0, old_mode="behaviour", num_tokens=tokens, num_seqs=4.0)
    plain, _ = micro_batch_loss(model, mb, LossConfig(beta=0.0), **common)
    with_kl, _ = micro_batch_loss(model, mb, LossConfig(beta=0.0), distill_coef=0.3, **common)
    want = student_forward_kl(model, batch)
    assert want > 0.05
    assert float(with_kl.metrics["distill_forward_kl"]) == pytest.approx(want, rel=1e-4)
    assert float(with_kl.loss.detach()) == pytest.approx(float(plain.loss.detach()) + 0.3 * want, rel=1e-4)
    assert "distill_forward_kl" not in plain.metrics


def test_the_advantages_carry_no_reverse_kl_reward_and_a_batch_without_topk_is_named(tiny_model_dir, teacher):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]], seed=2))
    distill = DistillConfig(mode="topk_forward_kl", top_k=K)
    with pytest.raises(ValueError, match="topk_forward_kl needs the teacher's top-k"):
        batch_advantages(batch, AdvantageConfig(), distill=distill, student=batch.behaviour_logprobs)
    batch = with_teacher_topk(batch, teacher)
    got = batch_advantages(batch, AdvantageConfig(), distill=distill, student=batch.behaviour_logprobs)
    assert torch.equal(got, batch_advantages(batch, AdvantageConfig()))  # [B], the outcome's alone


def test_config_needs_a_teacher_naming_the_keys_and_bounds_top_k():
    with pytest.raises(ValueError, match=r"algorithm.distill.mode topk_forward_kl.*ref_server.teacher_model"):
        GRPOConfig.model_validate({"algorithm": {"distill": {"mode": "topk_forward_kl"}},
                                   "generator": {"drop_constant_groups": False}})
    for bad in (0, 257, 2.5):
        with pytest.raises(ValueError, match="top_k"):
            DistillConfig(mode="topk_forward_kl", top_k=bad)
    assert DistillConfig(mode="topk_forward_kl").top_k == 16
    config = GRPOConfig.model_validate({"algorithm": {"distill": {"mode": "topk_forward_kl", "top_k": 4}},
                                        "ref_server": {"teacher_model": "t"}, "generator": {"drop_constant_groups": False}})
    assert config.algorithm.distill_top_k == 4 and not config.algorithm.token_advantages
    reverse = GRPOConfig.model_validate({"algorithm": {"distill": {"coef": 1.0}}, "ref_server": {"teacher_model": "t"},
                                         "generator": {"drop_constant_groups": False}})
    assert reverse.algorithm.distill_top_k == 0 and reverse.algorithm.token_advantages


def test_with_zero_advantages_the_term_alone_pulls_the_student_towards_the_teacher(tiny_model_dir, teacher):
    """Pure distillation (every advantage 0): a few SGD steps on the term lower the forward KL from the teacher's
    top-k to the student, measured with the full log-softmax, and raise the student's mass on the teacher's top-1."""
    batch = with_teacher_topk(batch_of(sampled_groups(tiny_model_dir, [[1.0] * 4, [0.0] * 4], seed=5)), teacher)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    (mb,) = split_micro_batches(batch, torch.zeros(batch.batch_size), 1, False, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before, history = student_forward_kl(model, batch), []
    for _ in range(6):
        optimizer.zero_grad()
        result, _ = micro_batch_loss(model, mb, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour",
                                     num_tokens=float(mb.loss_lengths.sum()), num_seqs=8.0, distill_coef=1.0)
        result.loss.backward()
        optimizer.step()
        history.append(float(result.metrics["distill_forward_kl"]))
    after = student_forward_kl(model, batch)
    print("distill_forward_kl per step:", [round(v, 4) for v in history], "after:", round(after, 4))
    assert history[0] == pytest.approx(before, rel=1e-4)
    assert after < 0.8 * before, (before, after, history)
    assert all(b < a for a, b in zip(history, history[1:])), history


@pytest.mark.slow
def test_grpo_steps_log_a_falling_forward_kl(distributed, tiny_model_dir, teacher):
    """Through the DeepSpeed engine, with an outcome signal beside it (GRPO + distillation): every step logs
    distill_forward_kl, and it falls."""
    from learner.engine import create_engine
    from shared.config.schema import LearnerConfig

    batch = with_teacher_topk(batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 1.0]] * 2, seed=6)), teacher)
    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=3e-3, grad_clip=0.0)
    engine = create_engine(cfg, AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), CPU)
    advantages = batch_advantages(batch, AdvantageConfig(), distill=DistillConfig(mode="topk_forward_kl"),
                                  student=batch.behaviour_logprobs)
    micro = split_micro_batches(batch, advantages, 2, False, CPU)
    values = []
    for _ in range(5):
        outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour",
                            world_size=1, log_entropy=False, chunk_tokens=None, distill_coef=1.0)
        assert outcome.finite and math.isfinite(outcome.metrics["distill_forward_kl"])
        values.append(outcome.metrics["distill_forward_kl"])
    print("distill_forward_kl per step:", [round(v, 4) for v in values])
    assert values[-1] < 0.8 * values[0], values


def test_the_learner_refuses_a_hub_that_sends_another_top_k():
    from learner.engine import LearnerSetupError
    from learner.session import check_hub

    class Hub:
        def __init__(self, top_k):
            self.top_k = top_k

        def health(self):
            return {"reference_model_loaded": False, "teacher_model": "teacher", "teacher_top_k": self.top_k}

        def weights_version(self):
            return None

        def hub_stats(self):
            return {"learner_version": 0}

    config = GRPOConfig.model_validate({"algorithm": {"loss": {"beta": 0.0},
                                                      "distill": {"mode": "topk_forward_kl", "top_k": 4}},
                                        "ref_server": {"teacher_model": "t"}, "generator": {"drop_constant_groups": False}})
    assert check_hub(Hub(4), config, resume=False, version=0) == (None, 0)
    for other in (0, 16):
        with pytest.raises(LearnerSetupError, match=f"top_k 4, but the ref server .* sends the teacher's top {other}"):
            check_hub(Hub(other), config, resume=False, version=0)
