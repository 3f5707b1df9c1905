"""`grpo demo`'s starting policy: built as the config's demo section says, reused only when it matches."""

from __future__ import annotations

import json

import pytest

from deploy.demo.run import build_model
from deploy.demo.warmup import WarmupTargetMissed
from shared.config.loader import load_config

CONFIG = "deploy/configs/tiny-cpu.yaml"


@pytest.mark.slow
def test_demo_model_is_reused_only_when_its_settings_match(tmp_path):
    model_dir = tmp_path / "tiny"
    # targets met at the first check (0% >= 0%, anything <= 100%): the target path, cheaply
    cheap = [f"generator.model={model_dir}", "demo.warmup_max_steps=3", "demo.warmup_target_accuracy=0",
             "demo.warmup_check_every=2", "demo.flawed_target_accuracy=1", "demo.flawed_check_every=1",
             "demo.flawed_steps=2"]
    first = build_model(load_config(CONFIG, cheap))
    assert first["warmup_steps"] == 2 and first["flawed_steps"] == 1
    assert [step for step, _ in first["validation_checks"]["clean_phase"]] == [2]
    assert [step for step, _ in first["validation_checks"]["flawed_phase"]] == [1]
    assert first["validation_n"] == 500 and first["validation_accuracy"] is not None
    weights = model_dir / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert build_model(load_config(CONFIG, cheap)) == first
    assert weights.stat().st_mtime_ns == built_at  # not rebuilt
    changed = build_model(load_config(CONFIG, cheap[:-1] + ["demo.flawed_steps=1", "demo.flawed_check_every=5"]))
    assert changed["flawed_steps"] == 1
    assert json.loads((model_dir / "grpo_tiny_model.json").read_text())["flawed_steps"] == 1


@pytest.mark.slow
def test_demo_fails_when_a_cap_comes_before_its_target(tmp_path):
    settings = [f"generator.model={tmp_path / 'tiny'}", "demo.warmup_max_steps=2", "demo.warmup_check_every=2",
                "demo.warmup_target_accuracy=0.9"]
    with pytest.raises(WarmupTargetMissed, match=r"cap of 2 steps .* demo\.warmup_target_accuracy"):
        build_model(load_config(CONFIG, settings))
    assert not (tmp_path / "tiny" / "grpo_tiny_model.json").exists()  # nothing half-built is reused later


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~1500 SFT steps + ~30 checks: 5-10 min on 2 cores, more when they are shared
def test_demo_starting_point_knows_arithmetic_but_answers_like_its_teacher(tmp_path):
    """The contract the demo's learning target rests on: the correct demonstrations teach the task (greedy
    validation accuracy >= the target before the cap), the flawed teacher's fine-tuning pulls it into the
    target band before its cap, and held-out accuracy, which no check looks at, agrees with both. Targets
    rather than step counts keep this true at any thread count (the accuracy jump moves with the numerics)."""
    config = load_config(CONFIG, [f"generator.model={tmp_path / 'tiny'}"])
    demo = config.demo
    stats = build_model(config)
    assert stats["validation_accuracy_clean_phase"] >= demo.warmup_target_accuracy, stats
    assert stats["warmup_steps"] < demo.warmup_max_steps, stats
    assert stats["validation_accuracy"] <= demo.flawed_target_accuracy, stats
    assert stats["flawed_steps"] < demo.flawed_steps, stats
    # held-out accuracy is measured on other problems than the checks: within sampling noise of the target
    assert stats["heldout_accuracy_clean_phase"] >= demo.warmup_target_accuracy - 0.07, stats
    assert 0.3 < stats["heldout_accuracy"] < 0.65, stats  # measured: 7.6 points above the validation check
    assert stats["heldout_format_rate"] >= 0.95, stats
