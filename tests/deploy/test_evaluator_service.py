"""`grpo run` with eval.every_steps: the evaluator service it starts, the run state it keeps (eval.jsonl, best/), the
closing lines naming the best model beside the last evaluation, and `grpo evaluator` refusing what it cannot do."""

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from deploy.final_eval import evaluate_final_version
from deploy.launcher import plan
from deploy.run_state import existing_state, summary_lines
from deploy.services import main as service_main
from shared.config.loader import load_config


def config_for(run_dir, *overrides: str):
    return load_config(None, [f"run.run_dir={run_dir}", "learner.model=some/model", *overrides])


def test_grpo_run_starts_an_evaluator_only_with_every_steps(tmp_path):
    assert "evaluator" not in {s.name for s in plan(config_for(tmp_path), tmp_path / "c.yaml", tmp_path)}
    config = config_for(tmp_path, "eval.every_steps=5")
    services = {s.name: s for s in plan(config, tmp_path / "c.yaml", tmp_path)}
    evaluator = services["evaluator"]
    assert evaluator.command[-5:] == ["evaluator", "--config", str(tmp_path / "c.yaml"), "--hub",
                                      config.ref_server.url]
    assert evaluator.log_path == tmp_path / "logs" / "evaluator.log"
    assert evaluator.fork_argv is None                          # a fresh process: its own engine
    assert evaluator.env["OMP_NUM_THREADS"] == services["learner"].env["OMP_NUM_THREADS"]
    by_time = plan(config_for(tmp_path, "eval.every_minutes=0.5"), tmp_path / "c.yaml", tmp_path)
    assert "evaluator" in {s.name for s in by_time}


def test_eval_results_are_run_state_under_the_run_dir(tmp_path):
    run = tmp_path / "r"
    config = config_for(run, "eval.every_steps=5")
    assert (config.eval.jsonl, config.eval.best_dir) == (str(run / "eval.jsonl"), str(run / "best"))
    assert existing_state(config) == []
    (run / "best").mkdir(parents=True)
    (run / "best" / "best.json").write_text("{}")
    assert [s.key for s in existing_state(config)] == ["eval.best_dir"]   # refused without --resume/--fresh


def test_closing_lines_name_the_best_model_beside_the_last_evaluation(tmp_path):
    run = tmp_path / "r"
    config = config_for(run, "eval.every_steps=5", "eval.best_metric=accuracy")
    assert not any(line.startswith(("evaluations", "best model")) for line in summary_lines(config, 0))
    run.mkdir()
    records = [{"version": 5, "step": 5, "eval/arithmetic/accuracy": 0.25, "eval/arithmetic/pass@4": 0.5},
               {"version": 10, "step": 10, "error": "RuntimeError: boom"},
               {"version": 15, "step": 15, "eval/arithmetic/accuracy": 0.125, "eval/arithmetic/pass@4": 0.25}]
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"version": 2')  # cut line
    (run / "best").mkdir()
    (run / "best" / "best.json").write_text(json.dumps({"version": 5, "step": 5, "metric": "accuracy", "value": 0.25}))
    lines = summary_lines(config, 0)
    assert f"evaluations: {run / 'eval.jsonl'} (2 done, 1 failed); the last, version 15: accuracy 0.1250" in lines
    assert f"best model: {run / 'best'} (version 5, accuracy 0.2500; eval.best_metric max)" in lines


def test_grpo_evaluator_refuses_without_every_steps(tmp_path, capsys):
    assert service_main(["evaluator", "--set", f"run.run_dir={tmp_path}", "--hub", "http://127.0.0.1:9"]) == 2
    assert "eval.every_steps is not set" in capsys.readouterr().err


def test_grpo_evaluator_refuses_a_missing_model_before_loading_anything(tmp_path, capsys):
    code = service_main(["evaluator", "--every-steps", "2", "--model", str(tmp_path / "nowhere"),
                         "--run-dir", str(tmp_path)])
    assert code == 2 and "nowhere" in capsys.readouterr().err


CHILD = """
import signal, sys, time
if sys.argv[1] == "answers":
    signal.signal(signal.SIGUSR1, lambda s, f: sys.exit(0))
else:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(30)
"""


def evaluator_process(kind: str) -> SimpleNamespace:
    process = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"   # its handler is set
    return SimpleNamespace(name="evaluator", process=process)


@pytest.mark.slow
def test_the_evaluator_is_asked_for_the_final_version_and_waited_for_within_final_wait_s():
    said: list[str] = []
    answers = evaluator_process("answers")
    evaluate_final_version([SimpleNamespace(name="learner"), answers], 10, lambda: False, said.append)
    assert answers.process.wait(5) == 0 and len(said) == 1 and "evaluates the final version" in said[0]

    slow = evaluator_process("ignores")
    started = time.monotonic()
    try:
        evaluate_final_version([slow], 0.5, lambda: False, said.append)
        assert 0.5 <= time.monotonic() - started < 5 and slow.process.poll() is None
        assert said[-1] == "the evaluator did not finish within eval.final_wait_s 0.5s: stopping it"
    finally:
        slow.process.kill()
        slow.process.wait()
    evaluate_final_version([SimpleNamespace(name="gen-0")], 10, lambda: False, said.append)   # no evaluator
    assert len(said) == 3
