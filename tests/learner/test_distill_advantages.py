"""On-policy distillation in the learner (issue 42 item 2): the teacher's per-token reward added to the advantages
(by hand), pure distillation with ``supervision: none``, the student from the behaviour logprobs or recomputed, the
metric, and the config refusing a distill block without a teacher."""

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from learner.advantages import batch_advantages, distill_metrics, distill_student
from shared.config.loader import ConfigError, load_config
from shared.config.schema import AdvantageConfig, DistillConfig, GRPOConfig, KLConfig
from shared.protocol.records import RolloutGroup, TrainBatch

CPU = torch.device("cpu")


def batch(teacher=((-0.5, -3.0, -1.0), (-2.0, -1.0))):
    """Two completions of one group (3 and 2 tokens, behaviour -1 everywhere), rewards 1 and 0: outcome advantages
    +-0.7071 (group std of [1, 0] is 0.7071, eps 1e-6)."""
    group = RolloutGroup.from_samples(
        prompt_ids=[1, 2], completion_ids=[[3, 4, 5], [6, 7]], behaviour_logprobs=[[-1.0] * 3, [-1.0] * 2],
        rewards=[1.0, 0.0], finish_reasons=["stop", "stop"], policy_version=0, generator_id="gen", group_id="g")
    teachers = [torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in teacher], batch_first=True)]
    return TrainBatch.from_bytes(TrainBatch.from_groups([group], None, teacher_logprobs=teachers).to_bytes())


def test_the_teacher_reward_is_added_to_each_token_by_hand():
    b = batch()
    # student (behaviour) - teacher = [[-0.5, 2, 0], [1, 0]]; coef 0.5: rewards [[0.25, -1, 0], [-0.5, 0]]
    got = batch_advantages(b, AdvantageConfig(eps=1e-6), None, DistillConfig(coef=0.5, student="behaviour"),
                           b.behaviour_logprobs)
    a = 0.7071063
    torch.testing.assert_close(got, torch.tensor([[a + 0.25, a - 1.0, a], [-a - 0.5, -a, 0.0]]), atol=1e-5, rtol=0)
    alone = batch_advantages(b, AdvantageConfig(supervision="none"), None, DistillConfig(coef=0.5),
                             b.behaviour_logprobs)
    torch.testing.assert_close(alone, torch.tensor([[0.25, -1.0, 0.0], [-0.5, 0.0, 0.0]]))
    # baseline mean: the five model tokens' rewards [0.25, -1, 0, -0.5, 0] less their mean -0.25
    centred = batch_advantages(b, AdvantageConfig(supervision="none"), None,
                               DistillConfig(coef=0.5, baseline="mean"), b.behaviour_logprobs)
    torch.testing.assert_close(centred, torch.tensor([[0.5, -0.75, 0.25], [-0.25, 0.25, 0.0]]))
    assert distill_metrics(b, b.behaviour_logprobs) == {"distill_reverse_kl": pytest.approx((-0.5 + 2 + 0 + 1) / 5)}
    assert distill_metrics(b, None) == {}
    # supervision none without distillation teaches nothing; distillation without a teacher in the batch is named
    assert torch.equal(batch_advantages(b, AdvantageConfig(supervision="none")), torch.zeros(2))
    b.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher_model"):
        batch_advantages(b, AdvantageConfig(), None, DistillConfig(), b.behaviour_logprobs)


def test_with_the_kl_in_the_reward_the_teacher_reward_has_no_return_to_go():
    b = batch()
    b.ref_logprobs = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, 0.0]])
    kl = KLConfig(in_reward=True, beta=0.1)
    without = batch_advantages(b, AdvantageConfig(eps=1e-6), kl)
    with_teacher = batch_advantages(b, AdvantageConfig(eps=1e-6), kl, DistillConfig(coef=1.0), b.behaviour_logprobs)
    torch.testing.assert_close(with_teacher - without, torch.tensor([[0.5, -2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_recompute_scores_the_student_with_the_learner_model(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    b = batch()
    assert distill_student(model, b, CPU, None, None) is None
    assert distill_student(model, b, CPU, DistillConfig(student="behaviour"), None) is b.behaviour_logprobs
    student = distill_student(model, b, CPU, DistillConfig(student="recompute"), None)
    with torch.no_grad():
        logits = model(b.input_ids[:1, :5]).logits[0].log_softmax(-1)
    want = logits[[1, 2, 3], b.input_ids[0, 2:5]]  # positions 1..3 predict tokens 2..4 (the completion)
    torch.testing.assert_close(student[0, :3], want, atol=1e-5, rtol=0)
    assert student.shape == b.behaviour_logprobs.shape and float(student[1, 2]) == 0.0


def test_a_distill_block_needs_a_teacher_at_load():
    with pytest.raises(ConfigError, match="algorithm.distill needs a teacher.*ref_server.teacher_model"):
        load_config(None, ["algorithm.distill.coef=0.5"])
    config = load_config(None, ["algorithm.distill.coef=0.5", "ref_server.teacher_model=/t",
                                "algorithm.advantage.supervision=none"])
    assert config.algorithm.distill == DistillConfig(coef=0.5) and config.algorithm.distill.student == "recompute"
    with pytest.raises(ConfigError, match="drop_constant_groups"):
        load_config(None, ["algorithm.distill.coef=0.5", "ref_server.teacher_model=/t",
                           "generator.drop_constant_groups=true"])
    with pytest.raises(ValidationError, match="mode"):
        GRPOConfig.model_validate({"algorithm": {"distill": {"mode": "forward_kl"}},
                                   "ref_server": {"teacher_model": "/t"}})
