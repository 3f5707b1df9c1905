"""Staleness-aware pacing: how many more groups a generator may sample before they could only go stale.

A generator that runs ahead of the learner fills the hub with groups that are dropped as stale before the learner
reaches them: wasted generation, and (before they are dropped) the oldest data the bound allows. The hub instead
tells a generator how many groups of *its* policy version the learner can still train within ``max_staleness``;
the generator waits while that number is 0 (``generator.wait_for_budget``). This is the staleness control of the
asynchronous RL systems (AReaL's staleness-aware controller, PipelineRL's bounded lag), counted in groups.

The learner trains groups in queue order, ``groups_per_step`` per version (its global batch): the groups it leased
first (the batch it trains now, the one it prefetched), then the queued ones. The ``p``-th group from now is
trained at version ``learner_version + p // groups_per_step``; a group sampled at version ``v`` in that place has
staleness ``learner_version + p // groups_per_step - v``, which must stay ``<= max_staleness``.
"""

from __future__ import annotations


def groups_wanted(*, generator_version: int, learner_version: int, leased_groups: int, queued_groups: int,
                  groups_per_step: int, max_staleness: int) -> int:
    """Groups sampled at ``generator_version`` that the learner can still train within the staleness bound::

        limit  = (max_staleness + generator_version - learner_version + 1) * groups_per_step
        wanted = max(0, limit - leased_groups - queued_groups)

    ``limit`` is the first place in the learner's order (leased groups first, then the queue) at which such a group
    would be trained more than ``max_staleness`` versions after it was sampled. A generator one version behind
    the learner gets ``groups_per_step`` fewer; with ``max_staleness`` 0 a generator gets a batch only once the
    learner has consumed the previous one and the generator holds the learner's current weights (on-policy).
    """
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
    limit = (max_staleness + generator_version - learner_version + 1) * groups_per_step
    return max(0, limit - leased_groups - queued_groups)
