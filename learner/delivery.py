"""Exactly-once training on rollout groups, on top of the hub's at-least-once delivery.

The hub leases each batch to the learner and forgets its groups only when the learner acknowledges it; a lease
that times out (a learner killed mid-step) puts them back in the queue. So a group can come twice: after a lease
expired, or after the hub or the learner restarted. This ledger drops the groups this rank already trained on
(their ids survive in checkpoints), and decides when a batch is acknowledged:

* checkpoints off: right after its step is applied;
* checkpoints on: once a checkpoint holds its step (until then the leases are renewed), so a learner that dies
  between checkpoints resumes from one that has not seen those groups, and the hub still has them. The hub hears
  that each such batch is trained (a renewal marked ``trained``), so it paces generators without counting it.

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
import time
from collections import OrderedDict
from collections.abc import Callable

from shared.protocol.client import HubClient
from shared.protocol.records import TrainBatch

log = logging.getLogger("grpo.learner")


class DeliveryLedger:
    def __init__(self, client: HubClient, *, ack_on_checkpoint: bool, lease_timeout_s: float,
                 consumed: list[str] = (), remember: int = 1_000_000,
                 calls: Callable[[Callable[[HubClient], None]], None] | None = None) -> None:
        self.client = client
        # how a hub call is made: now, with this client; or handed to a background thread (HubCalls.submit)
        self._call = calls or (lambda call: call(self.client))
        self.ack_on_checkpoint = ack_on_checkpoint
        self.renew_every_s = lease_timeout_s / 3
        self.remember = remember
        self.consumed: OrderedDict[str, None] = OrderedDict.fromkeys(consumed)
        self.pending: list[str] = []          # batch ids trained on, waiting for a checkpoint
        self.duplicates = 0
        self._renewed = time.monotonic()

    def fresh_part(self, batch: TrainBatch) -> TrainBatch | None:
        """``batch`` without the groups already trained on; None (and the batch acknowledged) if nothing is left."""
        keep = [i for i, group_id in enumerate(batch.group_ids) if group_id not in self.consumed]
        dropped = batch.num_groups - len(keep)
        if dropped:
            self.duplicates += dropped
            log.warning("batch %s: %d of its %d groups were trained on already; dropped", batch.batch_id, dropped,
                        batch.num_groups)
        if not keep:
            self._ack([batch.batch_id])
            return None
        return batch if not dropped else batch.select_groups(keep)

    def trained(self, batch: TrainBatch) -> None:
        """The step on ``batch`` is applied (or deliberately skipped): never train on its groups again."""
        self.consumed.update(dict.fromkeys(batch.group_ids))
        while len(self.consumed) > self.remember:
            self.consumed.popitem(last=False)
        if self.ack_on_checkpoint:
            self.pending.append(batch.batch_id)
            self._call(lambda client, ids=[batch.batch_id]: _renew(client, ids, trained=True))
            self._renew_if_due()
        else:
            self._ack([batch.batch_id])

    def checkpointed(self) -> None:
        """A complete checkpoint holds every step so far: acknowledge what waited for it."""
        if self.pending:
            self._ack(self.pending)
            self.pending = []

    def consumed_ids(self) -> list[str]:
        return list(self.consumed)

    def _renew_if_due(self) -> None:
        if time.monotonic() - self._renewed < self.renew_every_s:
            return
        self._call(lambda client, pending=list(self.pending): _renew(client, pending))
        self._renewed = time.monotonic()

    def _ack(self, batch_ids: list[str]) -> None:
        self._call(lambda client, ids=[b for b in batch_ids if b]: _ack(client, ids))


def _ack(client: HubClient, batch_ids: list[str]) -> None:
    answer = client.ack_batches(batch_ids)
    unknown = [batch_id for batch_id, status in answer.items() if status == "unknown"]
    if unknown:
        log.warning("the hub did not know %d acknowledged batches (%s): restarted since?", len(unknown),
                    ", ".join(unknown[:3]))


def _renew(client: HubClient, batch_ids: list[str], trained: bool = False) -> None:
    answer = client.renew_batches(batch_ids, trained=trained)
    lost = [batch_id for batch_id, status in answer.items() if status != "renewed"]
    if lost:  # the hub restarted or the lease ran out: its groups come back and are dropped as duplicates
        log.warning("%d leases could not be renewed (%s): the hub will deliver their groups again", len(lost),
                    ", ".join(lost[:3]))
