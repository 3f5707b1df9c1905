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
over HTTP before the next engine call and rejoins.

A version the generator was told about may be gone by the time it asks for it (the relay keeps only its newest
versions; a learner that registers again may leave the relay older than the version it announced, or a restarted
learner offers a version its relay never held). The generator never exits over it: it re-reads the hub's current
version and syncs to that, a bounded number of times per sync (``MAX_VANISHED``), counting each vanished version
(:attr:`WeightReceiver.vanished_versions`, and ``weight_versions_vanished`` in the generator's stats). A hub whose
learner moved back below the version the generator serves (its groups would be refused as newer than any the learner
published) is followed down to the relay's current version (counted in :attr:`WeightReceiver.moved_back`). Weights holding NaN/inf are never loaded from the relay: the
generator keeps serving its version and logs the refusal.

A relay version that is a LoRA adapter (``learner.lora.publish: adapter``; its safetensors metadata says so) goes to
the engine's ``apply_adapter(path)`` instead of ``load_weights``; an engine without it stops the generator with a
clear error (shared/weight_sync/adapter.py). Over a group (or CUDA IPC) an adapter version goes to the engine the
same way, through ``receive_weight_version``; an engine joins a group of an adapter-publishing learner only if it
says it applies them there (``weight_group_adapters = True``; the others take the relay).

What an engine provides (``generator/engines/``): ``load_weights(path)``, ``name``, and to join a group
``connect_weight_group(offer)`` (the :class:`Offer` as its JSON dict: it crosses into vLLM's worker processes),
``receive_weight_version()``, ``disconnect_weight_group()``, optionally ``device_uuid()`` and
``weight_sync_workers``; the receiving end of a group is :mod:`shared.weight_sync.group_receiver`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from shared.config.schema.weight_sync import WeightSyncConfig
from shared.protocol.client import HubClient, HubError, HubUnavailable
from shared.protocol.safetensors_header import DTYPES
from shared.protocol.weight_sync_messages import JoinRequest, MemberPoll, Offer, SenderSummary
from shared.weight_sync.download_dir import DownloadDir
from shared.weight_sync.engine_load import NonFiniteWeights, WeightSyncError, load_version_file
from shared.weight_sync.layout import KIND_ADAPTER
from shared.weight_sync.precision import file_dtype, rounding_note

log = logging.getLogger("grpo.generator.weights")
RELOAD_POLL_S = 1.0  # how often a generator holding partly updated weights asks the relay for a whole version
MAX_VANISHED = 3  # versions that vanish in a row within one sync before the generator keeps what it serves


class VersionGone(LookupError):
    """The relay does not hold the version asked for (404): it was pruned, or never there."""


class WeightReceiver:
    def __init__(self, engine, client: HubClient, cfg: WeightSyncConfig, generator_id: str,
                 weights_dir: str | Path, stats=None) -> None:
        """``stats``: the loop's :class:`generator.stats.LoopStats` (its ``weight_versions_vanished`` follows
        :attr:`vanished_versions`)."""
        self.engine, self.client, self.cfg = engine, client, cfg
        self.generator_id = generator_id
        self.downloads = DownloadDir(weights_dir)   # shared with the run's other generators: files of our own
        self.mode = "http" if cfg.transport == "http" else "join"   # join: try the hub's sender when it is there
        self.member_id: str | None = None
        self.transport: str | None = None
        self.inconsistent = False           # a receive failed half-way: reload a whole version before generating
        self.refused: set[int] = set()      # relay versions holding NaN/inf (never loaded)
        self.refused_nonfinite = 0
        self.failed_receives = 0
        self.vanished_versions = 0          # versions named by the hub that were gone when asked for
        self.moved_back = 0                 # times the hub's versions moved back below ours and we followed
        self.stats = stats
        self.last_load_s = 0.0
        self.connected = False              # the engine holds a group with the learner
        self.offer: Offer | None = None     # ... formed from this offer
        self.precision_checked = False      # compared the published dtype with the engine's (once)

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
        elif sender.kind == KIND_ADAPTER and not getattr(self.engine, "weight_group_adapters", False):
            # the hook: an engine that applies adapters received over a group sets weight_group_adapters
            transport, why = "http", (f"the learner publishes LoRA adapters and the {self.engine.name} engine takes "
                                      "them from the relay only")
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
        """The late joiner's order: the offered relay version over HTTP, then the group. The hub answers "connect"
        with the same offer until the learner's link reports the group formed, so a poll that comes before that
        report (a learner whose training thread holds the interpreter lock delays it) repeats an offer this engine
        already holds: it keeps its group. Joining the offer's store again would form nothing: the learner's rank
        builds its group once, and the store still holds that formation's addresses (gloo then waits out its
        connect timeout, five times ``weight_sync.timeout_s``, and the generator falls back to HTTP)."""
        if self.connected and offer == self.offer:
            return None
        loaded = None
        relay = offer.relay_version
        if relay is not None and (relay > have or self.inconsistent):
            try:
                loaded = self._load_relay_version(relay)
            except VersionGone:  # offered by a sender that believed the relay held it: take what it holds
                self._vanished(relay)
                loaded = self._from_relay(have, force=self.inconsistent)
        if self.inconsistent:
            loaded = self._reload_whole_version(have)
        try:
            self.engine.connect_weight_group(offer.model_dump(mode="json"))
        except (RuntimeError, ValueError, ConnectionError, TimeoutError) as exc:
            log.warning("weight sync: cannot connect to the learner's group at %s (%s): using the HTTP relay",
                        offer.group_id, exc)
            self.close()
            self.mode = "http"
            return loaded
        self.connected, self.offer = True, offer
        log.info("weight sync: connected to %s (%s)", offer.group_id, offer.backend)
        self._note_precision(DTYPES.get(offer.layout[0][1]) if offer.layout else None)
        return loaded

    def _note_precision(self, published) -> None:
        """Warn when this engine holds the weights in fewer bits than the learner publishes them in; checked once
        (a run publishes every version in one dtype)."""
        if self.precision_checked or published is None:
            return
        self.precision_checked = True
        note = rounding_note(published, getattr(self.engine, "weights_dtype", None))
        if note is not None:
            log.warning("weight sync: %s", note)

    def _disconnect(self) -> None:
        self.member_id = None
        self.connected, self.offer = False, None
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
            return self._reload_whole_version(have)
        self.last_load_s = time.perf_counter() - started
        log.info("weight sync: version %d received in %.3fs", version, self.last_load_s)
        return version if version != have else None

    def _reload_whole_version(self, have: int) -> int | None:
        """After a failed receive the engine holds partly updated weights: nothing may be sampled with them until a
        whole version is loaded. The relay's current version; while the relay holds none (a learner that sends
        through a group writes to the relay only at its start and for late joiners), wait for one: a learner that
        was killed mid-transfer publishes its restored weights there as soon as it is back. Gives up after the
        client's retry budget (generator.retry_max_s), as for an unreachable hub."""
        waited_since = time.monotonic()
        warned = False
        while True:
            loaded = self._from_relay(have, force=True)
            if not self.inconsistent:
                return loaded
            waited = time.monotonic() - waited_since
            if waited >= self.client.retry.max_retry_s:
                raise WeightSyncError(f"weights were partly updated by a failed transfer and the relay held no "
                                      f"version to reload for {waited:.0f}s (generator.retry_max_s)")
            if not warned:
                warned = True
                log.warning("weight sync: weights were partly updated by a failed transfer and the relay holds no "
                            "whole version yet: waiting for one (the learner publishes its weights there when it "
                            "is back), generating nothing meanwhile")
            time.sleep(RELOAD_POLL_S)

    def _from_relay(self, have: int, force: bool = False) -> int | None:
        """The relay's current version if it is newer than ``have`` (or ``force``, or the hub moved back below
        ``have``); a version that vanishes between the two requests sends us to read the current one again."""
        for _ in range(MAX_VANISHED):
            latest = self.client.weights_version()
            if latest is None or latest in self.refused:
                return None
            if latest < have and not force and not self._moved_back(have, latest):
                return None
            if latest == have and not force:
                return None
            try:
                return self._load_relay_version(latest)
            except VersionGone:
                self._vanished(latest)
        log.warning("weight sync: %d versions in a row vanished from the relay before they could be downloaded; "
                    "serving version %d until the next sync", MAX_VANISHED, have)
        return None

    def _moved_back(self, have: int, latest: int) -> bool:
        """Has the hub moved back below ``have`` (a learner that registered again at a lower version, a relay that
        lost its newer versions)? Then groups at ``have`` would be refused as newer than any version the learner
        published: follow it down to the relay's ``latest``. (A relay behind the learner's reports is normal when
        versions go through groups: only both behind ``have`` counts.)"""
        if self.client.hub_stats()["learner_version"] >= have:
            return False
        self.moved_back += 1
        log.warning("weight sync: the hub moved back below our version %d (the learner is at an earlier version, the "
                    "relay's newest is %d): loading %d", have, latest, latest)
        return True

    def _vanished(self, version: int) -> None:
        self.vanished_versions += 1
        if self.stats is not None:
            self.stats.weight_versions_vanished = self.vanished_versions
        log.warning("weight sync: version %d is no longer on the relay (pruned, or the learner restarted): "
                    "re-reading the hub's current version", version)

    def _load_relay_version(self, version: int) -> int | None:
        """Download and load ``version``; :class:`VersionGone` when the relay does not hold it."""
        try:
            path = self.client.download_weights(version, self.downloads.path_for(version))
        except HubError as exc:
            if exc.status != 404:
                raise
            raise VersionGone(str(exc.detail)) from None
        try:
            started = time.perf_counter()
            try:
                load_version_file(self.engine, path, version)
                if not self.precision_checked:
                    self._note_precision(file_dtype(path))
            except NonFiniteWeights as exc:
                self.refused.add(version)
                self.refused_nonfinite += 1
                log.warning("%s: not loaded, still serving the previous weights", exc)
                return None
            self.last_load_s = time.perf_counter() - started
            self.inconsistent = False
        finally:
            self.downloads.clear()   # the newest version is in the engine now: no file is kept
        return version
