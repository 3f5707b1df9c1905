"""Leases across hub restarts (issue 22): hypothesis over interleavings of uploads, takes, renewals (trained or
not), acknowledgements, expiries, version reports and restarts (killed, clean, or killed with a torn lease file) of
a real :class:`RolloutHub` on a real spool folder.

Checked after every step: the books over all hub lifetimes, accepted = consumed + queued + leased + dropped +
quarantined (each lifetime's inflow is what the last one left spooled); no group is handed out while a lease the hub
still honours holds it, nor after an acknowledgement consumed it; an acknowledgement answers ``acked`` exactly for
the leases the hub still holds, restarts included, and ``unknown`` for those a restart did not keep."""

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_server.hub.rollout_hub import RolloutHub

from .helpers import make_group

COUNTED = ("consumed", "dropped_stale", "dropped_ref_failure", "quarantined", "spool_corrupt")


def open_hub(spool: Path) -> RolloutHub:
    # a lease timeout no test step reaches: leases expire only through the "expire" step
    return RolloutHub(capacity=64, max_staleness=1, scorer=None, spool_dir=spool, lease_timeout_s=600.0,
                      max_deliveries=2)


@dataclass
class Books:
    """The learner's view and the run's totals over the hub lifetimes."""

    held: dict[str, list[str]] = field(default_factory=dict)     # batch id -> group ids, not acknowledged yet
    live: set[str] = field(default_factory=set)                  # of those, the ones the hub still leases
    expired: set[str] = field(default_factory=set)               # expired in this hub lifetime
    trained: set[str] = field(default_factory=set)               # renewed with trained=True while live
    consumed_ids: set[str] = field(default_factory=set)          # groups an "acked" answer consumed
    closed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("accepted", *COUNTED), 0))
    seed: int = 0

    def close_lifetime(self, hub: RolloutHub) -> None:
        for key in self.closed:
            self.closed[key] += getattr(hub.counters, key)


def check_books(hub: RolloutHub, books: Books) -> None:
    c = hub.counters
    accepted = books.closed["accepted"] + c.accepted
    out = sum(books.closed[key] + getattr(c, key) for key in COUNTED) + hub.depth() + hub.leased_depth()
    assert accepted == out, (accepted, out, c, hub.depth(), hub.leased_depth())
    assert hub.leased_depth() == sum(len(books.held[b]) for b in books.live)
    assert set(hub.leases.held) == books.live


def restart(hub: RolloutHub, spool: Path, books: Books, how: str) -> RolloutHub:
    books.close_lifetime(hub)
    if how == "clean":
        hub.close()   # untrained leases count failed and are not kept; trained ones are
        books.live &= books.trained
    elif how == "torn" and books.live:
        victim = sorted(books.live)[0]
        path = spool / f"{victim}.lease"
        path.write_text(path.read_text()[:7])   # damaged (the write-and-rename keeps a killed hub from this)
        books.live.discard(victim)
    books.expired.clear()
    return open_hub(spool)


def step(hub: RolloutHub, spool: Path, books: Books, op: tuple) -> RolloutHub:
    kind, arg = op
    if kind == "put":
        books.seed += 1
        hub.put(make_group(seed=books.seed, version=hub.learner_version).to_bytes())
    elif kind == "take":
        batch = hub.take(arg)
        if batch is not None:
            assert not set(batch.group_ids) & books.consumed_ids, "delivered after it was acknowledged"
            leased_live = {g for b in books.live for g in books.held[b]}
            assert not set(batch.group_ids) & leased_live, "delivered while a live lease holds it"
            books.held[batch.batch_id] = batch.group_ids
            books.live.add(batch.batch_id)
    elif kind in ("renew", "ack", "expire") and books.held:
        batch_id = sorted(books.held)[arg % len(books.held)]
        if kind == "renew":
            trained = bool(arg % 2)
            answer = hub.renew([batch_id], trained=trained)[batch_id]
            assert answer == ("renewed" if batch_id in books.live else "unknown")
            if batch_id in books.live and trained:
                books.trained.add(batch_id)
        elif kind == "ack":
            answer = hub.ack([batch_id])[batch_id]
            if batch_id in books.live:
                assert answer == "acked"
                books.consumed_ids.update(books.held[batch_id])
            elif batch_id in books.expired:
                assert answer in ("late", "already")
            else:
                assert answer == "unknown"
            books.live.discard(batch_id)
            del books.held[batch_id]
        elif batch_id in books.live:   # the clock runs past this lease's deadline
            with hub.queue.cond:
                hub.leases.held[batch_id].deadline = float("-inf")
                hub.leases.expire_locked()
            books.live.discard(batch_id)
            books.expired.add(batch_id)
    elif kind == "version":
        hub.report_version(hub.learner_version + 1)
    elif kind == "restart":
        hub = restart(hub, spool, books, arg)
        assert {b for b, lease in hub.leases.held.items() if lease.trained} == books.live & books.trained
    return hub


PUT, TAKE = st.tuples(st.just("put"), st.just(0)), st.tuples(st.just("take"), st.integers(1, 3))
OPS = st.one_of(   # uploads and takes weighted up, so that most runs hold leases when they restart
    PUT, PUT, TAKE, TAKE,
    st.tuples(st.sampled_from(["renew", "ack", "expire"]), st.integers(0, 7)),
    st.tuples(st.just("version"), st.just(0)),
    st.tuples(st.just("restart"), st.sampled_from(["kill", "clean", "torn"])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=3, max_size=40))
def test_the_books_and_acknowledgements_hold_across_hub_restarts(ops):
    with tempfile.TemporaryDirectory() as tmp:
        spool = Path(tmp)
        hub, books = open_hub(spool), Books()
        for op in [("put", 0)] * 3 + ops:
            hub = step(hub, spool, books, op)
            check_books(hub, books)
        # the learner acknowledges everything it holds: every group is accounted for, none left leased
        for batch_id in list(books.held):
            hub = step(hub, spool, books, ("ack", sorted(books.held).index(batch_id)))
        check_books(hub, books)
        assert hub.leased_depth() == 0 and not list(spool.glob("*.lease"))


def test_a_trained_lease_outlives_a_kill_and_a_clean_restart_and_its_ack_consumes_it(tmp_path):
    hub = open_hub(tmp_path)
    for i in range(3):
        hub.put(make_group(seed=i).to_bytes())
    trained, untrained = hub.take(2), hub.take(1)
    hub.renew([trained.batch_id], trained=True)
    lease = json.loads((tmp_path / f"{trained.batch_id}.lease").read_text())
    assert (lease["batch_id"], len(lease["seqs"]), lease["trained"]) == (trained.batch_id, 2, True)
    hub = open_hub(tmp_path)                       # killed: both leases held again
    assert hub.leased_depth() == 3 and hub.depth() == 0
    hub.close()                                    # clean: the untrained one counts failed and is queued again
    hub = open_hub(tmp_path)
    assert hub.leased_depth() == 2 and hub.depth() == 1
    assert hub.report_version(5) == 1              # only the queued group goes stale: the trained ones are held
    assert hub.ack([trained.batch_id, untrained.batch_id]) == {trained.batch_id: "acked",
                                                               untrained.batch_id: "unknown"}
    assert (hub.counters.consumed, hub.counters.dropped_stale, hub.leased_depth()) == (2, 1, 0)
    assert list(tmp_path.glob("*.group")) == [] and list(tmp_path.glob("*.lease")) == []


def test_a_torn_or_foreign_lease_file_is_ignored_and_its_groups_queued(tmp_path):
    hub = open_hub(tmp_path)
    hub.put(make_group(seed=0).to_bytes())
    batch = hub.take(1)
    path = tmp_path / f"{batch.batch_id}.lease"
    for garbage in ['{"batch_id": "', '[]', json.dumps({"batch_id": "ab" * 16, "seqs": [0], "deadline_unix": 0,
                                                         "trained": True})]:
        path.write_text(garbage)                   # torn, not a lease, or naming another batch than its file
        again = open_hub(tmp_path)
        assert (again.depth(), again.leased_depth(), again.counters.spool_reloaded) == (1, 0, 1)
        assert not path.exists()
        hub = again
        batch = hub.take(1)
        path = tmp_path / f"{batch.batch_id}.lease"
    assert hub.ack([batch.batch_id]) == {batch.batch_id: "acked"}


def test_a_lease_write_cut_short_leaves_the_last_whole_lease(tmp_path):
    hub = open_hub(tmp_path)
    for i in range(2):
        hub.put(make_group(seed=i).to_bytes())
    batch = hub.take(2)
    # killed while replacing the file at a renewal (trained=True): the half-written copy never took its name
    (tmp_path / f"{batch.batch_id}.lease.tmp").write_text('{"batch_id": "' + batch.batch_id[:5])
    again = open_hub(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    assert (again.leased_depth(), again.depth(), again.leases.held[batch.batch_id].trained) == (2, 0, False)
    assert again.renew([batch.batch_id], trained=True) == {batch.batch_id: "renewed"}
    assert json.loads((tmp_path / f"{batch.batch_id}.lease").read_text())["trained"] is True
    assert again.ack([batch.batch_id]) == {batch.batch_id: "acked"} and again.counters.consumed == 2
