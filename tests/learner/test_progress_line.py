"""The learner's per-step progress line (what `grpo run` shows) and the batch accuracy it reports."""

import logging

import pytest
import torch

from learner import metrics as learner_metrics
from learner.metrics import MetricsLogger, accuracy_judge, batch_metrics, progress_line
from shared.config.schema import GRPOConfig
from tests.ref_server.helpers import make_group

from .batches import batch_of


def test_batch_accuracy_is_the_share_of_completions_the_judging_reward_scores_correct():
    groups = [make_group(seed=0, rewards=[1.0, 1.0, 1.0, 1.0]), make_group(seed=1, rewards=[0.0, 1.0, 0.0, 0.0]),
              make_group(seed=2, rewards=[0.5, 0.5, 0.5, 0.5]), make_group(seed=3, rewards=[-1.0, 2.0, 2.0, 2.0])]
    batch = batch_of(groups)
    zeros = torch.zeros(batch.batch_size)
    assert batch_metrics(batch, zeros, 0, judge=("correct", 1.0))["accuracy"] == pytest.approx(8 / 16)
    assert batch_metrics(batch, zeros, 0, judge=("correct", 0.5))["accuracy"] == pytest.approx(12 / 16)
    assert "accuracy" not in batch_metrics(batch, zeros, 0, judge=("format", 1.0))  # not a reward of this batch
    assert "accuracy" not in batch_metrics(batch, zeros, 0)


def test_the_judge_is_the_evaluations():
    rewards = [{"name": "arithmetic", "label": "sum"}, {"name": "format"}]
    assert accuracy_judge(GRPOConfig.model_validate({"generator": {"rewards": rewards}})) == ("sum", 1.0)
    assert accuracy_judge(GRPOConfig.model_validate({"generator": {"rewards": rewards}, "eval": {
        "accuracy_reward": "format", "threshold": 0.5}})) == ("format", 0.5)


def test_progress_line_fields():
    metrics = {"reward_mean": 0.53125, "accuracy": 0.5, "loss": 0.012345, "tokens_per_s": 2345.6, "kl_mean": 0.1}
    assert progress_line(12, 150, metrics, 185.0) == (
        "progress: step 12/150 (8%) | reward 0.531 | batch accuracy 50.0% | loss 0.01235 | 2,346 tokens/s | "
        "ETA 3m05s")
    assert progress_line(3, None, {"reward_mean": 1.0}, None) == "progress: step 3 | reward 1.000"


def test_the_eta_is_the_pace_since_the_first_step_logged(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(learner_metrics.time, "monotonic", lambda: now[0])
    logger = MetricsLogger(jsonl=None, tensorboard_dir=None, wandb_project=None, enabled=True, total_steps=30)
    with caplog.at_level(logging.INFO, logger="grpo.learner"):
        for step in (11, 12, 13):  # a run resumed at step 10: 2 s per step from its first new step
            logger.log(step, {"reward_mean": 0.5})
            now[0] += 2.0
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["progress: step 11/30 (37%) | reward 0.500",
                     "progress: step 12/30 (40%) | reward 0.500 | ETA 36s",
                     "progress: step 13/30 (43%) | reward 0.500 | ETA 34s"]
