"""The continuous schedule's switch budget (generator/continuous/switches.py): at most a share of the wall time goes
to weight switches, measured as the load plus the recompute in the step after; nothing waits when versions come
slower than that."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from generator.continuous.switches import SETTLING_STEPS, SwitchBudget, wait_after_switch


def test_the_wait_pays_a_switch_back_at_the_share():
    assert wait_after_switch(1.0, 0.25) == pytest.approx(3.0)    # 1 s of 4: a quarter
    assert wait_after_switch(0.4, 0.5) == pytest.approx(0.4)
    assert wait_after_switch(2.0, 1.0) == 0.0                    # share 1: never waits
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="max_share"):
            SwitchBudget(bad)


def test_the_step_after_a_switch_adds_its_excess_over_a_usual_step():
    budget = SwitchBudget(0.25)
    for t in range(1, 11):                      # ten usual steps of 0.1 s
        budget.stepped(0.1, t * 0.1)
    assert budget.usual_step_s == pytest.approx(0.1) and budget.allowed(1.0)
    budget.switched(0.3)                        # loaded in 0.3 s ...
    assert not budget.allowed(1.3)              # ... and its recompute not yet stepped: no second switch
    now = 1.3
    for step_s in (0.0, 0.0, 0.5, 0.2, 0.1):    # outputs vLLM's core had queued, then the recompute over two steps
        now += step_s
        budget.stepped(step_s, now)
        assert not budget.allowed(now) and budget.switch_s == 0.0
    budget.stepped(0.1, now + 0.1)              # the last of the window
    assert SETTLING_STEPS == 6 and budget.switch_s == pytest.approx(0.8)   # 0.3 + 0.4 + 0.1
    assert budget.usual_step_s == pytest.approx(0.1)   # the steps after a switch do not move the usual step
    end = now + 0.1
    assert not budget.allowed(end + 2.39) and budget.allowed(end + 2.4)   # 0.8 x 3 = 2.4 s later


def simulate(share: float, step_s: float, loads: list[float], excesses: list[float], publish_every_s: float | None,
             steps: int) -> dict:
    """A loop as ContinuousRollouts runs it (check, maybe switch, step) on a clock: every step takes ``step_s``, the
    i-th switch loads for ``loads[i % n]`` and makes the next step ``excesses[i % n]`` longer. A version is
    published every ``publish_every_s`` (None: a newer one is always there)."""
    budget = SwitchBudget(share)
    now, have, switching, first_use = 0.0, 0, 0.0, {}
    switch_costs = []
    for _ in range(steps):
        newest = have + 1 if publish_every_s is None else int(now // publish_every_s)
        excess = 0.0
        if newest > have and budget.allowed(now):
            i = len(switch_costs)
            load, excess = loads[i % len(loads)], excesses[i % len(excesses)]
            now += load
            budget.switched(load)
            have = newest
            switch_costs.append(load + excess)
            first_use.setdefault(have, now)
        now += step_s + excess
        budget.stepped(step_s + excess, now)
        switching = sum(switch_costs)
    return {"total_s": now, "switching_s": switching, "costs": switch_costs, "first_use": first_use,
            "budget": budget}


@settings(max_examples=200, deadline=None)
@given(share=st.floats(0.05, 1.0), step_s=st.floats(0.001, 0.2),
       loads=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=5),
       excesses=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=5), steps=st.integers(1, 400))
def test_switching_never_takes_more_than_its_share_however_often_versions_come(share, step_s, loads, excesses,
                                                                                steps):
    run = simulate(share, step_s, loads, excesses, None, steps)
    costs = run["costs"]
    # every switch but the last is paid back by the wait after it (the last one's cost is the slack)
    assert run["switching_s"] <= share * run["total_s"] + max(costs, default=0.0) + 1e-9
    if share == 1.0:
        assert len(costs) == steps          # share 1: a new version at every check


def test_a_share_of_one_takes_a_new_version_at_every_check():
    budget = SwitchBudget(1.0)
    budget.stepped(0.1, 0.1)                         # a usual step is known
    for k in range(10):                              # a switch before every step, each loading 0.2 s
        assert budget.allowed(0.1 + k)
        budget.switched(0.2)
        budget.stepped(0.1, 0.2 + k)
    budget.switched(0.2)
    assert budget.switch_s == pytest.approx(10 * 0.2)   # every cut-short window counted (the last still open)


@settings(max_examples=100, deadline=None)
@given(share=st.floats(0.05, 1.0), load=st.floats(0.0, 0.5), excess=st.floats(0.0, 0.5),
       step_s=st.floats(0.01, 0.1))
def test_versions_that_come_slower_than_the_budget_are_taken_at_once(share, load, excess, step_s):
    """Publishes spaced wider than a switch's cost plus its wait (and the steps that measure it): each is taken at
    the first check after it, as with no budget at all."""
    every = wait_after_switch(load + excess, share) + load + excess + (SETTLING_STEPS + 1) * step_s + 0.01
    run = simulate(share, step_s, [load], [excess], every, steps=int(20 * every / step_s) + 10)
    assert len(run["first_use"]) >= 15
    for version, used_at in run["first_use"].items():
        assert used_at - version * every <= step_s + excess + load + 1e-9   # the check after the step it came in
