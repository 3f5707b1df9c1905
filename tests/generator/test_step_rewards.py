"""Rewards that score steps (issue 23 item 2): RewardSet's outcome totals and character steps, hand-computed;
separators at the start, the end and doubled; two step rewards; containment of bad step scores."""

import math

import pytest

from generator.rewards import RewardSet, RewardTerm, StepScores, merge_term_steps, per_completion
from shared.config.schema import RewardSpec


def term(name, fn, weight=1.0, on_error=0.0, group=False):
    return RewardTerm(name, fn if group else per_completion(fn), weight, on_error)


def outcome_by_text(values):
    return lambda prompt, completion, example: values[completion]


def test_an_outcome_only_set_has_no_steps():
    scores = RewardSet([term("a", outcome_by_text({"x": 1.0, "y": 0.0}))]).score_group("p", ["x", "y"], {})
    assert scores.total == [1.0, 0.0] and scores.steps is None and scores.step_errors == 0


def test_steps_and_outcomes_combine_by_hand():
    steps = {"ab\ncd": StepScores([1.0, 0.0], ends=[2, 5]), "zz": 0.5,
             "q": StepScores([0.25], separator="\n", outcome=3.0)}
    rewards = RewardSet([term("arith", outcome_by_text({"ab\ncd": 1.0, "zz": 0.0, "q": 1.0})),
                         term("steps", outcome_by_text(steps), weight=2.0)])
    scores = rewards.score_group("p", ["ab\ncd", "zz", "q"], {})
    # a StepScores without outcome adds 0 to the total; with one, weight * outcome; a float is an outcome
    assert scores.components == {"arith": [1.0, 0.0, 1.0], "steps": [0.0, 0.5, 3.0]}
    assert scores.total == [1.0, 1.0, 7.0]
    # step rewards weighted (x2); the float-scored completion has no steps
    assert scores.steps == [[(2, 2.0), (5, 0.0)], [], [(1, 0.5)]]
    assert scores.errors == {} and scores.step_errors == 0


@pytest.mark.parametrize("text, expected_ends", [
    ("\nab\n\ncd\n", [3, 7]),      # separator at the start, doubled and at the end: empty pieces are no steps
    ("ab\ncd", [2, 5]),
    ("abcd", [4]),                 # no separator: one step, the whole text
    ("ab\n\n\ncd", [2, 7]),
])
def test_separator_steps(text, expected_ends):
    assert StepScores([0.0] * len(expected_ends), separator="\n").char_ends(text) == expected_ends


def test_a_separator_count_mismatch_is_a_clear_error_for_that_completion_only(caplog):
    fn = outcome_by_text({"a\nb": StepScores([1.0, 1.0, 1.0], separator="\n", outcome=1.0),
                          "c\nd": StepScores([0.0, 1.0], separator="\n")})
    with pytest.raises(ValueError, match=r"splits the completion into 2 steps but the reward gave 3"):
        StepScores([1.0, 1.0, 1.0], separator="\n").char_ends("a\nb")
    scores = RewardSet([term("chain", fn, on_error=-1.0)]).score_group("p", ["a\nb", "c\nd"], {})
    assert scores.components["chain"] == [-1.0, 0.0] and scores.errors == {"chain": 1}
    assert scores.steps == [None, [(1, 0.0), (3, 1.0)]] and scores.step_errors == 1
    assert "bad step scores for completion 0" in caplog.text


def test_ends_past_the_text_are_contained():
    fn = outcome_by_text({"abc": StepScores([1.0], ends=[9]), "de": StepScores([1.0], ends=[2])})
    scores = RewardSet([term("s", fn)]).score_group("p", ["abc", "de"], {})
    assert scores.steps == [None, [(2, 1.0)]] and scores.errors == {"s": 1} and scores.step_errors == 1


def test_two_step_rewards_sum_when_their_steps_agree_and_drop_them_when_not(caplog):
    by_sep = outcome_by_text({"a\nb": StepScores([1.0, 0.0], separator="\n"),
                              "cc\nd": StepScores([0.0, 1.0], separator="\n")})
    by_end = outcome_by_text({"a\nb": StepScores([0.5, 0.5], ends=[1, 3], outcome=1.0),
                              "cc\nd": StepScores([0.5, 0.5], ends=[1, 4], outcome=2.0)})
    rewards = RewardSet([term("sep", by_sep, weight=2.0), term("end", by_end)])
    scores = rewards.score_group("p", ["a\nb", "cc\nd"], {})
    assert scores.steps[0] == [(1, 2.5), (3, 0.5)]               # 2 * 1 + 0.5, 2 * 0 + 0.5
    assert scores.steps[1] is None and scores.step_errors == 1   # ends [2, 4] vs [1, 4]
    assert scores.total == [1.0, 2.0] and scores.errors == {}    # the outcomes are kept
    assert "locate different steps" in caplog.text
    with pytest.raises(ValueError, match="'x' and 'y' locate different steps"):
        merge_term_steps({"x": ([1], [1.0]), "y": ([2], [1.0])})


def test_a_failing_step_reward_drops_steps_and_is_counted():
    def flaky(prompt, completion, example):
        if completion == "boom":
            raise RuntimeError("scorer down")
        return StepScores([1.0], ends=[len(completion)])

    rewards = RewardSet([term("outcome", outcome_by_text({"ok": 1.0, "boom": 0.0, "nan": 0.0})),
                         term("flaky", flaky, on_error=-2.0)])
    first = rewards.score_group("p", ["ok", "boom"], {})
    assert first.steps == [[(2, 1.0)], None] and first.step_errors == 1
    assert first.components["flaky"] == [0.0, -2.0] and first.errors == {"flaky": 1}
    assert first.total == [1.0, -2.0]
    # the term is known to score steps: a whole-group failure later drops every completion's steps
    rewards.terms[1].fn = lambda prompt, completions, example: 1 / 0
    second = rewards.score_group("p", ["ok", "nan"], {})
    assert second.steps == [None, None] and second.step_errors == 2 and second.errors == {"flaky": 2}


def test_values_that_are_neither_numbers_nor_step_scores_are_contained():
    rewards = RewardSet([term("odd", lambda p, cs, e: ["abc", math.inf, StepScores([1.0], ends=[1])],
                              on_error=-1.0, group=True)])
    scores = rewards.score_group("p", ["x", "y", "z"], {})
    assert scores.components["odd"] == [-1.0, -1.0, 0.0] and scores.errors == {"odd": 2}
    # a term that scores steps and fails on a completion: that completion's steps are unknown, so it has none
    assert scores.steps == [None, None, [(1, 1.0)]] and scores.step_errors == 2


def test_bad_step_scores_are_refused_when_built():
    for kwargs, message in [({"rewards": [1.0]}, "exactly one of ends"),
                            ({"rewards": [1.0], "ends": [1], "separator": "\n"}, "exactly one of ends"),
                            ({"rewards": [1.0, 2.0], "ends": [1]}, "2 rewards but 1 ends"),
                            ({"rewards": [1.0, 2.0], "ends": [2, 2]}, "strictly increasing"),
                            ({"rewards": [math.nan], "ends": [1]}, "finite"),
                            ({"rewards": [1.0], "separator": ""}, "must not be empty")]:
        with pytest.raises(ValueError, match=message):
            StepScores(**kwargs)


def python_steps(prompt, completion, example, reward=1.0):
    """A python reward scoring each line."""
    return StepScores([reward] * len([line for line in completion.split("\n") if line]), separator="\n")


def python_group_steps(prompt, completions, example):
    return [StepScores([0.5], ends=[len(c)], outcome=1.0) for c in completions]


def test_python_rewards_may_return_step_scores():
    rewards = RewardSet.from_specs([
        RewardSpec(name="python", args={"function": "tests.generator.test_step_rewards:python_steps",
                                        "reward": 0.25}),
        RewardSpec(name="python", label="group", weight=3.0, args={
            "function": "tests.generator.test_step_rewards:python_group_steps", "per_group": True})])
    scores = rewards.score_group("p", ["a\nbc"], {})
    # the per-group one locates one step at the end (4), the per-completion one two (1, 4): they disagree
    assert scores.steps == [None] and scores.total == [3.0]
    single = RewardSet(rewards.terms[:1]).score_group("p", ["a\nbc", "d"], {})
    assert single.steps == [[(1, 0.25), (4, 0.25)], [(1, 0.25)]] and single.total == [0.0, 0.0]
