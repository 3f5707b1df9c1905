"""What the sender's member links share with it, declared below both of them.

:class:`shared.weight_sync.sender.WeightSender` owns the send buffer, the version it holds and who reads it;
:mod:`shared.weight_sync.members` (the generators holding a group, one thread each) reads and marks that state and
reports back through the methods of :class:`SenderState`. The members module knows the sender only through this
protocol, so the sender imports the members and never the other way round.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from shared.config.schema.weight_sync import WeightSyncConfig
from shared.protocol.client import HubClient
from shared.weight_sync.layout import Layout


@dataclass
class SyncCounters:
    """What the metrics report about the weight sync (rank 0)."""

    published: int = 0              # versions copied into the send buffer
    skipped_busy: int = 0           # publishes skipped: the previous version was still being transferred
    superseded: int = 0             # versions overwritten before any transfer of them started
    refused_nonfinite: int = 0      # publishes refused: NaN/inf in the weights
    relay_uploads: int = 0
    relay_superseded: int = 0       # relay uploads found done: this learner's newer version was there already
    served: int = 0                 # (member, version) transfers completed
    dropped: int = 0                # members dropped after a failed / timed-out transfer
    members: int = 0                # members holding a group now
    last_stall_s: float = 0.0       # the learner's time in the last publish (the copy)
    last_transfer_s: float = 0.0    # from "buffer holds version V" to its last transfer (relay or member) done
    group_bytes_sent: int = 0       # bytes broadcast through groups, all members and versions (CUDA IPC: none)


class SenderState(Protocol):
    """The sender as its members see it. Fields are read and written under :attr:`lock`."""

    cfg: WeightSyncConfig
    layout: Layout
    metadata: dict[str, str]        # each version's safetensors metadata (its kind; an adapter's scaling and base)
    buffer: torch.Tensor
    backend: str                    # "gloo" or "nccl": what the groups use
    sender_id: str
    counters: SyncCounters
    lock: threading.Condition
    stopping: threading.Event
    version: int | None             # the version the buffer holds (complete)
    checked: bool                   # ... and found finite: only then is it sent anywhere
    copying: bool                   # the learner writes the buffer now
    transfers: set[str]             # who reads the buffer now ("relay", "check" or member ids)
    version_sent: bool              # a transfer of the buffer's version started
    relay_version: int | None       # the relay's newest version

    @property
    def client(self) -> HubClient:
        """This thread's hub client."""

    def ipc_handle(self) -> dict:
        """The send buffer's CUDA IPC handle (JSON)."""

    def wait_buffer_ready(self) -> None:
        """Until the copy into the buffer has finished on its device."""

    def transfer_done(self, who: str) -> None:
        """``who`` no longer reads the buffer."""

    def served(self, member_id: str, version: int) -> None:
        """``member_id`` holds ``version`` now (counted, told to the hub)."""

    def member_state(self, member_id: str, state: str, *, reason: str | None = None,
                     version: int | None = None) -> None:
        """Tell the hub what became of a member."""

    def register(self) -> None:
        """Register the sender with the hub (again, once a restarted hub has forgotten it)."""

    def upload_relay(self, version: int) -> None:
        """Upload ``version`` from the buffer to the relay (the caller added "relay" to the transfers)."""
