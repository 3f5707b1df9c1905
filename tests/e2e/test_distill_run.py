"""End to end, on-policy distillation (issue 42 item 4): `grpo run` on the tiny model with a teacher (the same tiny
model trained longer on the arithmetic task) served by the ref server, pure distillation (``supervision: none``):
the learner logs distill_reverse_kl every step and it falls as the student moves towards the teacher; with
``mode: topk_forward_kl`` (the teacher's top-k per token on the wire, a forward-KL loss term) distill_forward_kl
falls too."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from deploy.demo.tiny_model import build_tiny_model_dir
from shared.config.schema import DemoConfig
from tests import service_forks as forks
from tests.e2e.test_run import free_port, stray_processes

GRPO = str(Path(sys.executable).parent / "grpo")
STEPS = 40


def warmed(path: Path, steps: int) -> Path:
    """The tiny model after ``steps`` supervised warm-up steps on arithmetic (same seed: same start, same tokenizer)."""
    build_tiny_model_dir(path, seed=0, warmup=DemoConfig(
        warmup_steps=steps, batch_size=32, warmup_lr_ramp_steps=5, warmup_min_lr_ratio=0.1,
        warmup_target_accuracy=None, flawed_steps=0, flawed_target_accuracy=None, heldout_examples=10))
    return path


def write_config(tmp_path, student: Path, teacher: Path, port: int, mode: str = "reverse_kl") -> Path:
    config = {
        "seed": 0,
        "algorithm": {"advantage": {"supervision": "none"}, "loss": {"beta": 0.0},
                      "distill": {"coef": 1.0, "student": "recompute", "mode": mode, "top_k": 8}},
        "ref_server": {"port": port, "spool_dir": str(tmp_path / "spool"), "weights_dir": str(tmp_path / "relay"),
                       "queue_capacity": 16, "teacher_model": str(teacher), "device": "cpu", "dtype": "float32"},
        "generator": {"model": str(student), "engine": "transformers", "group_size": 4, "prompts_per_batch": 8,
                      "sampling": {"max_tokens": 12, "temperature": 1.0},
                      "weights_dir": str(tmp_path / "gen-weights")},
        "learner": {"model": str(student), "groups_per_step": 8, "max_steps": STEPS, "lr": 3e-4,
                    "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
                    "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None, "batch_wait_s": 2.0},
        "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["reverse_kl", "topk_forward_kl"])
def test_grpo_run_distils_towards_the_teacher(tmp_path, mode):
    student, teacher = warmed(tmp_path / "student", 20), warmed(tmp_path / "teacher", 200)
    config = write_config(tmp_path, student, teacher, free_port(), mode)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=800, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    kl = [m["distill_reverse_kl"] for m in metrics]
    assert all(math.isfinite(v) for v in kl)
    print("distill_reverse_kl per step:", [round(v, 3) for v in kl])
    first, last = sum(kl[:8]) / 8, sum(kl[-8:]) / 8
    assert first > 0.1 and last < 0.8 * first, kl  # the student moved towards the teacher on its own samples
    if mode == "topk_forward_kl":  # the loss term's own measure, logged every step, falls as well
        forward = [m["distill_forward_kl"] for m in metrics]
        print("distill_forward_kl per step:", [round(v, 3) for v in forward])
        assert all(math.isfinite(v) for v in forward)
        assert sum(forward[-8:]) / 8 < 0.85 * sum(forward[:8]) / 8, forward  # measured 0.40 -> 0.30
    assert stray_processes(str(config)) == []
