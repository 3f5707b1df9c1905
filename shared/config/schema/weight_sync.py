"""The weight_sync section: how the learner's weights reach the generators (shared by both services)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.config.schema.base import StrictModel


class WeightSyncConfig(StrictModel):
    """Transport, bucket size and timeouts of the learner-to-generator weight sync (docs/weight-sync.md)."""

    transport: Literal["auto", "collective", "ipc", "http"] = Field(
        "auto", description="'auto': CUDA IPC when learner and generator share one GPU, a process group "
        "(NCCL on GPUs, gloo on CPUs) when both are on the same kind of device and can reach each other, the HTTP "
        "relay otherwise. 'collective' / 'ipc' ask for that transport (a generator that cannot use it falls back "
        "to HTTP and logs why); 'http': the relay only (the learner then opens no groups). A generator joining "
        "late always loads the current version over HTTP first.")
    bucket_mb: float = Field(256.0, gt=0, description="MiB per broadcast: parameters are packed into buckets of "
                             "this size (a larger tensor spans several); receivers hold one bucket at a time.")
    timeout_s: float = Field(30.0, gt=0, description="Per-operation timeout of a group: a generator that dies or "
                             "hangs mid-transfer costs the learner's sender at most this, then it is dropped and "
                             "counted.")
    join_timeout_s: float = Field(600.0, gt=0, description="How long the sender waits for a generator it offered "
                                  "a group to connect (it first loads the current version over HTTP).")
    member_idle_s: float = Field(900.0, gt=0, description="A generator that has not polled the hub for this long "
                                 "(it polls between engine calls) is dropped and counted: one that died between two "
                                 "transfers. Keep it above the longest engine call.")
    host: str = Field("127.0.0.1", description="Address the learner's rank 0 listens on for groups and announces "
                      "through the hub (set a reachable address when generators run on other hosts).")
    relay_every_versions: int | None = Field(
        None, ge=1, description="Put every this many versions on the HTTP relay also while every generator takes "
        "them over a group or CUDA IPC (the relay then gets a version only at a late join and at the end); the "
        "evaluator of eval.every_steps reads the relay. null: eval.every_steps when evaluation while training is on, "
        "else never.")
    relay_every_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="The same by time: the newest version onto the relay once this "
        "many seconds passed since the last relay upload. null: eval.every_minutes * 60 when that is set, else "
        "never.")
    poll_s: float = Field(1.0, gt=0, le=30, description="Long-poll wait of the sender's rendezvous requests "
                          "(it also wakes at once for a new version).")

    @property
    def bucket_bytes(self) -> int:
        return max(8, int(self.bucket_mb * 2**20) // 8 * 8)
