"""bench/distill.py's arms (valid run configs), its steps / wall seconds to the target and its table, on hand-made
runs (no grpo run)."""

from pathlib import Path

import pytest

from bench.distill import ARMS, arm_settings, parse, reached, table
from bench.vs_trl import prepare_config
from bench.vs_trl_runs import grpo_config
from shared.config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arm", ARMS)
def test_every_arm_is_a_config_the_run_accepts(tmp_path, arm):
    config = prepare_config(str(ROOT / "deploy/configs/tiny-cpu.yaml"), 10, [])
    teacher = tmp_path / "teacher"
    (tmp_path / "run").mkdir()
    path = grpo_config(config, tmp_path / "run", 8487, "cpu", str(tmp_path / "student"), seed=3,
                       **arm_settings(arm, teacher, 0.5, "none"))
    loaded = load_config(str(path), [])
    assert loaded.seed == 3
    distill = loaded.algorithm.distill
    if arm == "grpo":
        assert distill is None and loaded.ref_server.teacher_model is None
        assert loaded.generator.drop_constant_groups is config.generator.drop_constant_groups
        assert loaded.algorithm.advantage.supervision == "outcome"
        return
    assert (distill.coef, distill.mode, distill.student, distill.baseline) == (0.5, "reverse_kl", "recompute", "none")
    assert Path(loaded.ref_server.teacher_model) == teacher and not loaded.generator.drop_constant_groups
    assert loaded.algorithm.advantage.supervision == ("none" if arm == "distill" else "outcome")


@pytest.mark.parametrize("arm", ["distill", "grpo+distill"])
def test_the_topk_mode_makes_arms_the_run_accepts(tmp_path, arm):
    config = prepare_config(str(ROOT / "deploy/configs/tiny-cpu.yaml"), 10, [])
    (tmp_path / "run").mkdir()
    args = parse(["--distill-mode", "topk_forward_kl", "--top-k", "8"])
    path = grpo_config(config, tmp_path / "run", 8487, "cpu", str(tmp_path / "student"),
                       **arm_settings(arm, tmp_path / "teacher", 0.5, "none", args.distill_mode, args.top_k))
    distill = load_config(str(path), []).algorithm.distill
    assert (distill.mode, distill.top_k, distill.coef) == ("topk_forward_kl", 8, 0.5)
    assert parse([]).distill_mode == "reverse_kl" and parse([]).top_k == 16
    assert arm_settings("grpo", tmp_path, 0.5, "none", "topk_forward_kl", 8) == {}


def test_reached_reads_the_first_evaluated_step_at_the_target_and_its_clock():
    run = {"accuracy": {"5": 0.6, "10": None, "15": 0.83, "20": 0.9}, "clock": {"5": 20.0, "15": 61.5, "20": 80.0}}
    assert reached(run, 0.83) == {"steps": 15, "wall_s": 61.5}
    assert reached(run, 0.95) == {"steps": None, "wall_s": None}


def test_table_says_not_reached_with_the_budget():
    run = {"arm": "distill", "seed": 0, "accuracy": {"5": 0.6, "10": 0.7}, "total_s": 99.6,
           "load_avg_at_start": [7.25, 6.0, 5.0], "reached": {"steps": None, "wall_s": None}}
    summary = {"target_accuracy": 0.83, "arm_steps": 10, "eval_steps": [5, 10], "runs": {"distill-seed0": run}}
    lines = table(summary).splitlines()
    assert lines[0].startswith("| arm | seed | accuracy at steps 5, 10 | steps to 83.0% |")
    assert lines[2] == "| distill | 0 | 60.0% / 70.0% | not reached within 10 | - | 100 | 7.2 |"


def test_arguments_and_their_defaults():
    args = parse(["--arm-steps", "40", "--seeds", "0", "1", "--arms", "grpo", "distill"])
    assert (args.arm_steps, args.seeds, args.arms, args.teacher_steps) == (40, [0, 1], ["grpo", "distill"], 150)
    assert parse([]).arms == list(ARMS) and parse([]).target_fraction == 0.9 and parse([]).teacher is None
    assert parse(["--teacher", "t/teacher-model"]).teacher == "t/teacher-model"
    with pytest.raises(SystemExit):
        parse(["--arms", "kd"])


def test_baseline_defaults_to_mean_for_the_distillation_arms_only(tmp_path):
    assert parse([]).baseline == "mean" and parse(["--baseline", "none"]).baseline == "none"
    with pytest.raises(SystemExit):
        parse(["--baseline", "median"])
    teacher = tmp_path / "teacher"
    assert arm_settings("distill", teacher, 1.0)["algorithm__distill"]["baseline"] == "mean"
    assert arm_settings("grpo+distill", teacher, 1.0, "none")["algorithm__distill"]["baseline"] == "none"
    assert arm_settings("grpo", teacher, 1.0, "mean") == {}
