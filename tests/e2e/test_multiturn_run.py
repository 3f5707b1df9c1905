"""End to end, multi-turn: `grpo run` with the calculator environment on a tiny model that calls it; the learner's
batches (its advantages log) hold two or more turns per trajectory, and their masks are 0 exactly on the tokens the
calculator wrote."""

import json
import os

import pytest

from generator.environments.calculator import Calculator
from tests import service_forks as forks
from tests.calc_model import PROBLEMS

from .test_run import GRPO, free_port, stray_processes, write_config


def runs(mask):
    """``[(start, end, is_model)]``: the maximal runs of equal mask values."""
    out, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            out.append((start, k, mask[start] == 1))
            start = k
    return out


def calculator_run(tmp_path, model_dir, **generator):
    """`grpo run` (2 learner steps) on the memorised calculator problems with ``generator`` settings added; the
    rows of the learner's batches (its advantages log)."""
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"{e}=", "answer": str(v)}) + "\n" for e, v in PROBLEMS.items()))
    config = write_config(tmp_path, model_dir, free_port(), max_steps=2, lr=1e-4,
                          advantages_jsonl=str(tmp_path / "advantages.jsonl"))
    cfg = json.loads(config.read_text())
    cfg["generator"].update(
        dataset={"kind": "jsonl", "path": str(data), "system_prompt": ""}, rewards=[{"name": "arithmetic"}],
        sampling={"max_tokens": 24, "temperature": 0.5}, **generator)
    config.write_text(json.dumps(cfg))
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert stray_processes(str(config)) == []
    return [row for line in (tmp_path / "advantages.jsonl").read_text().splitlines()
            for row in json.loads(line)["rows"]]


def check_calculator_rows(rows, model_dir) -> None:
    """Each row holds two or more model turns, and its tokens masked 0 are exactly the calculator's answers to the
    model's turns before them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    assert len(rows) == 2 * 2 * 4  # 2 steps x 2 groups x G = 4
    for row in rows:
        ids, mask = row["completion_ids"], row["mask"]
        assert len(ids) == len(mask) == row["completion_length"]
        pieces = runs(mask)
        assert sum(model for _, _, model in pieces) >= 2, decode(ids)  # two or more model turns
        # replaying the calculator on the model's turns gives exactly the tokens masked 0, and nothing else is
        calculator, turn_text = Calculator(), ""
        for start, end, model in pieces:
            if model:
                turn_text = decode(ids[start:end])
            else:
                observation = calculator.step(turn_text)
                assert ids[start:end] == tokenizer(observation, add_special_tokens=False)["input_ids"]
        assert pieces[0][2] and pieces[-1][2]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["batch", "continuous"])
def test_grpo_run_with_the_calculator_masks_exactly_the_environment_tokens(calc_model_dir, tmp_path, schedule):
    rows = calculator_run(tmp_path, calc_model_dir,
                          environment={"name": "calculator", "max_turns": 3, "max_total_tokens": 64},
                          schedule={"mode": schedule, "max_in_flight": 8, "upload_interval_s": 0.1})
    check_calculator_rows(rows, calc_model_dir)
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "Traceback" not in generator_log
    assert ("continuous schedule:" in generator_log) == (schedule == "continuous")
