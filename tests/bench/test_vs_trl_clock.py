"""bench/vs_trl.py's clocks: TRL's child reports time.time() stamps, the parent turns them into the same clock as
grpo run's (seconds from launching the subprocess, snapshot time taken off). Pure functions, no TRL run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.vs_trl import median, repeat_rows, time_to
from bench.vs_trl_runs import read_trl_result, trl_clock, trl_run
from bench.vs_trl_trl import TRLResult, trl_settings
from shared.config.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = 1000.0  # the parent's time.time() at Popen


def result(**changes) -> TRLResult:
    """A child that started 0.5 s after launch, imported for 4 s, built the trainer in 1.5 s, then 4 steps with
    snapshots at steps 2 (0.4 s) and 4 (0.3 s)."""
    values = dict(started_at=1000.5, imports_done_at=1004.5, trainer_ready_at=1006.0, train_done_at=1010.5,
                  step_end_at={1: 1008.0, 2: 1009.0, 3: 1009.9, 4: 1010.4}, save_s={2: 0.4, 4: 0.3},
                  snapshots={2: "/s/step000002", 4: "/s/step000004"}, rewards=[0.25, 0.5, None, 0.75],
                  versions={"trl": "1.16.0"})
    return TRLResult(**(values | changes))


def test_a_snapshot_is_taken_off_the_clock_from_the_next_step_on():
    clock = trl_clock(result(), LAUNCH)
    assert clock == pytest.approx({1: 8.0, 2: 9.0, 3: 9.5, 4: 10.0})


def test_time_to_target_is_the_clock_at_the_first_evaluated_step_that_reaches_it():
    clock = trl_clock(result(), LAUNCH)
    accuracy = {2: 0.60, 4: 0.70}
    assert time_to(0.70, accuracy, clock) == pytest.approx(10.0)
    assert time_to(0.55, accuracy, clock) == pytest.approx(9.0)
    assert time_to(0.71, accuracy, clock) is None
    assert time_to(0.60, {2: None, 4: 0.70}, clock) == pytest.approx(10.0)  # a missing snapshot never counts


def test_start_up_parts_add_up_to_the_first_step_and_the_old_clock_starts_after_the_imports():
    run = trl_run(result(), LAUNCH)
    assert run["interpreter_start_s"] == pytest.approx(0.5)
    assert run["imports_s"] == pytest.approx(4.0)
    assert run["interpreter_and_imports_s"] == pytest.approx(4.5)
    assert run["model_load_and_trainer_s"] == pytest.approx(1.5)
    assert run["first_step_duration_s"] == pytest.approx(2.0)
    assert run["first_step_s"] == pytest.approx(8.0)
    assert (run["interpreter_and_imports_s"] + run["model_load_and_trainer_s"] + run["first_step_duration_s"]
            == pytest.approx(run["first_step_s"]))
    assert run["clock_from_model_load"] == pytest.approx({1: 3.5, 2: 4.5, 3: 5.0, 4: 5.5})
    assert run["snapshot_s"] == pytest.approx(0.7)
    assert run["total_s"] == pytest.approx(10.5 - 0.7)
    assert time_to(0.7, {2: 0.6, 4: 0.7}, run["clock_from_model_load"]) == pytest.approx(5.5)


def test_a_child_that_trained_no_step_is_an_error():
    with pytest.raises(SystemExit, match="no training step"):
        trl_run(result(step_end_at={}, save_s={}), LAUNCH)


def test_result_file_round_trip_gives_integer_steps(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(result().to_json())
    back = read_trl_result(0, path, tmp_path / "trl.log")
    assert back == result()
    assert sorted(back.step_end_at) == [1, 2, 3, 4]
    assert back.save_s[4] == pytest.approx(0.3)


def test_a_result_file_without_a_field_names_the_field_and_the_file(tmp_path):
    data = json.loads(result().to_json())
    del data["trainer_ready_at"]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=r"result\.json: not a TRL result file \(missing trainer_ready_at\)"):
        read_trl_result(0, path, tmp_path / "trl.log")


def test_a_failed_child_is_reported_with_its_status_and_the_end_of_its_log(tmp_path):
    log = tmp_path / "trl.log"
    log.write_text("\n".join(f"line {i}" for i in range(40)) + "\nSystemExit: the comparison would not be fair\n")
    with pytest.raises(SystemExit) as info:
        read_trl_result(1, tmp_path / "result.json", log)
    message = str(info.value)
    assert "exited with status 1" in message and str(log) in message
    assert message.endswith("the comparison would not be fair")
    assert "line 20" not in message  # only the end of the log
    (tmp_path / "result.json").write_text(result().to_json())
    with pytest.raises(SystemExit, match="status 1"):  # a result file from a failed child is not trusted
        read_trl_result(1, tmp_path / "result.json", log)


def test_trl_settings_carry_the_grpo_numbers_and_refuse_what_trl_cannot_do(tmp_path):
    config = load_config(str(ROOT / "deploy/configs/tiny-cpu.yaml"), ["learner.max_steps=7"])
    settings = trl_settings(config, "cpu", tmp_path)
    gen, learner, loss = config.generator, config.learner, config.algorithm.loss
    assert settings["num_generations"] == gen.group_size
    assert settings["per_device_train_batch_size"] == gen.group_size * learner.groups_per_step
    assert settings["learning_rate"] == learner.lr
    assert (settings["epsilon"], settings["epsilon_high"]) == (loss.eps_low, loss.eps_high)
    assert settings["loss_type"] == {"token-mean": "dapo", "seq-mean-token-mean": "grpo",
                                     "seq-mean-token-sum-norm": "dr_grpo"}[loss.aggregation]
    assert settings["max_steps"] == 7
    assert settings["use_cpu"] is True and settings["bf16"] is False
    custom = config.model_copy(update={"algorithm": config.algorithm.model_copy(
        update={"loss": loss.model_copy(update={"aggregation": "seq-sum"})})})
    with pytest.raises(SystemExit, match="aggregation 'seq-sum' has no TRL loss_type"):
        trl_settings(custom, "cpu", tmp_path)


def test_repeats_report_each_ratio_and_their_median():
    runs = {"trl": {"time_to_target_s": 20.0, "time_to_target_from_model_load_s": 10.0},
            "grpo": {"time_to_target_s": 30.0},
            "trl_r2": {"time_to_target_s": 25.0, "time_to_target_from_model_load_s": 15.0},
            "grpo_r2": {"time_to_target_s": 20.0},
            "trl_r3": {"time_to_target_s": 20.0, "time_to_target_from_model_load_s": 12.0},
            "grpo_r3": {"time_to_target_s": None}}
    rows = repeat_rows(runs, 3)
    assert [row["ratio"] for row in rows] == pytest.approx([1.5, 0.8, None])
    assert [row["ratio_against_trl_from_model_load"] for row in rows] == pytest.approx([3.0, 20 / 15, None])
    assert median([row["ratio"] for row in rows]) == pytest.approx(1.15)  # the repeat that never got there is out
    assert median([None, None]) is None
    only_ours = repeat_rows({"grpo": {"time_to_target_s": 30.0}}, 1)  # --skip-trl
    assert only_ours[0]["ratio"] is None and only_ours[0]["grpo_s"] == 30.0


@pytest.mark.slow
def test_the_benchmark_process_does_not_import_trl():
    code = "import sys, bench.vs_trl; print(sorted(m for m in ('trl', 'torch', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
