"""The records the hub brokers between the learner's sender and the generators' receivers (JSON over HTTP).

The rendezvous, in order: the learner registers a :class:`SenderInfo`; a generator posts a :class:`JoinRequest`
and gets a member id; the sender picks the request up, makes sure the relay holds its newest version, opens a
group and posts an :class:`Offer` (address, port, ranks, group id, the relay version to load first); the
generator loads that version over HTTP, then connects. From then on the generator polls between engine calls;
when the sender has announced a newer version the hub answers "receive", and the generator enters the receive,
asking the sender's link for the version through the group's store (not through the hub: the transfer starts
within a millisecond). Nothing else passes between them outside the group and its store.

These are the JSON bodies of ``/v1/weights/sync/...``: the hub's routes validate them and
:class:`shared.protocol.client.HubClient` sends and returns them. Records the hub answers with or takes from the
learner's sender only (``SenderRef`` and its kin) accept unknown keys, as the routes always did; the others
forbid them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Transport = Literal["collective", "ipc", "http"]
Backend = Literal["gloo", "nccl"]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SenderInfo(_Record):
    sender_id: str = Field(min_length=1, max_length=200, description="Unique per learner process.")
    host: str = Field(min_length=1, max_length=255, description="Address generators connect to.")
    backend: Backend = Field(description="gloo (learner on CPU) or nccl (learner on GPU).")
    device_uuid: str | None = Field(None, max_length=100, description="The learner rank 0's GPU (IPC needs the "
                                    "same one).")
    layout: list[tuple[str, str, list[int]]] = Field(max_length=1_000_000, description="[name, dtype, shape] "
                                                     "of each published tensor, in buffer order.")
    bucket_bytes: int = Field(gt=0, description="Bytes per broadcast.")
    timeout_s: float = Field(gt=0, description="Per-operation timeout of the groups.")
    member_idle_s: float = Field(900.0, gt=0, description="A member silent this long is reported to the sender, "
                                 "which drops it (a generator that died between two transfers).")


class JoinRequest(_Record):
    generator_id: str = Field(min_length=1, max_length=200)
    transport: Transport = Field(description="What the generator asks for.")
    workers: int = Field(1, ge=1, le=1024, description="Engine workers taking part (vLLM tensor-parallel ranks).")
    device_uuid: str | None = Field(None, max_length=100, description="The generator's GPU (for IPC).")


class Offer(_Record):
    member_id: str
    group_id: str = Field(description="Names the group's store prefix: tcp://host:port.")
    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    first_rank: int = Field(1, description="The generator's worker i is rank first_rank + i; the learner is 0.")
    backend: Backend
    transport: Transport
    relay_version: int | None = Field(description="Load this version over HTTP before connecting.")
    bucket_bytes: int
    timeout_s: float
    ipc_handle: dict | None = Field(None, description="CUDA IPC handle of the send buffer (transport ipc).")
    layout: list[tuple[str, str, list[int]]] = Field(description="[name, dtype, shape] of each tensor, in buffer "
                                                     "order (Layout.to_json).")
    metadata: dict[str, str] | None = Field(None, description="The versions' safetensors metadata (what they hold: "
                                            "grpo_weights; for LoRA adapters their scaling and the learner's base "
                                            "fingerprint).")


class MemberPoll(_Record):
    version: int = Field(ge=0, description="The version the generator serves now.")
    wait_s: float = Field(0.0, ge=0, le=60, description="Long-poll while nothing is to be done.")


class MemberAnswer(_Record):
    action: Literal["wait", "connect", "receive", "rejoin", "idle"]
    announced: int | None = None
    offer: Offer | None = None
    reason: str | None = None


class PendingJoin(_Record):
    """A join request the sender has to answer (a :class:`JoinRequest` and the member id the hub gave it)."""

    member_id: str
    generator_id: str
    transport: Transport
    workers: int = 1
    device_uuid: str | None = None


class SenderWork(_Record):
    """The answer to the sender's long poll: what it has to do now."""

    joins: list[PendingJoin] = Field(description="Join requests to answer with an offer.")
    silent: list[str] = Field(description="Members that stopped polling: the sender drops them.")
    http_members: int = Field(description="Active members that take every version from the relay.")
    members: list[str] | None = Field(None, description="Every member the hub holds for this sender (pending, "
                                      "offered or active): the sender drops its links to any other (members of an "
                                      "earlier hub instance, members that left). None: the hub does not say.")


class SenderSummary(_Record):
    sender_id: str
    backend: Backend
    host: str
    device_uuid: str | None
    kind: Literal["full", "lora_adapter"] = Field("full", description="What the sender's versions hold (its "
                                                  "layout's kind): the whole policy or LoRA adapters only.")


class SyncStatus(_Record):
    """The rendezvous at a glance (``GET /v1/weights/sync``)."""

    sender: SenderSummary | None = Field(description="The registered sender, None before one registers.")
    announced: int | None = Field(description="The newest version the sender announced.")
    members: dict[str, int] = Field(description="Members per state.")
    dropped_total: int
    relay_version: int | None = Field(description="The relay's newest version.")


class SenderRef(BaseModel):
    sender_id: str = Field(min_length=1, max_length=200)


class Announcement(SenderRef):
    """The sender holds ``version`` in its buffer (members that poll are told to receive it)."""

    version: int = Field(ge=0, lt=10**10)


class OfferPost(SenderRef):
    offer: Offer


class MemberReport(SenderRef):
    """What the sender saw of a member: its group formed, it received ``version``, or it was dropped."""

    state: Literal["active", "served", "dropped"]
    reason: str | None = Field(None, max_length=2000)
    version: int | None = Field(None, ge=0, lt=10**10)
