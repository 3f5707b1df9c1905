"""The spool's group commit: an upload of k groups waits for the disk once, and a kill -9 at any point of it (or of
an acknowledgement) loses no group that was acknowledged to its generator and replays none the learner acknowledged.

Real spools on tmp_path and real fsyncs; the calls are only counted (and, in the crash test, a forked hub process
SIGKILLs itself just before the chosen one)."""

import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ref_server.hub import spool as spool_module
from ref_server.hub.rollout_hub import RolloutHub
from ref_server.hub.spool import RolloutSpool

from .helpers import make_group


def open_hub(spool: Path, capacity: int = 64) -> RolloutHub:
    return RolloutHub(capacity=capacity, max_staleness=100, scorer=None, spool_dir=spool, lease_timeout_s=600.0)


def test_a_k_group_upload_waits_for_the_disk_once_and_fsyncs_every_file(tmp_path, monkeypatch):
    hub = open_hub(tmp_path)
    flushes, fsyncs, sizes_at_flush = [], [], []
    real_flush, real_fsync = RolloutSpool.flush, os.fsync

    def counted_flush(fds):
        flushes.append(len(fds))
        # every file of the upload is written before the first wait for the disk
        sizes_at_flush.append(sorted(p.stat().st_size for p in tmp_path.glob("*.tmp")))
        real_flush(fds)

    def counted_fsync(fd):
        fsyncs.append((len(flushes), os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(RolloutSpool, "flush", staticmethod(counted_flush))
    monkeypatch.setattr(spool_module.os, "fsync", counted_fsync)
    groups = [make_group(seed=i) for i in range(6)]
    messages = [g.to_bytes() for g in groups]
    answers = hub.put_many(messages[:5])
    assert [a["accepted"] for a in answers] == [True] * 5
    assert flushes == [5]                                    # one durability wait for the whole upload
    assert sizes_at_flush == [sorted(len(m) for m in messages[:5])]
    assert len(fsyncs) == 5 and {n for n, _ in fsyncs} == {1}  # each file fsynced, all inside that one wait
    assert sorted(Path(p).name for _, p in fsyncs) == sorted(f"{g.group_id}.tmp" for g in groups[:5])
    assert sorted(p.name.split("-", 1)[1] for p in tmp_path.glob("*.group")) == sorted(
        f"{g.group_id}.group" for g in groups[:5])
    assert not list(tmp_path.glob("*.tmp"))

    # a retry with one new group, a duplicate and a bad one: one wait, for the one group spooled
    answers = hub.put_many([messages[4], b"not a group", messages[5]])
    assert [a.get("duplicate", False) for a in answers] == [True, False, False]
    assert [a["accepted"] for a in answers] == [True, False, True] and answers[1]["status"] == 400
    assert flushes == [5, 1] and len(fsyncs) == 6
    # a single upload (POST /v1/rollouts) is a group commit of one
    single = make_group(seed=99)
    hub.put(single.to_bytes())
    assert flushes == [5, 1, 1] and len(fsyncs) == 7
    # queued in upload order, one sequence number each
    assert [e.group.group_id for e in hub.queue.groups.values()] == [g.group_id for g in [*groups, single]]


def test_a_failed_group_commit_spools_and_queues_none_of_the_upload(tmp_path, monkeypatch):
    hub = open_hub(tmp_path)
    groups = [make_group(seed=i) for i in range(3)]

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spool_module.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        hub.put_many([g.to_bytes() for g in groups])
    assert hub.depth() == 0 and hub.queue.reserved == 0 and hub.counters.accepted == 0
    assert not list(tmp_path.iterdir())                     # no temporary file left behind
    monkeypatch.undo()
    assert [a["accepted"] and not a.get("duplicate") for a in hub.put_many([g.to_bytes() for g in groups])] == [
        True] * 3                                            # the retry is queued, not answered as a duplicate


def test_a_full_queue_refuses_before_decoding_but_still_answers_a_retry(tmp_path, monkeypatch):
    hub = open_hub(tmp_path, capacity=2)
    groups = [make_group(seed=i) for i in range(3)]
    assert [a["accepted"] for a in hub.put_many([g.to_bytes() for g in groups[:2]])] == [True, True]
    decoded = []
    real_decode = hub.intake._decode
    monkeypatch.setattr(hub.intake, "_decode", lambda data: decoded.append(1) or real_decode(data))
    with pytest.raises(RuntimeError, match="full"):
        hub.put_many([groups[2].to_bytes()])
    assert decoded == [] and hub.counters.rejected_full == 1  # refused from the header alone
    assert hub.put_many([groups[1].to_bytes()])[0]["duplicate"] is True  # a retry of a queued group: decoded
    assert decoded == [1]


# -- kill -9 at any point ------------------------------------------------------------------------------------------
# each lifetime of the hub runs in a forked process that SIGKILLs itself just before its n-th disk operation (a file
# write, a start of writeback, an fsync, a rename into the queue, an unlink of an acknowledged group, a lease file);
# what it told its clients is logged line by line (unbuffered) before the next operation can start.
UPLOAD = st.lists(st.sampled_from(["new", "new", "new", "retry", "bad"]), min_size=1, max_size=5)
OP = st.one_of(st.tuples(st.just("upload"), UPLOAD), st.tuples(st.just("train"), st.integers(1, 4)))
LIFETIME = st.tuples(st.lists(OP, min_size=1, max_size=6), st.integers(0, 40))


def run_lifetime(spool: Path, log: Path, ops: list, kill_at: int, first_seed: int, retry: list[bytes]) -> None:
    """In a forked child: open the hub on ``spool``, resend the upload a kill cut short, run ``ops``, log every
    answer, and die by SIGKILL before disk operation ``kill_at`` (or after the last op)."""
    count = [0]

    def killable(real):
        def op(*args, **kwargs):
            count[0] += 1
            if count[0] >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return op

    spool_module.os.fsync = killable(os.fsync)
    spool_module.os.replace = killable(os.replace)
    if spool_module._start_writeback is not None:
        spool_module._start_writeback = killable(spool_module._start_writeback)
    RolloutSpool.remove = killable(RolloutSpool.remove)
    RolloutSpool.write_lease = killable(RolloutSpool.write_lease)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def say(**entry):
        os.write(fd, (json.dumps(entry) + "\n").encode())

    hub = open_hub(spool)
    hub.release(list(hub.leases.held))   # the learner of the last lifetime is gone: its leases come back now
    seed = first_seed
    uploads = [("upload", None)] if retry else []
    for kind, arg in uploads + ops:
        if kind == "upload":
            if arg is None:
                messages = retry
            else:
                messages = []
                for what in arg:
                    seed += 1
                    if what == "bad":
                        messages.append(b"garbage")
                    elif what == "retry" and messages:
                        messages.append(messages[-1])
                    else:
                        messages.append(make_group(seed=seed).to_bytes())
            say(sending=[m.hex() for m in messages])
            answers = hub.put_many(messages)
            say(accepted=[make_id(m) for m, a in zip(messages, answers) if a["accepted"]])
        else:
            batch = hub.take(arg)
            if batch is not None:
                say(delivered=batch.group_ids)   # and acknowledged at once: a kill may cut that short
                answer = hub.ack([batch.batch_id])[batch.batch_id]
                if answer == "acked":
                    say(consumed=batch.group_ids)
    os.kill(os.getpid(), signal.SIGKILL)


def make_id(message: bytes) -> str:
    from shared.protocol.records import RolloutGroup
    return RolloutGroup.from_bytes(message).group_id


@pytest.mark.slow  # forks a hub process per lifetime
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LIFETIME, min_size=1, max_size=4))
def test_no_acknowledged_group_is_lost_or_replayed_across_kills(lifetimes):
    with tempfile.TemporaryDirectory() as tmp:
        spool, log = Path(tmp) / "spool", Path(tmp) / "log"
        accepted, consumed, delivered_after_consumed = set(), set(), []
        acking: set[str] = set()   # delivered, and the hub was killed before it answered their acknowledgement
        retry: list[bytes] = []
        for n, (ops, kill_at) in enumerate(lifetimes):
            unanswered: list[str] = []
            pid = os.fork()
            if pid == 0:  # the hub's lifetime; never returns into pytest
                try:
                    run_lifetime(spool, log, ops, kill_at, first_seed=1000 * n, retry=retry)
                finally:
                    os._exit(3)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                if "sending" in entry:
                    retry = [bytes.fromhex(m) for m in entry["sending"]]  # unanswered until "accepted" follows
                elif "accepted" in entry:
                    accepted.update(entry["accepted"])
                    retry = []
                elif "delivered" in entry:
                    delivered_after_consumed += [g for g in entry["delivered"] if g in consumed]
                    unanswered = entry["delivered"]
                elif "consumed" in entry:
                    consumed.update(entry["consumed"])
                    unanswered = []
            acking.update(unanswered)
            log.unlink(missing_ok=True)
        # the last restart, in this process: what the spool holds is every group accepted and not consumed
        hub = open_hub(spool)
        hub.release(list(hub.leases.held))
        queued = [e.group.group_id for e in hub.queue.groups.values()]
        assert delivered_after_consumed == [], "a group the learner acknowledged was delivered again"
        assert len(queued) == len(set(queued)), "a group is queued twice"
        assert not set(queued) & consumed, "a consumed group came back"
        # (a group whose acknowledgement the kill cut short was trained: it may be gone or queued again)
        assert accepted - consumed - acking <= set(queued), "a group acknowledged to its generator was lost"
        # anything else queued is a group of the upload the kill cut short (spooled, never answered)
        assert set(queued) - accepted <= {make_id(m) for m in retry if m != b"garbage"}
        assert not list(spool.glob("*.tmp"))
