"""Progress lines: durations, time left and how often a line comes (shared/progress.py)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.progress import Ticker, eta_seconds, format_duration


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (-3, "0s"), (44.6, "45s"), (60, "1m00s"), (185, "3m05s"),
                                               (3599, "59m59s"), (7620, "2h07m")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@given(st.integers(1, 10_000), st.integers(0, 10_000), st.floats(0.001, 1e6))
def test_eta_is_the_rate_so_far_times_what_is_left(done, extra, elapsed):
    total = done + extra
    assert eta_seconds(done, total, elapsed) == pytest.approx(elapsed / done * extra)
    assert eta_seconds(0, total, elapsed) is None


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_line_every_interval_and_one_at_the_end():
    lines, clock = [], FakeClock()
    ticker = Ticker("evaluating", 100, lines.append, every_s=10, unit="sequences", clock=clock)
    for done in range(1, 101):
        clock.now = done * 0.5  # 0.5 s per unit: a line every 20 units
        ticker.update(done)
    assert lines[0] == "evaluating: 20/100 sequences (20%), ETA 40s"
    assert lines[-1] == "evaluating: 100/100 sequences (100%), in 50s"
    assert len(lines) == 5 and ticker.lines == 5


def test_a_bounded_job_says_at_most_and_may_finish_early():
    lines, clock = [], FakeClock()
    ticker = Ticker("warm-up", 1000, lines.append, every_s=5, bounded=True, clock=clock)
    clock.now = 10
    assert ticker.update(100, "loss 0.5")
    assert lines == ["warm-up: 100/1000 (10%), at most 1m30s more, loss 0.5"]
    clock.now = 11
    assert not ticker.update(110)
    assert ticker.update(110, "target reached", finished=True)
    assert lines[-1] == "warm-up: 110/1000 (11%), in 11s, target reached"
