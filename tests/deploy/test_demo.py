"""`grpo demo`'s starting policy: built as the config's demo section says, reused only when it matches."""

from __future__ import annotations

import json

import pytest

from deploy.demo.run import build_model
from shared.config import load_config

CONFIG = "deploy/configs/tiny-cpu.yaml"


def test_demo_model_is_reused_only_when_its_settings_match(tmp_path):
    model_dir = tmp_path / "tiny"
    cheap = [f"generator.model={model_dir}", "demo.warmup_steps=3", "demo.flawed_steps=2"]
    first = build_model(load_config(CONFIG, cheap))
    assert first["warmup_steps"] == 3 and first["flawed_steps"] == 2
    weights = model_dir / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert build_model(load_config(CONFIG, cheap)) == first
    assert weights.stat().st_mtime_ns == built_at  # not rebuilt
    changed = build_model(load_config(CONFIG, cheap[:-1] + ["demo.flawed_steps=1"]))
    assert changed["flawed_steps"] == 1
    assert json.loads((model_dir / "grpo_tiny_model.json").read_text())["flawed_steps"] == 1


@pytest.mark.slow
def test_demo_starting_point_knows_arithmetic_but_answers_like_its_teacher(tmp_path):
    """The contract the demo's learning target rests on (seed 0): the correct demonstrations teach the task, the
    flawed teacher's fine-tuning pulls greedy accuracy under 60%."""
    stats = build_model(load_config(CONFIG, [f"generator.model={tmp_path / 'tiny'}"]))
    assert stats["heldout_accuracy_clean_phase"] >= 0.9, stats
    assert 0.3 < stats["heldout_accuracy"] < 0.6, stats
    assert stats["heldout_format_rate"] >= 0.95, stats
