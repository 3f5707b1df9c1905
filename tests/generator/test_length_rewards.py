"""Length shaping (issue 40, item 2): DAPO's soft overlong punishment and Kimi k1.5's group-relative length reward,
by hand and through the reward set with the completions' token ids, as the generator scores a group."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from generator.rewards import RewardSet
from generator.rewards.length import group_length_values, soft_overlong_value
from shared.config.schema import RewardSpec


def test_soft_overlong_is_dapos_piecewise_penalty():
    # L_max 20, L_cache 4: nothing up to 16, then linear to -1 at 20, -1 past it
    assert [soft_overlong_value(n, 20, 4) for n in (0, 16, 17, 18, 20, 21)] == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


@given(max_tokens=st.integers(1, 4096), data=st.data())
def test_soft_overlong_is_within_minus_one_and_zero_and_never_rises_with_length(max_tokens, data):
    buffer = data.draw(st.integers(1, max_tokens))
    values = [soft_overlong_value(n, max_tokens, buffer) for n in range(0, max_tokens + 3)]
    assert all(-1.0 <= v <= 0.0 for v in values)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[max_tokens - buffer] == 0.0 and values[max_tokens] == -1.0


def test_group_length_is_kimis_lambda():
    assert group_length_values([10, 20, 30]) == [0.5, 0.0, -0.5]
    assert group_length_values([10, 20, 30], penalty_only=True) == [0.0, 0.0, -0.5]
    assert group_length_values([7, 7, 7]) == [0.0, 0.0, 0.0]   # no spread: no signal (Kimi's formula is 0/0)


@given(st.lists(st.integers(0, 500), min_size=1, max_size=16))
def test_group_length_ranks_by_length_within_a_half(lengths):
    values = group_length_values(lengths)
    assert all(-0.5 <= v <= 0.5 for v in values)
    by_length = [value for _, value in sorted(zip(lengths, values))]
    assert all(shorter >= longer for shorter, longer in zip(by_length, by_length[1:]))   # longer never gets more


def test_the_reward_set_scores_them_from_the_completions_token_ids():
    rewards = RewardSet.from_specs([
        RewardSpec(name="soft_overlong", args={"max_tokens": 8, "buffer": 4}),
        RewardSpec(name="group_length", weight=0.5, args={"apply": "all"})])
    texts = ["a", "bb", "cccc"]   # the text's length is not what counts: the token ids are
    scores = rewards.score_group("p", texts, {}, completion_ids=[[1] * 3, [1] * 6, [1] * 8])
    assert scores.components["soft_overlong"] == [0.0, -0.5, -1.0]
    assert scores.components["group_length"] == pytest.approx([0.5, -0.1, -0.5])
    assert scores.total == pytest.approx([0.25, -0.55, -1.25])


def test_without_token_ids_the_group_fails_by_the_failure_rule():
    rewards = RewardSet.from_specs([RewardSpec(name="soft_overlong", on_error=-2.0,
                                               args={"max_tokens": 8, "buffer": 4})])
    scores = rewards.score_group("p", ["a", "b"], {})
    assert scores.total == [-2.0, -2.0] and all(f is not None for f in scores.failures["soft_overlong"])


@pytest.mark.parametrize("args, message", [({"max_tokens": 8, "buffer": 9}, "0 < buffer <= max_tokens"),
                                           ({"max_tokens": 8}, "buffer"), ({"apply": "some"}, "group_length|apply")])
def test_bad_arguments_are_config_errors_naming_the_reward(args, message):
    name = "group_length" if "apply" in args else "soft_overlong"
    with pytest.raises(ValueError, match=message):
        RewardSet.from_specs([RewardSpec(name=name, args=args)])
