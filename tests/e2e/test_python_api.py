"""End to end: ``grpo_stack.train()`` from a user's script, as a user runs it: the tiny model trained for a few
steps with a reward defined in the script (a Python callable) and a list of dicts (or a ``datasets.Dataset``) as
the dataset."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.test_run import free_port, stray_processes

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = '''
import json, sys
from grpo_stack import train

config_file, calls_file = sys.argv[1], sys.argv[2]


def digits_right(prompt, completion, example):
    """The fraction of the answer's digits the completion starts with (defined here: no module names it)."""
    with open(calls_file, "a") as calls:
        calls.write(json.dumps({"prompt": prompt, "answer": example["answer"]}) + "\\n")
    answer = example["answer"]
    return sum(a == b for a, b in zip(completion.strip(), answer)) / len(answer)


rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10, 20) for b in range(1, 4)]
if sys.argv[3] == "Dataset":   # pyarrow's threads run in this process before the services are forked from it
    import datasets

    rows = datasets.Dataset.from_list(rows)
    rows.map(lambda row: row, num_proc=None)
result = train(json.load(open(config_file)), reward_funcs=[digits_right], train_dataset=rows,
               eval_dataset=rows.select(range(4)) if sys.argv[3] == "Dataset" else rows[:4], learner__max_steps=3)
print("RESULT " + json.dumps({k: (str(v) if v is not None and k.endswith(("_dir", "_path")) else v)
                              for k, v in vars(result).items()}))
'''


def api_config(tmp_path, model_dir):
    return {"seed": 0, "algorithm": {"loss": {"beta": 0.0}},
            "ref_server": {"port": free_port(), "queue_capacity": 4},
            "generator": {"model": str(model_dir), "engine": "transformers", "group_size": 4,
                          "prompts_per_batch": 2, "sampling": {"max_tokens": 4},
                          "dataset": {"template": "{question}"}},
            "learner": {"model": str(model_dir), "groups_per_step": 2, "max_steps": 6, "lr": 1e-3,
                        "tensorboard_dir": None, "batch_wait_s": 2.0},
            "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20}}


@pytest.mark.slow
@pytest.mark.parametrize("data", ["list", "Dataset"])
def test_train_runs_the_tiny_model_with_a_callable_reward_and_a_dataset(tmp_path, tiny_model_dir, data):
    (tmp_path / "config.json").write_text(json.dumps(api_config(tmp_path, tiny_model_dir)))
    (tmp_path / "user.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "user.py", "config.json", "calls.jsonl", data], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "[grpo run] the learner finished: stopping the other services" in result.stdout
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    run = json.loads(line[len("RESULT "):])
    run_dir = tmp_path / "run"
    # the result is what the run's own files say
    metrics = [json.loads(m) for m in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]                  # the override learner__max_steps=3
    assert run == {"status": 0, "steps": 3, "run_dir": str(run_dir), "model_dir": str(run_dir / "model"),
                   "metrics_path": str(run_dir / "metrics.jsonl"), "metrics": metrics[-1]}
    assert (run_dir / "model" / "model.safetensors").is_file()
    # the callable scored the run: its label is the function's name, and the forked generator called it on the
    # list's rows (the prompt rendered by the template, the row as the example)
    assert all(0.0 <= m["reward/digits_right"] <= 1.0 for m in metrics)
    calls = [json.loads(c) for c in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) >= 3 * 2 * 4
    assert all(int(c["prompt"][:2]) + int(c["prompt"][3]) == int(c["answer"]) for c in calls)
    # the datasets were written into the run folder and named in the resolved config
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    kind, suffix = ("jsonl", ".jsonl") if data == "list" else ("hf", "")
    assert written["generator"]["dataset"]["kind"] == kind
    assert written["generator"]["dataset"]["path"] == str(run_dir / "data" / f"train_dataset{suffix}")
    assert written["eval"]["path"] == str(run_dir / "data" / f"eval_dataset{suffix}")
    if data == "list":
        assert len((run_dir / "data" / "eval_dataset.jsonl").read_text().splitlines()) == 4
    else:
        import datasets

        assert len(datasets.load_from_disk(written["eval"]["path"])) == 4
    assert written["generator"]["rewards"] == [{"name": "python", "label": "digits_right", "weight": 1.0,
                                                "on_error": 0.0, "timeout_s": None,
                                                "args": {"function": written["generator"]["rewards"]
                                                                          [0]["args"]["function"]}}]
    assert stray_processes(str(run_dir)) == []


FAILING = '''
import json, sys
from grpo_stack import RunFailed, train


def needs_a_label(prompt, completion, example):
    return float(example["label_xyz"])


try:
    train(json.load(open(sys.argv[1])), reward_funcs=needs_a_label,
          train_dataset=[{"question": f"{a}+1=", "answer": str(a + 1)} for a in range(10, 20)])
except RunFailed as exc:
    print("FAILED " + json.dumps({"status": exc.status, "why": exc.why, "last_lines": exc.last_lines,
                                  "message": str(exc)}))
'''


@pytest.mark.slow
def test_a_failed_run_raises_run_failed_with_the_services_last_lines(tmp_path, tiny_model_dir):
    (tmp_path / "config.json").write_text(json.dumps(api_config(tmp_path, tiny_model_dir)))
    (tmp_path / "user.py").write_text(FAILING)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "user.py", "config.json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("FAILED ")]
    failed = json.loads(line[len("FAILED "):])
    # the generator stops on a reward that fails every completion (exit 2: the user's to fix), and the run with it
    assert failed["status"] == 2 and failed["why"] == "gen-0 exited with status 2"
    assert any("KeyError: 'label_xyz'" in text and "in needs_a_label" in text for text in failed["last_lines"])
    assert failed["message"].startswith("the run failed (exit status 2): gen-0 exited with status 2; its last lines:")
    assert failed["message"].endswith(f"every service's output: {tmp_path / 'run' / 'logs'}")
    assert stray_processes(str(tmp_path / "run")) == []
