"""Groups that can never be accepted: counted and dropped once, their reason logged once per kind, and a generator
whose every group is refused stops with the reason.

A group the hub refuses (400/422: a value it cannot batch, a row longer than the model's context, a trajectory
without a model token) is not sent again: the same group would be refused again. The generator samples new prompts
instead, which helps when only some prompts make refusable groups and never when the config makes every group
refusable (an environment whose reset() text fills ``max_total_tokens``, a max_tokens past the model's context):
that was a livelock (thousands of groups refused, the learner at step 0, the run never ending). So
``generator.max_refused_in_a_row`` groups refused in a row, none accepted in between, stop the generator with the
last reason (:class:`GroupsRefused`, exit 2: the config has to change). Stale groups are not refusals: they say
nothing about whether the next group can be accepted.

Groups dropped by dynamic sampling (``generator.drop_constant_groups``: every completion scored alike) are not
refusals either, but they can livelock the same way: while a generator uploads nothing, the learner gets no batch,
so the policy does not change, and neither does the chance that a group carries signal (a reward that is constant by
a bug, a task the model never or always solves). So ``max_refused_in_a_row`` groups in a row dropped as constant,
all sampled from one policy version, stop the generator too, naming the scores; a new version (another generator's
groups trained on) starts the count again.
"""

from __future__ import annotations

import logging
import re

from shared.errors import UsageError

log = logging.getLogger("grpo.generator")


class GroupsRefused(UsageError):
    """Every group for ``generator.max_refused_in_a_row`` groups was refused; the message gives the reason."""


def reason_kind(reason: str) -> str:
    """What a refusal's reason says without its numbers (``completion 3: 700 tokens exceed ...`` and ``completion 0:
    650 tokens exceed ...`` are one kind), so that each kind is logged once."""
    return re.sub(r"\d+(\.\d+)?", "N", reason)[:300]


class RefusalCounter:
    """Counts the groups refused (by the hub, or found unacceptable before upload) and the run of refusals since
    the last accepted group; raises :class:`GroupsRefused` when that run reaches ``limit`` (0: never)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.kinds: dict[str, int] = {}   # reason kind -> groups refused for it
        self.constant_in_a_row = 0          # groups dropped as constant since the last accepted, from one version
        self.constant_version: int | None = None

    def accepted(self) -> None:
        self.in_a_row = 0
        self.constant_in_a_row = 0

    def constant(self, version: int, totals: list[float]) -> None:
        """A group sampled from policy ``version`` dropped by dynamic sampling (its completions' ``totals`` all
        equal); GroupsRefused when the last ``limit`` groups were, all from this version (the module docstring)."""
        if version != self.constant_version:
            self.constant_version, self.constant_in_a_row = version, 0
        self.constant_in_a_row += 1
        if self.limit and self.constant_in_a_row >= self.limit:
            raise GroupsRefused(
                f"the last {self.constant_in_a_row} groups, all sampled from policy version {version}, were dropped by "
                f"dynamic sampling (generator.drop_constant_groups): the completions of each scored alike (the last "
                f"group: {totals[0]:g} for all {len(totals)}), so no batch reaches the learner and the policy, and "
                "with it the groups, cannot change (generator.max_refused_in_a_row = "
                f"{self.limit}). Check the reward (one that scores every completion the same: a wrong field or answer "
                "format), or give the model a task it solves sometimes, or set generator.drop_constant_groups: false")

    def refused(self, who: str, reason: str) -> None:
        """A group ``who`` (the hub, or this generator's own check) refused for ``reason``: logged when it is the
        first of its kind, counted; GroupsRefused when every group of the last ``limit`` was refused."""
        kind = reason_kind(reason)
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        if self.kinds[kind] == 1:
            log.error("%s refused a group: %s (each kind of refusal is logged once; every refused group is counted "
                      "and dropped, never sent again)", who, reason)
        self.in_a_row += 1
        if self.limit and self.in_a_row >= self.limit:
            raise GroupsRefused(
                f"{who} refused the last {self.in_a_row} groups and accepted none in between "
                f"(generator.max_refused_in_a_row = {self.limit}); the last reason: {reason}. No group of this "
                "config can be accepted: change what the reason names (e.g. generator.environment.max_total_tokens "
                "or the environment's reset() text, generator.sampling.max_tokens, the model)")
