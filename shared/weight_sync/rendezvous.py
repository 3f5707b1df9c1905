"""The weight-sync rendezvous the hub brokers (see :mod:`shared.protocol.weight_sync_messages` for the sequence).

Plain Python and asyncio: the hub's routes (``ref_server/relay/routes.py``) call it. State lives on the server's
event loop (every endpoint is ``async`` and no method awaits between reading and writing it), so it needs no lock.
Long polls wait on an ``asyncio.Event`` that every change replaces. Bounded: at most ``max_members`` members; a
learner registering again (restart) sends every member back to rejoin, since their groups ended with the old
learner process.

Membership does not outlive the hub instance: member ids carry the instance (a hub restarted on the same spool starts
counting again, and ``m1-gen-0`` of the new hub must not be taken for the sender's link of the old one), and every
answer to the sender's long poll lists the members the hub holds for it (:attr:`SenderWork.members`), so the sender
drops the links of members the hub no longer knows (a hub restart, a member that left) instead of waiting on them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

from shared.protocol.weight_sync_messages import (
    JoinRequest,
    MemberAnswer,
    Offer,
    PendingJoin,
    SenderInfo,
    SenderWork,
)
from shared.weight_sync.layout import ADAPTER_SUFFIXES, KIND_ADAPTER, KIND_FULL

log = logging.getLogger("grpo.ref_server.weight_sync")


class RendezvousError(ValueError):
    """A request the rendezvous cannot honour (unknown member, no sender, too many members): HTTP 4xx."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Member:
    member_id: str
    request: JoinRequest
    sender_id: str | None
    state: str = "pending"            # pending -> offered -> active; dropped / left end it
    offer: Offer | None = None
    version: int = 0                  # what the generator last said it serves (or the sender last served it)
    reason: str | None = None
    last_seen: float = field(default_factory=time.monotonic)


class SyncRendezvous:
    def __init__(self, max_members: int = 256) -> None:
        self.max_members = max_members
        self.sender: SenderInfo | None = None
        self.sender_kind = KIND_FULL  # what the sender's versions hold (its layout's kind)
        self.announced: int | None = None
        self.members: dict[str, Member] = {}
        self.dropped_total = 0
        self._ids = itertools.count(1)
        self.instance = uuid.uuid4().hex[:8]   # in every member id: ids of another hub instance never collide
        self._changed: asyncio.Event | None = None

    # -- change notification --------------------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _notify(self) -> None:
        event, self._changed = self._event(), asyncio.Event()
        event.set()

    async def _wait(self, wait_s: float) -> None:
        if wait_s > 0:
            try:
                await asyncio.wait_for(self._event().wait(), wait_s)
            except TimeoutError:
                pass

    # -- the learner's side ---------------------------------------------------------------------------------
    def register_sender(self, info: SenderInfo) -> None:
        if self.sender is not None and self.sender.sender_id != info.sender_id:
            for member in self.members.values():
                if member.state in ("offered", "active"):
                    self._end(member, "dropped", "the learner restarted")
        self.sender, self.announced = info, None
        adapter = any(str(row[0]).endswith(ADAPTER_SUFFIXES) for row in info.layout)  # as Layout.kind
        self.sender_kind = KIND_ADAPTER if adapter else KIND_FULL
        log.info("weight-sync sender %s registered (%s at %s)", info.sender_id, info.backend, info.host)
        self._notify()

    def unregister_sender(self, sender_id: str) -> None:
        if self.sender is not None and self.sender.sender_id == sender_id:
            self.sender, self.announced = None, None
            for member in self.members.values():
                if member.state in ("pending", "offered", "active"):
                    self._end(member, "dropped", "the learner stopped")
            self._notify()

    def _require_sender(self, sender_id: str) -> SenderInfo:
        if self.sender is None or self.sender.sender_id != sender_id:
            raise RendezvousError(409, f"sender {sender_id!r} is not the registered weight-sync sender")
        return self.sender

    def announce(self, sender_id: str, version: int) -> None:
        self._require_sender(sender_id)
        if self.announced is not None and version <= self.announced:
            raise RendezvousError(409, f"version {version} is not newer than the announced version {self.announced}")
        self.announced = version
        self._notify()

    async def work(self, sender_id: str, wait_s: float) -> SenderWork:
        """What the sender has to do: join requests to answer and members that stopped polling. (Members waiting
        in the receive ask the sender's link directly, through their group's store: no hub round trip.)"""
        self._require_sender(sender_id)
        while True:
            joins = [PendingJoin(member_id=m.member_id, **m.request.model_dump()) for m in self.members.values()
                     if m.state == "pending" and m.sender_id == sender_id]
            now, idle_limit = time.monotonic(), self.sender.member_idle_s if self.sender is not None else None
            silent = [m.member_id for m in self.members.values() if m.state in ("offered", "active")
                      and idle_limit is not None and now - m.last_seen > idle_limit]
            if joins or silent or wait_s <= 0:
                http = sum(1 for m in self.members.values() if m.state == "active" and m.request.transport == "http")
                held = [m.member_id for m in self.members.values()
                        if m.sender_id == sender_id and m.state in ("pending", "offered", "active")]
                return SenderWork(joins=joins, silent=silent, http_members=http, members=held)
            started = time.monotonic()
            await self._wait(wait_s)
            wait_s -= time.monotonic() - started

    def offer(self, sender_id: str, offer: Offer) -> None:
        self._require_sender(sender_id)
        member = self._member(offer.member_id)
        if member.state != "pending":
            raise RendezvousError(409, f"member {offer.member_id} is {member.state}, not pending")
        member.state, member.offer = "offered", offer
        self._notify()

    def set_state(self, sender_id: str, member_id: str, state: str, reason: str | None, version: int | None) -> None:
        """``active`` (the group formed), ``served`` (it received ``version``) or ``dropped`` (with the reason)."""
        self._require_sender(sender_id)
        member = self._member(member_id)
        if state == "active":
            if member.state != "offered":
                raise RendezvousError(409, f"member {member_id} is {member.state}, not offered")
            member.state = "active"
        elif state == "served":
            member.version = max(member.version, version or 0)
        elif state == "dropped":
            self._end(member, "dropped", reason or "dropped by the learner")
        else:
            raise RendezvousError(400, f"unknown member state {state!r}")
        self._notify()

    # -- the generator's side -------------------------------------------------------------------------------
    def join(self, request: JoinRequest) -> str:
        if self.sender is None:
            raise RendezvousError(409, "no weight-sync sender is registered (the learner has not started, or "
                                  "publishes over HTTP only)")
        live = [m for m in self.members.values() if m.state in ("pending", "offered", "active")]
        if len(live) >= self.max_members:
            raise RendezvousError(429, f"{len(live)} weight-sync members already (limit {self.max_members})")
        self._forget_ended()
        member_id = f"m{next(self._ids)}.{self.instance}-{request.generator_id}"
        member = self.members[member_id] = Member(member_id, request, self.sender.sender_id)
        if request.transport == "http":
            member.state = "active"  # no group: it tells the sender to keep the relay current for it
        self._notify()
        return member_id

    async def poll(self, member_id: str, version: int, wait_s: float) -> MemberAnswer:
        """The generator's call between engine calls: what to do now (long-polls while there is nothing)."""
        deadline = time.monotonic() + wait_s
        while True:
            member = self.members.get(member_id)
            if member is None:
                return MemberAnswer(action="rejoin", reason=f"unknown member {member_id}")
            member.last_seen, member.version = time.monotonic(), max(member.version, version)
            answer = self._answer(member)
            remaining = deadline - time.monotonic()
            if answer.action not in ("wait", "idle") or remaining <= 0:
                return answer
            await self._wait(remaining)

    def _answer(self, member: Member) -> MemberAnswer:
        if member.state in ("dropped", "left"):
            return MemberAnswer(action="rejoin", reason=member.reason)
        if member.state == "pending":
            return MemberAnswer(action="wait", announced=self.announced)
        if member.state == "offered":
            return MemberAnswer(action="connect", announced=self.announced, offer=member.offer)
        if member.request.transport == "http":
            return MemberAnswer(action="idle", announced=self.announced)
        if self.announced is not None and self.announced > member.version:
            return MemberAnswer(action="receive", announced=self.announced)
        return MemberAnswer(action="idle", announced=self.announced)

    def leave(self, member_id: str) -> None:
        member = self._member(member_id)
        if member.state in ("pending", "offered", "active"):
            self._end(member, "left", "left")
        self._notify()

    # -- helpers --------------------------------------------------------------------------------------------
    def _member(self, member_id: str) -> Member:
        member = self.members.get(member_id)
        if member is None:
            raise RendezvousError(404, f"unknown weight-sync member {member_id!r}")
        return member

    def _end(self, member: Member, state: str, reason: str) -> None:
        if state == "dropped":
            self.dropped_total += 1
            log.warning("weight-sync member %s dropped: %s", member.member_id, reason)
        member.state, member.reason = state, reason

    def _forget_ended(self) -> None:
        """Keep ended members only while the live ones leave room (their state answers a late poll)."""
        ended = [k for k, m in self.members.items() if m.state in ("dropped", "left")]
        for key in ended[:max(0, len(self.members) - self.max_members)]:
            del self.members[key]

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for member in self.members.values():
            counts[member.state] = counts.get(member.state, 0) + 1
        return {"sender": None if self.sender is None else {
                    "sender_id": self.sender.sender_id, "backend": self.sender.backend, "host": self.sender.host,
                    "device_uuid": self.sender.device_uuid, "kind": self.sender_kind},
                "announced": self.announced, "members": counts, "dropped_total": self.dropped_total}
