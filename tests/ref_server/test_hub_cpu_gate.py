"""The hub's CPU gate: uploads decode, validate and lay out their groups one at a time (GIL-bound work that costs 2-4x
the CPU when a process's threads run it in parallel on several cores, docs/hub-capacity.md), while their spool
writes still overlap."""

import inspect
import threading
import time

from ref_server.hub import intake as intake_module
from ref_server.hub.rollout_hub import RolloutHub
from ref_server.hub.spool import RolloutSpool

from .helpers import make_group


def concurrency_of(monkeypatch, owner, name: str, linger_s: float = 0.02) -> dict:
    """Wrap ``owner.name`` to record how many threads are inside it at once (each call lingers ``linger_s``)."""
    seen = {"now": 0, "max": 0, "calls": 0}
    lock = threading.Lock()
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        with lock:
            seen["now"] += 1
            seen["calls"] += 1
            seen["max"] = max(seen["max"], seen["now"])
        try:
            time.sleep(linger_s)
            return real(*args, **kwargs)
        finally:
            with lock:
                seen["now"] -= 1

    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    monkeypatch.setattr(owner, name, staticmethod(counted) if static else counted)
    return seen


def upload_in_parallel(hub: RolloutHub, uploads: int) -> None:
    threads = [threading.Thread(target=hub.put_many, args=([make_group(seed=10 * i + k).to_bytes() for k in range(2)],))
               for i in range(uploads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert hub.depth() == 2 * uploads


def test_decoding_and_row_layout_run_one_at_a_time_and_spool_writes_overlap(tmp_path, monkeypatch):
    hub = RolloutHub(capacity=64, max_staleness=2, scorer=None, spool_dir=tmp_path)
    decode = concurrency_of(monkeypatch, intake_module.RolloutGroup, "from_bytes")
    rows = concurrency_of(monkeypatch, intake_module.GroupRows, "of")
    flush = concurrency_of(monkeypatch, RolloutSpool, "flush", linger_s=0.5)  # a slow disk
    upload_in_parallel(hub, 6)
    assert decode["calls"] == 12 and decode["max"] == 1
    assert rows["calls"] == 12 and rows["max"] == 1
    assert flush["calls"] == 6 and flush["max"] >= 2      # the disk waits of different uploads overlap


def test_without_the_gate_the_same_uploads_decode_in_parallel(tmp_path, monkeypatch):
    hub = RolloutHub(capacity=64, max_staleness=2, scorer=None, spool_dir=tmp_path)
    hub.intake.cpu_gate = None   # what the bench's --ungated compares against
    decode = concurrency_of(monkeypatch, intake_module.RolloutGroup, "from_bytes")
    upload_in_parallel(hub, 6)
    assert decode["calls"] == 12 and decode["max"] >= 2
