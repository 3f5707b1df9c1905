"""The rollout hub: a bounded FIFO of rollout groups between generators and the learner.

* ``queue.py``: :class:`RolloutQueue`, the one queue both halves share (groups in arrival order, lock and
  condition, counters, spool, the learner's version and staleness drops).
* ``intake.py``: :class:`Intake`, the generators' half: uploads validated against the hub's rules (refused at
  upload if they could not join a batch), duplicates, staleness on upload, spool writes and reloads, reference
  scoring as groups arrive.
* ``leases.py``: :class:`Leases`, the learner's half: a batch leased to a batch id, acknowledged, renewed,
  handed back or expired (its groups requeued at the front); delivery at least once, exactly once with the
  learner dropping group ids it already trained on.
* ``rollout_hub.py``: :class:`RolloutHub`, the two halves over one queue, and the generators' budget.
* ``batching.py`` (batch rows laid out once per group), ``pacing.py`` (how many groups a generator may still
  sample), ``spool.py`` (the on-disk spool), ``routes.py`` (the hub's HTTP endpoints).

Staleness: the learner reports its version; groups sampled more than ``max_staleness`` versions earlier are
dropped and counted, never silently. A lease may also name the oldest version it can train (``min_version``: the
learner leases a batch one step ahead, so it knows the version it will train it at).

Cost: the lock is never held across disk writes, and no call the learner makes every step does work proportional
to the queue (staleness drops pop a heap ordered by policy version; a take looks only at the groups it takes).
"""
