"""The difficulty curriculum: pass-rate table, draw decisions (by hand and by property) and the stream wrapper."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.curriculum import CurriculumStream, PassRateTable, solved_share
from generator.datasets.base import Example, PromptStream


def examples(n: int) -> list[Example]:
    return [Example(f"q{i}", {"answer": str(i)}, f"ex{i}") for i in range(n)]


def test_solved_share_counts_totals_at_or_above_threshold():
    assert solved_share([1.0, 0.5, 1.0, 0.0], threshold=1.0) == 0.5
    assert solved_share([1.0, 0.5, 1.0, 0.0], threshold=0.5) == 0.75
    with pytest.raises(ValueError, match="without completions"):
        solved_share([], threshold=1.0)


def test_always_and_never_are_skipped_after_min_appearances_mixed_is_kept():
    table = PassRateTable(window=3, min_appearances=2)
    table.record("always", 1.0)
    assert not table.is_settled("always")          # one appearance < min_appearances
    table.record("always", 1.0)
    table.record("never", 0.0)
    table.record("never", 0.0)
    table.record("mixed", 1.0)
    table.record("mixed", 0.5)
    table.record("flip", 1.0)
    table.record("flip", 0.0)                      # always then never: not settled either way
    assert table.skip_set() == {"always", "never"}
    assert not table.should_draw("always") and not table.should_draw("never")
    assert table.should_draw("mixed") and table.should_draw("flip") and table.should_draw("unseen")


def test_only_the_last_window_appearances_count():
    table = PassRateTable(window=2, min_appearances=2)
    for share in (0.5, 1.0, 1.0):
        table.record("a", share)
    assert table.shares("a") == [1.0, 1.0] and table.is_settled("a")
    table.record("a", 0.25)                        # a miss brings it back
    assert not table.is_settled("a")


def test_downweight_draws_a_settled_prompt_with_keep_prob():
    table = PassRateTable(window=2, min_appearances=1, mode="downweight", keep_prob=0.2, seed=7)
    table.record("a", 1.0)
    kept = sum(table.should_draw("a") for _ in range(5000))
    assert 0.17 < kept / 5000 < 0.23


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 0}, "window"), ({"window": 2, "min_appearances": 3}, "min_appearances"),
    ({"mode": "drop"}, "mode"), ({"keep_prob": 1.5}, "keep_prob")])
def test_bad_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PassRateTable(**kwargs)


def test_bad_share_is_named():
    with pytest.raises(ValueError, match="'a'"):
        PassRateTable().record("a", 1.5)


shares = st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 5), min_app=st.integers(1, 5), history=shares)
def test_property_settled_iff_last_window_all_equal_extreme(window, min_app, history):
    min_app = min(min_app, window)
    table = PassRateTable(window=window, min_appearances=min_app)
    for share in history:
        table.record("a", share)
    last = history[-window:]
    expected = len(last) >= min_app and (set(last) == {1.0} or set(last) == {0.0})
    assert table.is_settled("a") == expected
    if len(set(last)) > 1:                         # mixed outcomes: never skipped
        assert table.should_draw("a")


@settings(max_examples=50, deadline=None)
@given(outcomes=st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=4, max_size=4), seed=st.integers(0, 99))
def test_property_the_stream_never_stops_and_never_draws_a_skipped_prompt(outcomes, seed):
    table = PassRateTable(window=2, min_appearances=2)
    for i, share in enumerate(outcomes):
        table.record(f"ex{i}", share)
        table.record(f"ex{i}", share)
    stream = CurriculumStream(PromptStream(examples(4), seed=seed, generator_id="g"), table)
    drawn = stream.take(12)                        # never skips everything: always returns
    skipped = table.skip_set()
    if skipped != {f"ex{i}" for i in range(4)}:
        assert not {e.example_id for e in drawn} & skipped
    assert stream.skipped_share == stream.skipped / stream.drawn


def test_stream_skips_settled_ids_and_counts_the_share():
    table = PassRateTable(window=2, min_appearances=2)
    for eid in ("ex0", "ex1"):
        table.record(eid, 1.0)
        table.record(eid, 1.0)
    base = PromptStream(examples(4), seed=3, generator_id="g")
    stream = CurriculumStream(base, table)
    drawn = stream.take(20)                        # 10 epochs of the two kept prompts
    assert {e.example_id for e in drawn} == {"ex2", "ex3"}
    assert stream.skipped == stream.drawn - 20
    # each epoch of 4 gives 2 kept and 2 skipped: the last epoch may be partly drawn
    assert 19 <= stream.skipped <= 20
    assert stream.skipped_share == pytest.approx(stream.skipped / (stream.skipped + 20))


def test_stream_keeps_prompt_stream_order_when_nothing_is_settled():
    plain = PromptStream(examples(5), seed=1, generator_id="g").take(12)
    wrapped = CurriculumStream(PromptStream(examples(5), seed=1, generator_id="g"), PassRateTable()).take(12)
    assert [e.example_id for e in wrapped] == [e.example_id for e in plain]


def test_everything_settled_falls_back_and_says_so_once(caplog):
    table = PassRateTable(window=1, min_appearances=1)
    for i in range(3):
        table.record(f"ex{i}", 0.0)
    stream = CurriculumStream(PromptStream(examples(3), seed=0, generator_id="g"), table)
    with caplog.at_level(logging.WARNING, logger="generator.curriculum"):
        drawn = stream.take(6)
    assert sorted(e.example_id for e in drawn) == ["ex0", "ex0", "ex1", "ex1", "ex2", "ex2"]
    assert stream.skipped == 0
    assert sum("drawing them normally" in r.message for r in caplog.records) == 1
