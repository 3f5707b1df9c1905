"""Reward functions written for TRL's GRPOTrainer run unchanged through ``reward: python`` (issue 39, item 1):
recognised by their signature or ``style: trl``, called once per group with TRL's keywords, ``None`` meaning "not
applicable" (no value, no failure, left out of the per-reward means), anything else unusable a failure under the
rule of generator/failures.py. TRL's own shipped rewards: tests/generator/test_trl_shipped_rewards.py."""

from __future__ import annotations

import json
import logging
import math
import re
import subprocess
import sys
import threading

import pytest

from deploy.preflight import reward_problems
from generator.failures import FailureRateExceeded, FailureRule
from generator.progress import Progress
from generator.rewards import RewardConfigError, RewardSet
from generator.rewards.trl_style import reward_style
from shared.config.schema import GRPOConfig, RewardSpec
from tests import service_forks as forks

HERE = "tests.generator.test_trl_rewards"


def trl_spec(name: str, label: str | None = None, weight: float = 1.0, on_error: float = 0.0, **args) -> RewardSpec:
    return RewardSpec(name="python", label=label or name, weight=weight, on_error=on_error,
                      args={"function": f"{HERE}:{name}", **args})


# -- TRL's documentation's examples, as written there ---------------------------------------------------------------
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):  # noqa: B007 - as TRL's docs write it
        if t == "math":
            rewards.append(1.0 if "42" in completion else 0.0)
        else:
            rewards.append(None)   # not a math example: this reward does not apply
    return rewards


# -- what the function is given, and functions that fail ---------------------------------------------------------
SEEN: list[dict] = []


def record(prompts, completions, completion_ids, **kwargs):
    SEEN.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    return [float(len(ids)) for ids in completion_ids]


def one_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def garbage(completions, **kwargs):
    return ["high", math.nan, math.inf, 2.0][:len(completions)]


def raises(completions, **kwargs):
    return list(map(float, completions))   # ValueError: the line a stopped run names


RAISES_AT = f"{__file__}:{raises.__code__.co_firstlineno + 1} in raises"


def no_kwargs(completions, answer, scale=1.0):
    return [scale * (c == answer) for c, answer in zip(completions, answer)]


def test_trl_docs_functions_score_a_group_with_the_example_columns():
    rewards = RewardSet.from_specs([trl_spec("reward_len"), trl_spec("reward_func", weight=2.0)])
    completions = ["x" * 20, r"the answer is \boxed{7}", r"\boxed{8}"]
    scores = rewards.score_group("What is 3+4?", completions, {"ground_truth": "7"})
    assert scores.components == {"reward_len": [0.0, -3.0, -11.0], "reward_func": [0.0, 1.0, 0.0]}
    assert scores.total == [0.0, -1.0, -11.0] and scores.errors == {} and scores.not_applicable == {}


def test_called_once_per_group_with_prompts_completions_ids_and_every_column():
    SEEN.clear()
    rewards = RewardSet.from_specs([trl_spec("record", bonus=0.5)])
    scores = rewards.score_group("2+3=", ["5", "five", "6"], {"answer": "5", "level": 2, "prompt": "2+3="},
                                 [[11], [12, 13, 14], [15, 16]])
    assert scores.components == {"record": [1.0, 3.0, 2.0]}
    context = {"trainer_state": rewards.context.trainer_state, "log_metric": rewards.context.log_metric}
    assert SEEN == [{"prompts": ["2+3="] * 3, "completions": ["5", "five", "6"],
                     "completion_ids": [[11], [12, 13, 14], [15, 16]], "answer": ["5"] * 3, "level": [2] * 3,
                     "bonus": 0.5, **context}]   # TRL leaves the prompt column out too; config args pass as they are


# -- TRL's context keywords: trainer_state, log_metric; async rewards ---------------------------------------------
def warmup_scaled(completions, trainer_state, log_metric, **kwargs):
    """Shaping that follows training progress, as TRL's docs suggest with trainer_state."""
    scale = min(1.0, trainer_state.global_step / trainer_state.max_steps)
    log_metric("warmup_scale", scale)
    return [scale * len(c) for c in completions]


def step_only(completions, trainer_state):   # no **kwargs: given only what it names
    return [float(trainer_state.global_step)] * len(completions)


async def async_len(completions, **kwargs):
    import asyncio

    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def test_trainer_state_is_the_served_version_and_learner_max_steps_and_log_metric_is_averaged():
    rewards = RewardSet.from_specs([trl_spec("warmup_scaled"), trl_spec("step_only")], max_steps=10)
    state = rewards.context.trainer_state
    assert (state.global_step, state.max_steps) == (0, 10)
    assert rewards.score_group("q", ["ab", "abcd"], {}).components == {"warmup_scaled": [0.0, 0.0],
                                                                         "step_only": [0.0, 0.0]}
    state.global_step = 5   # what the loop does when it loads version 5
    assert rewards.score_group("q", ["ab", "abcd"], {}).components == {"warmup_scaled": [1.0, 2.0],
                                                                         "step_only": [5.0, 5.0]}
    assert rewards.context.log_metric.means() == {"warmup_scale": 0.25}
    from generator.stats import LoopStats

    stats = LoopStats(logged_metrics=rewards.context.log_metric)
    assert Progress(enabled=False).summary(stats, 5)["warmup_scale"] == 0.25
    other = RewardSet.from_specs([trl_spec("step_only")])   # each set has its own context
    assert other.context is not rewards.context and other.score_group("q", ["a"], {}).total == [0.0]


def test_an_async_trl_reward_is_awaited_from_any_thread():
    rewards = RewardSet.from_specs([trl_spec("async_len")])
    out = {}
    worker = threading.Thread(target=lambda: out.update(s=rewards.score_group("q", ["ab", "abc"], {})))
    worker.start()
    worker.join(10)
    assert rewards.score_group("q", ["a"], {}).components == {"async_len": [1.0]}
    assert out["s"].components == {"async_len": [2.0, 3.0]} and out["s"].errors == {}


def test_none_is_not_applicable_no_value_no_failure_and_left_out_of_means():
    rewards = RewardSet.from_specs([trl_spec("math_reward_func", weight=3.0), trl_spec("reward_len")])
    code = rewards.score_group("Write fizzbuzz", ["x" * 18, "x" * 20], {"task": "code"})
    assert code.components["math_reward_func"] == [0.0, 0.0] and code.total == [-2.0, 0.0]   # reward_len's alone
    assert code.not_applicable == {"math_reward_func": [True, True]} and code.errors == {}
    assert code.applicable("math_reward_func") == [False, False] and code.applicable("reward_len") == [True, True]
    rule = FailureRule(window=4, max_rate=0.5)
    rule.record_group(["math_reward_func", "reward_len"], code.failures)
    rule.check()   # a reward that applies nowhere is not failing
    math_group = rewards.score_group("6*7=", ["42", "41"], {"task": "math"})
    assert math_group.components["math_reward_func"] == [1.0, 0.0] and math_group.not_applicable == {}


def test_the_closing_line_means_leave_not_applicable_out(caplog):
    """The loop counts, per reward, the completions it applied to (generator/loop.py ``_count``); the closing line
    divides by that, not by every completion."""
    from generator.stats import LoopStats

    caplog.set_level(logging.INFO, logger="grpo.generator")
    stats = LoopStats(groups_uploaded=2, reward_count=8, component_sums={"math": 3.0, "len": 4.0},
                      component_counts={"math": 4, "len": 8})
    Progress(enabled=True).close(stats, version=1)
    assert "per-reward means {'math': 0.75, 'len': 0.5}" in caplog.text


@pytest.mark.parametrize("function, failed, what", [
    ("one_short", [True] * 3, "ValueError: returned 2 values for 3 completions"),
    ("raises", [True] * 3, "ValueError: could not convert string to float: 'a'"),
])
def test_a_wrong_length_or_a_raise_fails_the_whole_group(function, failed, what):
    rewards = RewardSet.from_specs([trl_spec(function, on_error=-1.0), trl_spec("reward_len")])
    scores = rewards.score_group("p", ["a", "b", "c"], {})
    assert scores.components[function] == [-1.0] * 3 and scores.errors == {function: 3}
    assert [f is not None for f in scores.failures[function]] == failed
    assert scores.failures[function][0].what == what


def as_array(completions, **kwargs):
    import numpy as np

    return np.array([len(c) for c in completions], dtype=np.float32) / 2


def one_number(completions, **kwargs):
    return 1.0


def test_any_sequence_of_numbers_is_a_result_but_one_number_is_not():
    rewards = RewardSet.from_specs([trl_spec("as_array"), trl_spec("one_number", on_error=-2.0)])
    scores = rewards.score_group("p", ["ab", "abc"], {})
    assert scores.components == {"as_array": [1.0, 1.5], "one_number": [-2.0, -2.0]}
    assert scores.failures["one_number"][0].what == "TypeError: returned float, not a list of 2 numbers or None"


def test_a_non_number_nan_or_inf_fails_that_completion_only():
    rewards = RewardSet.from_specs([trl_spec("garbage", on_error=-5.0)])
    scores = rewards.score_group("p", ["a", "b", "c", "d"], {})
    assert scores.components["garbage"] == [-5.0, -5.0, -5.0, 2.0] and scores.errors == {"garbage": 3}
    assert str(scores.failures["garbage"][0]) == "returned 'high', not a number"


def test_a_reward_that_always_raises_stops_the_run_with_its_line():
    rewards = RewardSet.from_specs([trl_spec("raises")])
    rule = FailureRule(window=64, max_rate=0.5)
    rule.record_group(["raises"], rewards.score_group("p", ["a", "b"], {}).failures)
    with pytest.raises(FailureRateExceeded) as info:
        rule.check()
    assert str(info.value).endswith("the first failure in the window: ValueError: could not convert string to "
                                    f"float: 'a' (at {RAISES_AT})")


def test_a_function_without_kwargs_gets_only_what_it_names_and_a_missing_column_is_named():
    rewards = RewardSet.from_specs([trl_spec("no_kwargs", scale=2.0)])
    assert rewards.score_group("p", ["5", "6"], {"answer": "5", "other": 1}).components["no_kwargs"] == [2.0, 0.0]
    missing = rewards.score_group("p", ["5"], {"label": "5"})
    assert missing.errors == {"no_kwargs": 1}
    assert missing.failures["no_kwargs"][0].what == (
        "ValueError: no_kwargs needs the column 'answer', which the example does not have (columns: ['label'])")


def test_conversational_examples_get_message_lists_as_trl_gives_them():
    messages = [{"role": "system", "content": "Think first."}, {"role": "user", "content": "6*7?"}]
    SEEN.clear()
    rewards = RewardSet.from_specs([trl_spec("format_reward_func"), trl_spec("record")])
    data = {"prompt_messages": messages, "answer": "42"}
    scores = rewards.score_group("6*7?", ["<think>6*7</think><answer>42</answer>", "42"], data, [[1, 2], [3]])
    assert scores.components == {"format_reward_func": [1.0, 0.0], "record": [2.0, 1.0]}
    assert SEEN[0]["prompts"] == [messages, messages] and "prompt_messages" not in SEEN[0]
    assert SEEN[0]["completions"] == [[{"role": "assistant", "content": "<think>6*7</think><answer>42</answer>"}],
                                      [{"role": "assistant", "content": "42"}]]
    forced = RewardSet.from_specs([trl_spec("record", conversational=True)])
    SEEN.clear()
    forced.score_group("6*7?", ["42"], {"answer": "42"}, [[9]])
    assert SEEN[0]["prompts"] == [[{"role": "user", "content": "6*7?"}]]
    assert SEEN[0]["completions"] == [[{"role": "assistant", "content": "42"}]]


# -- which style -------------------------------------------------------------------------------------------------
def simple_one(prompt, completion, example):
    return float(len(completion))


def simple_group(prompt, completions, example):
    return [float(len(c)) for c in completions]


def either(completions=None, completion=None, **kwargs):
    return [7.0] * len(completions) if completions is not None else 1.0


@pytest.mark.parametrize("fn, style", [
    (reward_len, "trl"), (math_reward_func, "trl"), (record, "trl"), (no_kwargs, "trl"),
    (lambda completion_ids, **kwargs: [0.0] * len(completion_ids), "trl"),   # TRL's length penalties
    (simple_one, "simple"), (simple_group, "simple"), (either, "simple"),    # a simple parameter wins
    (lambda **kwargs: 1.0, "simple"), (len, "simple"),                       # nothing to tell: as before
])
def test_the_style_from_the_signature(fn, style):
    assert reward_style(fn, "auto", "style") == style


def test_an_explicit_style_wins():
    trl = RewardSet.from_specs([trl_spec("either", style="trl")])
    assert trl.score_group("p", ["a", "b"], {}).components == {"either": [7.0, 7.0]}
    simple = RewardSet.from_specs([trl_spec("either", style="simple"), trl_spec("either", label="auto")])
    assert simple.score_group("p", ["a", "b"], {}).components == {"either": [1.0, 1.0], "auto": [1.0, 1.0]}


def group_lengths(completions, **kwargs):
    return [float(len(c)) for c in completions] if "example" in kwargs else [-1.0] * len(completions)


def test_per_group_keeps_the_simple_group_form_as_before():
    """``fn(completions, **kwargs)`` looks TRL-style, but with ``per_group: true`` it was (and is) called the simple
    way, with ``prompt`` and ``example`` among its keywords."""
    rewards = RewardSet.from_specs([trl_spec("group_lengths", per_group=True)])
    assert rewards.score_group("p", ["a", "bcd"], {}).components == {"group_lengths": [1.0, 3.0]}


@pytest.mark.parametrize("args, message", [
    ({"function": f"{HERE}:reward_len", "style": "trll"},
     "generator.rewards[0] (python): style: unknown style 'trll'; known styles: auto, simple, trl"),
    ({"function": f"{HERE}:reward_len", "per_group": True, "style": "trl"},
     "generator.rewards[0] (python): per_group applies to the simple style; a TRL-style function is always called "
     "once per group (drop per_group, or set style: simple)"),
    ({"function": f"{HERE}:simple_one", "conversational": True},
     "generator.rewards[0] (python): conversational applies to TRL-style functions only (style: trl)"),
    ({"function": f"{HERE}:no_kwargs", "bonus": 1},
     f"generator.rewards[0] (python): function '{HERE}:no_kwargs': no_kwargs(completions, answer, scale=1.0) takes "
     "no argument 'bonus' (from the reward's args); expected fn(prompts: list, completions: list, completion_ids: "
     "list, **columns) -> list[float | None]"),
])
def test_config_errors_name_the_key(args, message):
    with pytest.raises(RewardConfigError) as info:
        RewardSet.from_specs([RewardSpec(name="python", args=args)])
    assert str(info.value) == message


def test_check_config_finds_a_wrong_style_before_any_model_loads():
    """`grpo check-config`'s reward check builds every reward as the generator does: a wrong style or argument is
    one line."""
    config = GRPOConfig.model_validate({"generator": {"rewards": [
        {"name": "python", "args": {"function": f"{HERE}:reward_len", "style": "batched"}},
        {"name": "python", "label": "ok", "args": {"function": f"{HERE}:reward_len"}}]}})
    assert reward_problems(config) == [
        "generator.rewards[0] (python): style: unknown style 'batched'; known styles: auto, simple, trl"]


@pytest.mark.slow  # a fresh interpreter
def test_the_check_of_a_trl_reward_file_imports_no_torch(tmp_path):
    """As check-config runs it: a fresh interpreter, the signature read, no torch imported."""
    (tmp_path / "trl_reward.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [-abs(20 - len(c)) for c in completions]\n")
    code = ("import sys\nfrom deploy.preflight import reward_problems\nfrom shared.config.schema import GRPOConfig\n"
            f"config = GRPOConfig.model_validate({{'generator': {{'rewards': [{{'name': 'python', 'args': "
            f"{{'function': '{tmp_path}/trl_reward.py:reward_len', 'style': 'trl'}}}}]}}}})\n"
            "print(reward_problems(config), 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[] False"


def test_scoring_from_another_thread_is_the_same():
    """The continuous schedule scores on its uploader thread."""
    rewards = RewardSet.from_specs([trl_spec("math_reward_func")])
    out = []
    thread = threading.Thread(target=lambda: out.append(rewards.score_group("q", ["42", "1"], {"task": "math"})))
    thread.start()
    thread.join()
    assert out[0].components == {"math_reward_func": [1.0, 0.0]}


# -- the real loop and the real CLI ----------------------------------------------------------------------------
GROUPS_SEEN: list[int] = []


def skip_odd_groups(completions, completion_ids, **kwargs):
    """Groups 1, 3, ...: not applicable anywhere; groups 2, 4, ...: not to the first completion, the length of the
    others."""
    GROUPS_SEEN.append(len(completions))
    if len(GROUPS_SEEN) % 2:
        return [None] * len(completions)
    return [None] + [float(len(ids)) for ids in completion_ids[1:]]


@pytest.mark.slow  # the rollout loop with the tiny model against a live hub
def test_the_loop_uploads_and_counts_only_what_a_reward_applied_to(tiny_model_dir, tmp_path, caplog):
    """A reward that applied to none of a group's completions is left out of the uploaded group (the learner's
    ``reward/NAME`` then leaves the group out); one that applied to some carries 0.0 for the others; the closing
    line's mean is over the completions it applied to. ``completion_ids`` are the sampled tokens."""
    import torch

    from generator.engines.hf import TransformersEngine
    from shared.protocol.client import HubClient
    from tests.generator.test_loop import make_loop
    from tests.live_server import LiveServer, make_config

    GROUPS_SEEN.clear()
    caplog.set_level(logging.INFO, logger="grpo.generator")
    rewards = RewardSet.from_specs([trl_spec("skip_odd_groups", label="len"), RewardSpec(name="format")])
    engine = TransformersEngine(tiny_model_dir)
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        loop = make_loop(engine, live.url, tmp_path, rewards=rewards, progress=Progress(enabled=True))
        stats = loop.run(threading.Event(), max_groups=4)
        batch = HubClient(live.url).get_batch(4, wait_s=20)
    assert GROUPS_SEEN == [4, 4, 4, 4] and stats.groups_uploaded == 4
    assert stats.component_counts == {"len": 6, "format": 16}   # 2 groups x 3 completions; format everywhere
    values, lengths = batch.reward_components["len"].view(4, 4), batch.completion_lengths.view(4, 4).float()
    left_out = torch.isnan(values).all(dim=1)
    assert left_out.sum() == 2 and not torch.isnan(values[~left_out]).any()
    assert (values[~left_out][:, 0] == 0.0).all()
    torch.testing.assert_close(values[~left_out][:, 1:], lengths[~left_out][:, 1:])
    applied = float(lengths[~left_out][:, 1:].sum())
    assert stats.component_sums["len"] == pytest.approx(applied)
    assert f"per-reward means {{'format': -1.0, 'len': {round(applied / 6, 3)}}}" in caplog.text


TRL_FILE = """import json
from pathlib import Path

CALLS = Path(__file__).with_suffix(".calls")


def lengths(prompts, completions, completion_ids, answer, **kwargs):
    calls = CALLS.read_text().count("\\n") if CALLS.exists() else 0
    values = [None] * len(completions) if calls % 2 else [float(len(ids)) for ids in completion_ids]
    with open(CALLS, "a") as fh:
        fh.write(json.dumps({"n": len(completions), "prompts": len(set(prompts)), "texts": completions,
                             "values": values}) + "\\n")
    return values
"""


@pytest.mark.slow  # one `grpo eval` process of the tiny model
def test_grpo_eval_runs_a_trl_reward_file_once_per_group(tmp_path, tiny_model_dir):
    from tests.generator.test_cli import ENV, GRPO
    from tests.generator.test_eval_failures_cli import eval_config

    (tmp_path / "trl_reward.py").write_text(TRL_FILE)
    config = eval_config(tmp_path, {"name": "python", "label": "lengths",
                                    "args": {"function": f"{tmp_path}/trl_reward.py:lengths"}})
    result = forks.run([GRPO, "eval", "--model", str(tiny_model_dir), "--config", config], capture_output=True,
                       text=True, timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "trl_reward.calls").read_text().splitlines()]
    # one call per example and pass: 6 greedy groups of 1, then 6 groups of k=2 samples
    assert [c["n"] for c in calls] == [1] * 6 + [2] * 6 and all(c["prompts"] == 1 for c in calls)
    greedy = [c["values"][0] for c in calls[:6]]
    assert greedy[1::2] == [None] * 3 and all(1 <= v <= 4 for v in greedy[::2])   # max_tokens 4
    out = json.loads(result.stdout)
    assert out["num_examples"] == 6
    # the mean over the 3 greedy completions it applied to; the total counts the others as 0
    assert out["greedy_rewards"]["lengths"] == pytest.approx(sum(greedy[::2]) / 3)
    assert out["greedy_mean_reward"] == pytest.approx(sum(greedy[::2]) / 6)


def test_the_loop_stamps_trl_rewards_trainer_state_with_the_version_it_loads(tiny_model_dir, tmp_path):
    from generator.engines.hf import TransformersEngine
    from tests.generator.test_loop import make_loop

    rewards = RewardSet.from_specs([trl_spec("step_only")], max_steps=20)
    loop = make_loop(TransformersEngine(tiny_model_dir), "http://127.0.0.1:9", tmp_path, rewards=rewards)
    assert rewards.context.trainer_state.global_step == 0
    loop.policy_version = 7   # what sync_weights does after loading version 7
    assert rewards.score_group("q", ["a", "b"], {}).components == {"step_only": [7.0, 7.0]}
    assert loop.stats.logged_metrics is rewards.context.log_metric
