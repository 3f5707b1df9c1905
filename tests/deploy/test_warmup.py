"""SFT batches, greedy generation and the warm-up that gives RL something to amplify."""

from __future__ import annotations

import logging
import random
import re

import pytest
import torch

from deploy.demo.greedy import evaluate_greedy, generate_greedy, greedy_accuracy
from deploy.demo.sft_data import (
    build_sft_batch,
    flawed_demonstrations,
    pad_sft_sequences,
    sample_excluding,
    validation_problems,
)
from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model
from deploy.demo.warmup import (
    StopRule,
    WarmupTargetMissed,
    flawed_teacher_finetune,
    needs_validation,
    supervised_warmup,
    warmup_lr_schedule,
)
from generator.tasks.arithmetic import (
    ArithmeticTask,
    evaluate,
    extract_answer,
    format_target,
    make_problem,
    sloppy_result,
)
from shared.config.schema import DemoConfig


def fixed(**settings) -> DemoConfig:
    """A demo section that runs fixed step counts: no accuracy targets, no flawed phase, a 400-step cosine to a tenth
    (the warm-up of `grpo tiny-model` before the demo section was its only config), unless a test sets them."""
    return DemoConfig(**{"warmup_steps": 400, "warmup_min_lr_ratio": 0.1, "warmup_target_accuracy": None,
                         "flawed_steps": 0, "flawed_target_accuracy": None, **settings})


class PadIsEosTokenizer:
    """Tokenizer-like stub where pad == eos == 0 (the Llama-3/Qwen convention that breaks id-based masks)."""

    pad_token_id = 0
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        assert not add_special_tokens
        return [ord(c) for c in text]


@pytest.fixture(scope="session")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def short_warmup(tok):
    """A 60-step warm-up: enough to learn the format, nowhere near enough to learn arithmetic."""
    task = ArithmeticTask()
    model = build_tiny_model(tok, TinyModelSpec())
    heldout = task.sample(100, "test", random.Random(1))
    before = evaluate_greedy(model, tok, task, heldout)
    phase = supervised_warmup(model, tok, task, fixed(warmup_steps=60, batch_size=32, warmup_lr_ramp_steps=10), 0)
    after = evaluate_greedy(model, tok, task, heldout)
    assert phase.checks == [] and phase.validation_accuracy is None  # no target, no checks
    return model, task, heldout, before, after, phase.losses


def test_pad_equal_eos_still_trains_on_eos() -> None:
    pairs = [([5, 6, 7], [8, 0]), ([5], [9, 9, 9, 0]), ([1, 2], [0])]
    input_ids, labels = pad_sft_sequences(pairs, pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 0], [5, 9, 9, 9, 0], [1, 2, 0, 0, 0]]
    assert labels.tolist() == [
        [-100, -100, -100, 8, 0],
        [-100, 9, 9, 9, 0],
        [-100, -100, 0, -100, -100],
    ]


def test_build_sft_batch_masks_exactly_completion_plus_eos_with_pad_eq_eos() -> None:
    problems = [make_problem((7, 5), ("+",)), make_problem((37, 45), ("-",)), make_problem((100, 1), ("*",))]
    input_ids, labels = build_sft_batch(PadIsEosTokenizer(), problems)
    for row, p in enumerate(problems):
        n_prompt, n_target = len(p.prompt), len(format_target(p)) + 1
        assert (labels[row, :n_prompt] == -100).all()
        want = [ord(c) for c in format_target(p)] + [0]
        assert labels[row, n_prompt : n_prompt + n_target].tolist() == want
        assert (labels[row, n_prompt + n_target :] == -100).all()
        assert int((labels[row] != -100).sum()) == n_target
    assert (
        input_ids.shape
        == labels.shape
        == (3, max(len(p.prompt) + len(format_target(p)) + 1 for p in problems))
    )


def test_build_sft_batch_with_real_tokenizer(tok) -> None:
    problems = [make_problem((3, 11), ("-",)), make_problem((50, 50), ("+",))]
    input_ids, labels = build_sft_batch(tok, problems)
    for row, p in enumerate(problems):
        target_ids = labels[row][labels[row] != -100].tolist()
        assert target_ids[-1] == tok.eos_token_id
        assert tok.decode(target_ids[:-1]) == format_target(p)
        n = len(tok.encode(p.prompt)) + len(target_ids)
        assert tok.decode(input_ids[row, :n].tolist()) == p.prompt + format_target(p) + "</s>"
    assert input_ids[0, -1].item() == tok.pad_token_id  # the shorter row is right-padded
    with pytest.raises(ValueError, match="max_len"):
        build_sft_batch(tok, problems, max_len=10)


def test_lr_schedule_warms_up_then_decays_to_floor() -> None:
    cfg = fixed(warmup_steps=100, warmup_lr=1e-3, warmup_lr_ramp_steps=10, warmup_min_lr_ratio=0.1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.warmup_lr)
    scheduler = warmup_lr_schedule(optimizer, cfg)
    lrs = []
    for _ in range(251):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(1e-4)
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(0.55e-3)
    assert lrs[100] == pytest.approx(1e-4)
    assert lrs[250] == pytest.approx(1e-4)  # past the schedule (a phase run to a target): the floor
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:100]))


def test_short_warmup_lowers_loss_and_teaches_format(short_warmup) -> None:
    _, _, _, before, after, losses = short_warmup
    assert len(losses) == 60 and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, (first, last)
    assert before.accuracy == 0.0 and before.format_rate == 0.0
    assert after.format_rate >= 0.9, after.completions[:5]


def test_batched_greedy_matches_one_prompt_at_a_time(tok, short_warmup) -> None:
    """Left padding must not change what a prompt generates (positions and masks are per row)."""
    model = short_warmup[0]
    prompts = ["1+2=", "37+45=", "99-100=", "5-7=", "80+8="]
    batched = generate_greedy(model, tok, prompts, max_new_tokens=12)
    singles = [generate_greedy(model, tok, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == singles
    assert generate_greedy(model, tok, prompts, max_new_tokens=12, batch_size=2) == batched
    assert model.training is False


def test_generation_stops_at_eos_and_respects_budget(tok, short_warmup) -> None:
    model, _, heldout, _, after, _ = short_warmup
    for text in after.completions:
        if extract_answer(text) is not None:
            assert text.endswith("</answer>"), text  # nothing generated after EOS
    cut = generate_greedy(model, tok, [p.prompt for p in heldout[:8]], max_new_tokens=2)
    assert all(len(tok.encode(c)) <= 2 for c in cut)
    assert generate_greedy(model, tok, [], max_new_tokens=4) == []
    with pytest.raises(ValueError, match="empty prompt"):
        generate_greedy(model, tok, ["1+1=", ""], max_new_tokens=4)


def test_greedy_accuracy_counts_correct_answers(tok, short_warmup) -> None:
    model, task, heldout, _, after, _ = short_warmup
    assert greedy_accuracy(model, tok, task, heldout) == after.accuracy
    expected = sum(task.score(p, c) for p, c in zip(heldout, after.completions)) / len(heldout)
    assert after.accuracy == expected and after.n == len(heldout)


def test_flawed_demonstrations_slip_at_the_configured_rate() -> None:
    task = ArithmeticTask()
    assert all(p.answer == make_problem(p.operands, p.ops).answer
               for p in flawed_demonstrations(task, 200, 0.0, random.Random(0)))
    sloppy = flawed_demonstrations(task, 200, 1.0, random.Random(0))
    assert all(p.answer == str(sloppy_result(p.operands, p.ops)) for p in sloppy)
    assert all(task.split_of(p) == "train" for p in sloppy)
    # among problems where forgetting changes the answer, about flawed_slip of them are wrong
    mixed = [p for p in flawed_demonstrations(task, 4000, 0.8, random.Random(1))
             if sloppy_result(p.operands, p.ops) != evaluate(p.operands, p.ops)]
    wrong = sum(p.answer != str(evaluate(p.operands, p.ops)) for p in mixed) / len(mixed)
    assert 0.75 < wrong < 0.85, wrong


def test_flawed_teacher_needs_a_task_with_a_sloppy_answer(tok) -> None:
    model = build_tiny_model(tok, TinyModelSpec())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert flawed_teacher_finetune(model, tok, ArithmeticTask(ops=("*",)), fixed(flawed_steps=0), 0).losses == []
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="flawed teacher needs a task of a\\+b / a-b"):
        flawed_teacher_finetune(model, tok, ArithmeticTask(ops=("*",)), fixed(flawed_steps=2), 0)


@pytest.mark.slow
def test_flawed_teacher_finetune_teaches_the_sloppy_habit(tok) -> None:
    """The flawed teacher never writes a minus sign: after its fine-tuning the model's probability of opening a
    negative answer with '-' falls, where the correct demonstrations had raised it."""
    task = ArithmeticTask()
    model = build_tiny_model(tok, TinyModelSpec())
    supervised_warmup(model, tok, task, fixed(warmup_steps=60, batch_size=32, warmup_lr_ramp_steps=10), 0)
    negative = [p for p in task.sample(200, "test", random.Random(3)) if p.ops == ("-",) and p.operands[0] < p.operands[1]]
    minus = tok.convert_tokens_to_ids("-")

    def mean_minus_probability() -> float:
        rows = [tok.encode(p.prompt + "<answer>", add_special_tokens=False) for p in negative]
        with torch.no_grad():
            probs = [torch.softmax(model(input_ids=torch.tensor([r])).logits[0, -1], -1)[minus] for r in rows]
        return float(torch.stack(probs).mean())

    clean = mean_minus_probability()
    losses = flawed_teacher_finetune(model, tok, task, fixed(flawed_steps=30, flawed_slip=1.0, batch_size=32,
                                                             flawed_lr=1e-3), 0).losses
    assert len(losses) == 30
    assert clean > 0.5 and mean_minus_probability() < 0.5 * clean, (clean, mean_minus_probability())


def test_validation_set_is_distinct_train_problems_that_warmup_never_trains_on() -> None:
    task = ArithmeticTask()
    cfg = fixed(validation_examples=300, validation_seed=7)
    validation = validation_problems(task, cfg)
    assert len(validation) == len({p.prompt for p in validation}) == 300
    assert all(task.split_of(p) == "train" for p in validation)  # the test split stays for `grpo eval`
    assert validation == validation_problems(task, cfg)  # fixed by the seed
    seen = {p.prompt for p in sample_excluding(task, 5000, random.Random(0), validation)}
    seen |= {p.prompt for p in flawed_demonstrations(task, 5000, 0.8, random.Random(1), validation)}
    assert not seen & {p.prompt for p in validation}
    with pytest.raises(ValueError, match="distinct train-split problems"):
        validation_problems(ArithmeticTask(max_value=3), cfg)
    assert not needs_validation(fixed())
    assert not needs_validation(fixed(flawed_target_accuracy=0.5))  # no flawed phase
    assert needs_validation(fixed(warmup_target_accuracy=0.9))
    assert needs_validation(fixed(flawed_steps=5, flawed_target_accuracy=0.5))
    assert needs_validation(DemoConfig())  # the demo's defaults have both targets


def test_stop_rule_checks_every_n_steps_and_at_the_cap(tok, short_warmup) -> None:
    model, task = short_warmup[0], short_warmup[1]
    validation = task.sample(20, "train", random.Random(5))
    rule = StopRule("demo", target=1.0, above=True, every=4, validation=validation)
    stopped = [rule.done(model, tok, task, step, cap=10) for step in range(1, 11)]
    assert [step for step, _ in rule.checks] == [4, 8, 10] and not any(stopped)
    with pytest.raises(WarmupTargetMissed, match=r"'demo' stopped at its cap of 10 steps .* target is >= 100.0%"):
        rule.require_reached(10)
    falls = StopRule("down", target=1.0, above=False, every=3, validation=validation)
    assert falls.done(model, tok, task, 3, cap=10)  # accuracy <= 100% always
    falls.require_reached(10)
    with pytest.raises(ValueError, match="non-empty validation set"):
        StopRule("empty", 0.5, True, 3, [])


def test_clean_phase_stops_at_its_target_and_fails_at_its_cap(tok, caplog) -> None:
    task = ArithmeticTask()
    validation = validation_problems(task, fixed(validation_examples=16))
    cfg = fixed(warmup_steps=12, warmup_max_steps=12, batch_size=8, warmup_lr_ramp_steps=2,
                warmup_target_accuracy=0.0, warmup_check_every=5)
    with caplog.at_level(logging.INFO, logger="grpo.demo.warmup"):
        reached = supervised_warmup(build_tiny_model(tok, TinyModelSpec()), tok, task, cfg, 0, validation)
    assert len(reached.losses) == 5 and [s for s, _ in reached.checks] == [5]  # 0% is already >= 0%
    # the phase's last line says where it stopped, its loss and the check that stopped it
    last = [r.getMessage() for r in caplog.records if r.name == "grpo.demo.warmup"][-1]
    loss = sum(reached.losses) / 5
    assert re.fullmatch(rf"warm-up \(correct demonstrations\): 5/12 steps \(42%\), in \d+s, loss {loss:.3f}, "
                        r"validation accuracy 0\.0% at step 5 \(target >= 0\.0%\)", last), last
    missed = fixed(warmup_steps=4, warmup_max_steps=6, batch_size=8, warmup_lr_ramp_steps=2,
                   warmup_target_accuracy=0.99, warmup_check_every=5)
    with pytest.raises(WarmupTargetMissed, match="'correct demonstrations' stopped at its cap of 6 steps"):
        supervised_warmup(build_tiny_model(tok, TinyModelSpec()), tok, task, missed, 0, validation)


def test_flawed_phase_stops_once_accuracy_falls_to_its_target(tok) -> None:
    task = ArithmeticTask()
    validation = validation_problems(task, fixed(validation_examples=16))
    cfg = fixed(batch_size=8, flawed_steps=9, flawed_target_accuracy=1.0, flawed_check_every=4)
    phase = flawed_teacher_finetune(build_tiny_model(tok, TinyModelSpec()), tok, task, cfg, 0, validation)
    assert len(phase.losses) == 4 and len(phase.checks) == 1 and phase.validation_accuracy is not None
