"""The demo's warm-up on the chain task (deploy/demo/chain_data.py and the task-generic warm-up): the flawed
teacher's intermediate slips by hand and as properties, the SFT targets, and a short real warm-up."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from deploy.demo.chain_data import chain_formatted, flawed_chain_demonstrations, sloppy_chain
from deploy.demo.run import demo_task
from deploy.demo.sft_data import build_sft_batch, target_text
from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, build_tiny_model_dir
from deploy.demo.warmup import flawed_teacher_finetune
from generator.tasks.arithmetic import ArithmeticTask, sloppy_result
from generator.tasks.chain import ChainTask, apply_op, format_solution, line_checks, partial_results
from shared.config.loader import load_config
from shared.config.schema import DemoConfig
from shared.errors import UsageError


def fixed(**settings) -> DemoConfig:
    return DemoConfig(**{"warmup_steps": 400, "warmup_min_lr_ratio": 0.1, "warmup_target_accuracy": None,
                         "flawed_steps": 0, "flawed_target_accuracy": None, **settings})


def test_sloppy_chain_by_hand() -> None:
    task = ChainTask()
    assert sloppy_chain(task.problem((3, 5, 9, 4), ("-", "+", "+"))) == [2, 11, 15]  # sign slipped at line 1
    assert sloppy_chain(task.problem((9, 8, 7, 3), ("+", "+", "-"))) == [17, 14, 11]  # carry slipped at line 2
    assert sloppy_chain(task.problem((1, 2, 3, 4), ("+", "+", "+"))) == [3, 6, 10]  # nothing to forget
    assert sloppy_chain(task.problem((3, 5), ("-",))) == [-2]  # one line: it is the last, worked right


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=2, max_size=6), st.randoms(use_true_random=False))
def test_the_teacher_slips_only_in_intermediate_lines(values, rnd) -> None:
    ops = tuple(rnd.choice("+-") for _ in values[1:])
    p = ChainTask().problem(tuple(values), ops)
    sloppy = sloppy_chain(p)
    previous = [p.operands[0], *sloppy[:-1]]
    for k, (op, operand) in enumerate(zip(ops, p.operands[1:])):
        if k < len(ops) - 1:
            assert sloppy[k] == sloppy_result((previous[k], operand), (op,))
        else:  # the last line is right given the teacher's own previous line
            assert sloppy[k] == apply_op(previous[k], op, operand)
    checks = line_checks(format_solution(sloppy), p.operands, p.ops)
    assert checks[-1] and (sloppy == partial_results(p.operands, p.ops)) == all(checks)


def test_flawed_demonstrations_at_slip_0_and_1() -> None:
    task = ChainTask()
    problems = task.sample(200, "train", random.Random(0))
    assert flawed_chain_demonstrations(task, problems, 0.0, random.Random(1)) == [task.target(p) for p in problems]
    assert flawed_chain_demonstrations(task, problems, 1.0, random.Random(1)) == [
        format_solution(sloppy_chain(p)) for p in problems]
    wrong = sum(sloppy_chain(p)[-1] != int(p.answer) for p in problems) / len(problems)
    assert 0.3 < wrong < 0.6, wrong  # how much accuracy the habit costs on the default task (0.45 on 5000)


def test_sft_targets_and_format_of_the_chain_task() -> None:
    task, tok = ChainTask(), build_char_tokenizer()
    p = task.problem((3, 5, 9, 4), ("-", "+", "+"))
    assert target_text(task, p) == "-2\n7\n11" and target_text(ArithmeticTask(), p) == "<answer>11</answer>"
    input_ids, labels = build_sft_batch(tok, [p], targets=["-2\n7\n11"])
    completion = [t for t in labels[0].tolist() if t != -100]
    assert tok.decode(completion[:-1]) == "-2\n7\n11" and completion[-1] == tok.eos_token_id
    assert input_ids[0].tolist()[: len("3-5+9+4=")] == tok.encode("3-5+9+4=")
    with pytest.raises(ValueError, match="1 problems but 2 targets"):
        build_sft_batch(tok, [p], targets=["1", "2"])
    assert chain_formatted(task, "-2\n7\n12") and chain_formatted(task, "1\n2\n3\n")
    assert not chain_formatted(task, "1\n2") and not chain_formatted(task, "1\nx\n3")


def test_the_demo_task_follows_the_dataset_kind() -> None:
    config = load_config("deploy/configs/tiny-cpu.yaml")
    assert demo_task(config) == ArithmeticTask()
    chain = config.model_copy(update={"generator": config.generator.model_copy(update={
        "dataset": config.generator.dataset.model_copy(update={"kind": "chain"})})})
    assert demo_task(chain) == ChainTask()
    words = config.model_copy(update={"generator": config.generator.model_copy(update={
        "dataset": config.generator.dataset.model_copy(update={"kind": "arithmetic_words"})})})
    with pytest.raises(UsageError, match="generator.dataset.kind must be 'arithmetic' or 'chain'"):
        demo_task(words)


def test_the_chain_flawed_teacher_needs_non_negative_operands() -> None:
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec())
    with pytest.raises(ValueError, match="non-negative operands"):
        flawed_teacher_finetune(model, tok, ChainTask(min_value=-3), fixed(flawed_steps=2), 0)


def test_a_short_chain_warmup_builds_a_model_folder(tmp_path) -> None:
    task = ChainTask(num_operands=3)
    stats = build_tiny_model_dir(tmp_path / "m", task=task, seed=0, warmup=fixed(
        warmup_steps=30, batch_size=8, warmup_lr_ramp_steps=5, flawed_steps=3, flawed_slip=1.0,
        heldout_examples=10))
    assert stats["warmup_steps"] == 30 and stats["flawed_steps"] == 3
    assert stats["warmup_loss_last"] < 0.7 * stats["warmup_loss_first"]
    assert stats["task"] == json.loads(json.dumps(task.__dict__)) and stats["heldout_n"] == 10
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert sum(p.numel() for p in model.parameters()) == stats["params"]
