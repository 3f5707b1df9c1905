"""The calculator demo's warm-up data (deploy/demo/calc_data.py), its SFT batches, its config checks and its
per-step rates (deploy/demo/calc_curve.py)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.demo.calc_curve import step_minutes, step_rates
from deploy.demo.calc_data import (
    answer_turn_context,
    calculator_demonstrations,
    calls_tool,
    demonstration_text,
    direct_demonstration,
    tool_demonstration,
)
from deploy.demo.run import demo_task
from deploy.demo.sft_data import build_sft_batch, validation_problems
from deploy.demo.tiny_model import build_char_tokenizer
from deploy.demo.warmup import clean_stop_rule
from generator.tasks.arithmetic import ArithmeticTask, make_problem
from shared.config.loader import load_config
from shared.errors import UsageError
from tests import service_forks as forks

CONFIG = "deploy/configs/tiny-calculator-cpu.yaml"
TASK = ArithmeticTask(min_value=10, max_value=99, ops=("*",))


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def test_a_tool_demonstration_is_the_rollouts_turns_with_the_calculators_own_result():
    problem = make_problem((37, 45), ("*",))
    assert tool_demonstration(problem) == [("<calc>37*45</calc>", True), ("<result>1665</result>", False),
                                           ("<answer>1665</answer>", True)]
    assert demonstration_text(tool_demonstration(problem)) == "<calc>37*45</calc><result>1665</result><answer>1665</answer>"
    assert direct_demonstration(problem) == [("<answer>1665</answer>", True)]
    assert calls_tool(tool_demonstration(problem)) and not calls_tool(direct_demonstration(problem))


@pytest.mark.parametrize("fraction", [0.0, 0.15, 0.5, 1.0])
def test_the_share_of_tool_demonstrations_is_tool_fraction(fraction):
    problems, targets = calculator_demonstrations(TASK, 4000, fraction, random.Random(0))
    share = sum(map(calls_tool, targets)) / len(targets)
    # binomial: 4000 draws, 4 standard deviations at most 0.032
    assert abs(share - fraction) <= 4 * (fraction * (1 - fraction) / 4000) ** 0.5
    assert all(TASK.split_of(p) == "train" for p in problems)
    assert all(demonstration_text(t).endswith(f"<answer>{p.answer}</answer>") for p, t in zip(problems, targets))


def test_tool_demonstrations_avoid_the_excluded_problems():
    excluded = TASK.sample(300, "train", random.Random(1))
    problems, _ = calculator_demonstrations(TASK, 2000, 0.5, random.Random(2), excluded)
    assert not {p.prompt for p in problems} & {p.prompt for p in excluded}


def test_tool_demonstrations_refuse_a_task_other_than_arithmetic():
    from generator.tasks.chain import ChainTask

    with pytest.raises(ValueError, match="arithmetic task"):
        calculator_demonstrations(ChainTask(), 4, 0.5, random.Random(0))


@settings(max_examples=40, deadline=None)
@given(a=st.integers(10, 99), b=st.integers(10, 99), tool=st.booleans())
def test_the_loss_covers_the_models_turns_and_eos_but_not_the_calculators_result(tokenizer, a, b, tool):
    problem = make_problem((a, b), ("*",))
    target = tool_demonstration(problem) if tool else direct_demonstration(problem)
    other = make_problem((12, 3), ("*",))  # a shorter row beside it: padding is never in the loss
    input_ids, labels = build_sft_batch(tokenizer, [problem, other], 64, [target, direct_demonstration(other)])
    prompt = len(tokenizer.encode(problem.prompt, add_special_tokens=False))
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    row, label = input_ids[0].tolist(), labels[0].tolist()
    length = prompt + len(tokenizer.encode(demonstration_text(target), add_special_tokens=False)) + 1
    assert decode(row[:length]) == problem.prompt + demonstration_text(target) + tokenizer.eos_token
    assert all(x == -100 for x in label[:prompt]) and all(x == -100 for x in label[length:])
    trained = [token for token, lab in zip(row, label) if lab != -100]
    assert [lab for lab in label if lab != -100] == trained  # labels are the ids themselves where trained
    in_loss = "".join(text for text, kept in target if kept)
    assert decode(trained) == in_loss + tokenizer.eos_token
    left_out = [token for token, lab in zip(row[prompt:length], label[prompt:length]) if lab == -100]
    assert decode(left_out) == (f"<result>{a * b}</result>" if tool else "")


def test_a_string_target_still_trains_on_every_completion_token(tokenizer):
    problem = make_problem((37, 45), ("*",))
    from_string = build_sft_batch(tokenizer, [problem], 64, ["<answer>1665</answer>"])
    from_segments = build_sft_batch(tokenizer, [problem], 64, [direct_demonstration(problem)])
    assert all(torch.equal(x, y) for x, y in zip(from_string, from_segments))


def test_the_calculator_config_builds_its_task_and_refuses_a_tool_warmup_without_the_calculator():
    config = load_config(CONFIG)
    assert demo_task(config) == TASK
    assert config.demo.tool_fraction == 0.3 and config.generator.environment.name == "calculator"
    with pytest.raises(UsageError, match="generator.environment.name: calculator"):
        demo_task(load_config(CONFIG, ["generator.environment=null"]))
    with pytest.raises(Exception, match="demo.flawed_steps: 0"):
        load_config(CONFIG, ["demo.flawed_steps=10"])


@settings(max_examples=40, deadline=None)
@given(a=st.integers(10, 99), b=st.integers(10, 99))
def test_the_copy_check_reads_what_a_tool_demonstration_shows_before_its_answer_turn(tokenizer, a, b):
    problem = make_problem((a, b), ("*",))
    context = answer_turn_context(problem)
    assert context == f"{a}*{b}=<calc>{a}*{b}</calc><result>{a * b}</result>"
    # the SFT row: the check's context, then the answer turn the loss trains (after the left-out result)
    input_ids, labels = build_sft_batch(tokenizer, [problem], 64, [tool_demonstration(problem)])
    n = len(tokenizer.encode(context, add_special_tokens=False))
    assert tokenizer.decode(input_ids[0, :n].tolist(), skip_special_tokens=False) == context
    assert labels[0, n - 1] == -100 and (labels[0, n:] != -100).all()  # the result's last token out, the answer in
    assert tokenizer.decode(labels[0, n:].tolist(), skip_special_tokens=True) == f"<answer>{a * b}</answer>"


def test_the_calculator_warmup_runs_until_the_model_copies_the_calculators_result():
    # A fixed step count landed seed 0 before the copying jump (pass@2 2.5% before RL) and seed 1 past it
    # (46%): the shipped config stops on the copy check instead (docs/calculator-demo.md, Measured).
    demo = load_config(CONFIG).demo
    assert demo.warmup_target_accuracy is not None and demo.warmup_max_steps > demo.warmup_steps
    validation = validation_problems(TASK, demo)
    rule = clean_stop_rule(demo, validation)
    assert rule.target == demo.warmup_target_accuracy and rule.above
    assert [p.prompt for p in rule.checked_problems] == [answer_turn_context(p) for p in validation]
    assert [p.answer for p in rule.checked_problems] == [p.answer for p in validation]
    plain = clean_stop_rule(demo.model_copy(update={"tool_fraction": 0.0}), validation)
    assert [p.prompt for p in plain.checked_problems] == [p.prompt for p in validation]


def test_step_rates_count_tool_calls_by_the_mask_and_accuracy_by_the_reward(tmp_path):
    def row(mask, reward):
        return {"mask": mask, "reward": reward, "completion_ids": [0] * len(mask)}

    path = tmp_path / "advantages.jsonl"
    records = [{"step": 1, "rows": [row([1, 1, 0, 0, 1], 1.0), row([1, 1, 1], 0.0), row([1], 0.0)]},
               {"step": 1, "rows": [row([1, 0, 1], 0.0)]},  # a second batch of the same step
               {"step": 2, "rows": [row([1, 0, 1], 1.0), row([1, 1], 1.0)]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert step_rates(path) == [{"step": 1, "samples": 4, "tool_call_rate": 0.5, "accuracy": 0.25},
                                {"step": 2, "samples": 2, "tool_call_rate": 0.5, "accuracy": 1.0}]
    path.write_text(json.dumps({"step": 1, "rows": [{"reward": 1.0}]}) + "\n")
    with pytest.raises(ValueError, match="single-turn rows"):
        step_rates(path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "time": 1030.0}) + "\n" + json.dumps({"step": 2, "time": 1090.0}) + "\n")
    assert step_minutes(metrics, 1000.0) == {1: 0.5, 2: 1.5}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_calculator_demo_runs_end_to_end_and_reports_tool_call_rates(tmp_path):
    """`grpo demo` on the calculator config at a toy size: a few warm-up steps, 2 learner steps, 8 held-out
    problems; summary.json has the before/after fields and the curve is written."""
    import os
    import sys
    from pathlib import Path

    from tests.e2e.test_run import free_port, stray_processes

    port, model, run_dir = free_port(), tmp_path / "model", tmp_path / "run"
    settings = {"generator.model": model, "ref_server.model": model, "learner.model": model, "run.run_dir": run_dir,
                "ref_server.port": port, "generator.hub_url": f"http://127.0.0.1:{port}",
                "learner.hub_url": f"http://127.0.0.1:{port}", "learner.advantages_jsonl": tmp_path / "adv.jsonl",
                "learner.max_steps": 2, "generator.group_size": 4, "generator.prompts_per_batch": 2,
                "learner.groups_per_step": 2, "demo.warmup_steps": 3, "demo.batch_size": 8,
                "demo.warmup_target_accuracy": "null",  # 3 fixed steps: the toy size never learns to copy
                "demo.heldout_examples": 8, "eval.num_examples": 8, "eval.k": 2, "learner.batch_wait_s": 2.0}
    grpo = str(Path(sys.executable).parent / "grpo")
    command = [grpo, "demo", "--config", CONFIG, *(f"--set={k}={v}" for k, v in settings.items())]
    result = forks.run(command, capture_output=True, text=True, timeout=280,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["heldout_examples"] == 8
    for when in ("before", "after"):
        assert 0 <= summary[f"accuracy_{when}"] <= 1
        assert 0 <= summary[f"tool_call_rate_{when}"] <= 1
        assert summary[f"turns_per_trajectory_{when}"] >= 1
    assert [row["step"] for row in summary["per_step"]] == [1, 2]
    assert all(row["samples"] == 8 and 0 <= row["tool_call_rate"] <= 1 for row in summary["per_step"])
    assert (run_dir / "curve.png").stat().st_size > 10_000
    assert "tool-call rate" in result.stdout
    assert stray_processes(str(port)) == []
