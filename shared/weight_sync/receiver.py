"""The generator's side of the weight sync, for any engine: between engine calls, take the newest policy by the
best transport.

:meth:`WeightReceiver.sync` is called by the rollout loop between engine calls and returns the version now served
(or None when nothing changed). Transports (``weight_sync.transport``, see docs/weight-sync.md):

* ``http``: poll the relay's newest version, download it, check it holds only finite values, load it;
* ``collective`` / ``ipc``: join through the hub (the learner's sender must be registered), load the version the
  offer names over HTTP first (a late joiner starts from the current weights), connect the engine to the group,
  then, whenever the hub answers "receive", ask the learner for the version (through the group's store) and take
  it straight from the learner. ``auto`` asks for IPC when the engine is on the learner's GPU, for a group when
  both are on the same kind of device, else HTTP.

A receive that fails half-way leaves the weights partly updated: the receiver then reloads the relay's version
over HTTP before the next engine call and rejoins. Weights holding NaN/inf are never loaded from the relay: the
generator keeps serving its version and logs the refusal.

What an engine provides (``generator/engines/``): ``load_weights(path)``, ``name``, and to join a group
``connect_weight_group(offer)`` (the :class:`Offer` as its JSON dict: it crosses into vLLM's worker processes),
``receive_weight_version()``, ``disconnect_weight_group()``, optionally ``device_uuid()`` and
``weight_sync_workers``; the receiving end of a group is :mod:`shared.weight_sync.group_receiver`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from shared.config.schema.weight_sync import WeightSyncConfig
from shared.errors import ServiceError
from shared.protocol.client import HubClient, HubError, HubUnavailable
from shared.protocol.weight_sync_messages import JoinRequest, MemberPoll, Offer, SenderSummary

log = logging.getLogger("grpo.generator.weights")


class WeightSyncError(ServiceError):
    """The generator cannot get back to whole, consistent weights (nothing on the relay after a failed receive)."""


def nonfinite_tensor(path: str | Path) -> str | None:
    """The first tensor of a safetensors file holding NaN/inf (one tensor in memory at a time), or None."""
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():
            tensor = fh.get_tensor(name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return name
    return None


class WeightReceiver:
    def __init__(self, engine, client: HubClient, cfg: WeightSyncConfig, generator_id: str,
                 weights_dir: str | Path) -> None:
        self.engine, self.client, self.cfg = engine, client, cfg
        self.generator_id = generator_id
        self.weights_dir = Path(weights_dir)
        self.mode = "http" if cfg.transport == "http" else "join"   # join: try the hub's sender when it is there
        self.member_id: str | None = None
        self.transport: str | None = None
        self.inconsistent = False           # a receive failed half-way: reload a whole version before generating
        self.refused: set[int] = set()      # relay versions holding NaN/inf (never loaded)
        self.refused_nonfinite = 0
        self.failed_receives = 0
        self.last_load_s = 0.0
        self.connected = False              # the engine holds a group with the learner

    # -- the loop's entry point ----------------------------------------------------------------------------
    def sync(self, have: int) -> int | None:
        """Take a newer version if there is one; returns the version now served, or None if unchanged."""
        if self.mode == "http" or (self.member_id is None and not self._join()):
            return self._from_relay(have)
        answer = self.client.sync_poll(self.member_id, MemberPoll(version=have))
        action = answer.action
        if action == "connect":
            return self._connect(answer.offer, have)
        if action == "receive":
            return self._receive(have)
        if action == "rejoin":
            log.warning("weight sync: the hub sent us to rejoin (%s)", answer.reason)
            self._disconnect()
            return self._from_relay(have)
        if action == "wait":  # the sender has not answered the join yet: the relay may be ahead meanwhile
            return self._from_relay(have)
        return None

    def close(self) -> None:
        if self.member_id is not None:
            try:
                self.client.sync_leave(self.member_id)
            except (HubError, HubUnavailable) as exc:  # the hub forgot us or is gone: nothing left to leave
                log.info("weight sync: leave: %s", exc)
        self._disconnect()

    # -- joining ----------------------------------------------------------------------------------------------
    def choose_transport(self, sender: SenderSummary) -> tuple[str, str]:
        """(transport, why) for this engine and the registered sender."""
        requested = self.cfg.transport
        ours = getattr(self.engine, "device_uuid", lambda: None)()
        engine_backend = "nccl" if ours is not None else "gloo"
        if requested in ("auto", "ipc") and ours is not None and ours == sender.device_uuid:
            return "ipc", "the engine is on the learner's GPU"
        if requested == "ipc":
            return "http", "CUDA IPC needs the engine on the learner's GPU"
        if sender.backend != engine_backend:
            return "http", (f"the learner's groups use {sender.backend}, this engine needs {engine_backend} "
                            "(GPU and CPU do not mix)")
        return "collective", f"{engine_backend} group with the learner"

    def _join(self) -> bool:
        sender = self.client.sync_status().sender
        if sender is None:
            return False  # no sender yet (the learner starts after us, or publishes over HTTP only)
        transport, why = self.choose_transport(sender)
        if not hasattr(self.engine, "connect_weight_group"):
            transport, why = "http", f"the {self.engine.name} engine cannot join a group"
        try:
            self.member_id = self.client.sync_join(JoinRequest(
                generator_id=self.generator_id, transport=transport,
                workers=getattr(self.engine, "weight_sync_workers", 1),
                device_uuid=getattr(self.engine, "device_uuid", lambda: None)()))
        except HubError as exc:
            log.warning("weight sync: cannot join (%s); using the HTTP relay for now", exc.detail)
            return False
        self.transport = transport
        log.info("weight sync: joined as %s over %s (%s)", self.member_id, transport, why)
        if transport == "http":
            self.mode = "http"
        return transport != "http"

    def _connect(self, offer: Offer, have: int) -> int | None:
        """The late joiner's order: the offered relay version over HTTP, then the group."""
        loaded = None
        relay = offer.relay_version
        if relay is not None and (relay > have or self.inconsistent):
            loaded = self._load_relay_version(relay)
        if self.inconsistent:
            raise WeightSyncError("weights were partly updated by a failed transfer and the relay holds no "
                                  "version to reload")
        try:
            self.engine.connect_weight_group(offer.model_dump(mode="json"))
        except (RuntimeError, ValueError, ConnectionError, TimeoutError) as exc:
            log.warning("weight sync: cannot connect to the learner's group at %s (%s): using the HTTP relay",
                        offer.group_id, exc)
            self.close()
            self.mode = "http"
            return loaded
        self.connected = True
        log.info("weight sync: connected to %s (%s)", offer.group_id, offer.backend)
        return loaded

    def _disconnect(self) -> None:
        self.member_id = None
        self.connected = False
        if hasattr(self.engine, "disconnect_weight_group"):
            self.engine.disconnect_weight_group()

    # -- receiving ---------------------------------------------------------------------------------------------
    def _receive(self, have: int) -> int | None:
        started = time.perf_counter()
        try:
            version = self.engine.receive_weight_version()
        except (RuntimeError, ConnectionError, TimeoutError, ValueError) as exc:
            self.failed_receives += 1
            self.inconsistent = True
            log.warning("weight sync: receiving a new version failed (%s); reloading the relay's version, then "
                        "rejoining", exc)
            self._disconnect()
            loaded = self._from_relay(have, force=True)
            if self.inconsistent:
                raise WeightSyncError("weights were partly updated by a failed transfer and the relay holds no "
                                      "version to reload") from exc
            return loaded
        self.last_load_s = time.perf_counter() - started
        log.info("weight sync: version %d received in %.3fs", version, self.last_load_s)
        return version if version != have else None

    def _from_relay(self, have: int, force: bool = False) -> int | None:
        latest = self.client.weights_version()
        if latest is None or (latest <= have and not force) or latest in self.refused:
            return None
        return self._load_relay_version(latest)

    def _load_relay_version(self, version: int) -> int | None:
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        path = self.client.download_weights(version, self.weights_dir / f"v{version:010d}.safetensors")
        try:
            bad = nonfinite_tensor(path)
            if bad is not None:
                self.refused.add(version)
                self.refused_nonfinite += 1
                log.warning("weights version %d holds NaN/inf (tensor %s): not loaded, still serving the previous "
                            "weights", version, bad)
                return None
            started = time.perf_counter()
            self.engine.load_weights(path)
            self.last_load_s = time.perf_counter() - started
            self.inconsistent = False
        finally:
            for old in self.weights_dir.glob("v*.safetensors"):
                old.unlink(missing_ok=True)
        return version
