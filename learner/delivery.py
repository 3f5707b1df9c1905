"""Exactly-once training on rollout groups, on top of the hub's at-least-once delivery.

The hub leases each batch to the learner and forgets its groups only when the learner acknowledges it; a lease
that times out (a learner killed mid-step) puts them back in the queue. So a group can come twice: after a lease
expired, or after the hub or the learner restarted. This ledger drops the groups this rank already trained on
(their ids survive in checkpoints), and decides when a batch is acknowledged:

* checkpoints off: right after its step is applied;
* checkpoints on: once a checkpoint holds its step, so a learner that dies between checkpoints resumes from one
  that has not seen those groups, and the hub still has them. The hub hears that each such batch is trained (a
  renewal marked ``trained``), so it paces generators without counting it.

Held leases are renewed by a timer thread every third of the hub's lease timeout, whatever the training thread is
doing (waiting for groups while the generators are down, checkpointing, publishing): a learner that is alive
never lets a trained lease expire. Should one expire anyway (the hub restarted, a renewal was lost), its groups
come back in another batch; when that batch holds groups trained since the last checkpoint, it is *held* like a
trained batch (renewed, acknowledged at the next checkpoint), never acknowledged as a duplicate at once: that would
make the hub delete groups no checkpoint holds yet, and a crash before the checkpoint would lose them.

The same timer sends the learner's session heartbeat (``heartbeat``), at least every third of the hub's session TTL:
a live learner's session is never taken for a crashed one and replaced.

Each rank keeps its own ledger (a checkpoint holds every rank's ids, and a resumed rank loads all of them). While
running, a group re-delivered to a *different* rank than the one that trained it would not be recognised; that
needs a lease to expire under a live learner, which the renewals prevent.

With ``calls`` (a :class:`learner.prefetch.HubCalls`), acknowledgements and renewals are sent by a background
thread, in order, and the training thread does not wait for them. Nothing changes for exactly-once: a group is
dropped because this ledger remembers it, not because the hub was told; a learner that dies before an
acknowledgement left is in the same place as one that died just before sending it (the lease expires, the groups
come back, a resumed learner drops those its checkpoint holds).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from shared.protocol.client import HubClient
from shared.protocol.records import TrainBatch

log = logging.getLogger("grpo.learner")


class DeliveryLedger:
    def __init__(self, client: HubClient, *, ack_on_checkpoint: bool, lease_timeout_s: float,
                 consumed: list[str] = (), remember: int = 1_000_000,
                 calls: Callable[[Callable[[HubClient], None]], None] | None = None,
                 heartbeat: Callable[[HubClient], None] | None = None, session_ttl_s: float | None = None) -> None:
        """``client``: used for the ledger's hub calls when ``calls`` is None (then serialised under a lock, as
        the renewal timer makes them from its own thread). ``heartbeat``: a hub call the timer makes at each tick
        (the learner session's), which comes at least every third of ``session_ttl_s``."""
        self.client = client
        self._client_lock = threading.Lock()
        # how a hub call is made: now, with this client; or handed to a background thread (HubCalls.submit)
        self._call = calls or self._call_now
        self.ack_on_checkpoint = ack_on_checkpoint
        self.renew_every_s = min(lease_timeout_s, session_ttl_s or lease_timeout_s) / 3
        self.heartbeat = heartbeat
        self.remember = remember
        self.consumed: OrderedDict[str, None] = OrderedDict.fromkeys(consumed)
        self.unsaved: set[str] = set()        # group ids trained since the last checkpoint
        self.pending: list[str] = []          # batch ids held until the next checkpoint
        # batch ids a checkpoint freed whose acknowledgement the hub has not answered yet: the next checkpoint still
        # names them (a learner killed before the acknowledgement left must not lose them to the hub's hand-over)
        self.sending: set[str] = set()
        self.active: set[str] = set()         # batch ids leased and not trained yet (prefetched, in training)
        self.duplicates = 0
        self.renewals = 0                     # timer renewals sent (for tests and logs)
        self._lock = threading.Lock()         # pending and unsaved (the timer reads them)
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None

    # -- the training thread ------------------------------------------------------------------------------
    def fresh_part(self, batch: TrainBatch) -> TrainBatch | None:
        """``batch`` without the groups already trained on; None if nothing is left (the batch is then acknowledged,
        or held until the next checkpoint when it holds groups no checkpoint holds yet)."""
        keep = [i for i, group_id in enumerate(batch.group_ids) if group_id not in self.consumed]
        dropped = batch.num_groups - len(keep)
        if dropped:
            self.duplicates += dropped
            log.warning("batch %s: %d of its %d groups were trained on already; dropped", batch.batch_id, dropped,
                        batch.num_groups)
        if not keep:
            self.forget(batch.batch_id)
            if self.ack_on_checkpoint and any(g in self.unsaved for g in batch.group_ids):
                self._hold(batch.batch_id)  # its groups' only copy until a checkpoint holds them
            else:
                self._ack([batch.batch_id])
            return None
        return batch if not dropped else batch.select_groups(keep)

    def trained(self, batch: TrainBatch) -> None:
        """The step on ``batch`` is applied (or deliberately skipped): never train on its groups again."""
        self.consumed.update(dict.fromkeys(batch.group_ids))
        while len(self.consumed) > self.remember:
            self.consumed.popitem(last=False)
        self.forget(batch.batch_id)
        if self.ack_on_checkpoint:
            with self._lock:
                self.unsaved.update(batch.group_ids)
            self._hold(batch.batch_id)
        else:
            self._ack([batch.batch_id])

    def leased(self, batch_id: str) -> None:
        """A batch was leased and is not trained yet (any thread): the timer keeps its lease too."""
        with self._lock:
            self.active.add(batch_id)

    def forget(self, batch_id: str) -> None:
        """A leased batch is trained, acknowledged, held or handed back: no longer renewed as untrained."""
        with self._lock:
            self.active.discard(batch_id)

    def checkpointed(self) -> None:
        """A complete checkpoint holds every step so far: acknowledge what waited for it."""
        with self._lock:
            held, self.pending = self.pending, []
            self.sending.update(held)
            self.unsaved.clear()
        if held:
            self._ack(held)

    def consumed_ids(self) -> list[str]:
        return list(self.consumed)

    def unacknowledged(self) -> list[str]:
        """Batch ids trained and waiting for the next checkpoint, and those whose acknowledgement the hub has not
        answered yet (the checkpoint names them: a resumed learner presents them to the hub, whose leases of them
        it then acknowledges)."""
        with self._lock:
            return list(self.pending) + sorted(self.sending)

    def held(self) -> list[str]:
        """Batch ids whose leases this ledger keeps: trained ones waiting for a checkpoint, then untrained ones."""
        with self._lock:
            return list(self.pending) + sorted(self.active)

    # -- the renewal timer --------------------------------------------------------------------------------
    def start(self) -> DeliveryLedger:
        """Start renewing held leases every ``renew_every_s`` from a thread of its own (idempotent)."""
        if self._timer is None:
            self._timer = threading.Thread(target=self._renew_loop, name="lease-renewal", daemon=True)
            self._timer.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the timer (held leases are no longer renewed: unacknowledged, they expire on the hub)."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join(timeout=timeout_s)

    def renew_held(self) -> None:
        """Renew every lease this ledger keeps now (what the timer does)."""
        with self._lock:
            trained, untrained = list(self.pending), sorted(self.active)
        for ids, is_trained in ((trained, True), (untrained, False)):
            if ids:
                self._call(lambda client, ids=ids, t=is_trained: _renew(client, ids, trained=t,
                                                                        still_held=self.held))
                self.renewals += 1
        if self.heartbeat is not None:
            self._call(self.heartbeat)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                self.renew_held()
            except Exception as exc:  # noqa: BLE001 - the training thread meets the same failure at its next call
                log.warning("lease renewal failed (%s: %s); trying again in %.1fs", type(exc).__name__, exc,
                            self.renew_every_s)

    # -- hub calls ----------------------------------------------------------------------------------------
    def _hold(self, batch_id: str) -> None:
        with self._lock:
            self.pending.append(batch_id)
        # at once: the hub stops counting it among the groups still to train, and its lease restarts
        self._call(lambda client, ids=[batch_id]: _renew(client, ids, trained=True, still_held=self.held))

    def _ack(self, batch_ids: list[str]) -> None:
        ids = [b for b in batch_ids if b]

        def ack(client: HubClient) -> None:
            _ack(client, ids)
            with self._lock:   # answered: acknowledged, known before, or forgotten by a restarted hub
                self.sending.difference_update(ids)
        self._call(ack)

    def _call_now(self, call: Callable[[HubClient], None]) -> None:
        with self._client_lock:
            call(self.client)


def _ack(client: HubClient, batch_ids: list[str]) -> None:
    answer = client.ack_batches(batch_ids)
    unknown = [batch_id for batch_id, status in answer.items() if status == "unknown"]
    if unknown:
        log.warning("the hub did not know %d acknowledged batches (%s): restarted since?", len(unknown),
                    ", ".join(unknown[:3]))


def _renew(client: HubClient, batch_ids: list[str], trained: bool = False,
           still_held: Callable[[], list[str]] = list) -> None:
    answer = client.renew_batches(batch_ids, trained=trained)
    held = set(still_held())  # an id acknowledged meanwhile (a checkpoint) is not a lost lease
    lost = [batch_id for batch_id, status in answer.items() if status != "renewed" and batch_id in held]
    if lost:  # the hub restarted or the lease ran out: its groups come back, and are held again when they do
        log.warning("%d leases could not be renewed (%s): the hub will deliver their groups again", len(lost),
                    ", ".join(lost[:3]))
