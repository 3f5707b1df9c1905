"""The learner's side of a publish, on every rank: copy the policy into rank 0's send buffer and return.

:class:`WeightPublisher` copies every parameter into one flat send buffer on rank 0 (gathering ZeRO-3 partitions,
every rank taking part, one parameter at a time) and returns: the learner's stall per publish is that copy. Rank
0's :class:`shared.weight_sync.sender.WeightSender` then moves the buffer to the generators in the background.

What the buffer holds: the policy's tensors (LoRA layers merged, :func:`shared.weight_sync.params.policy_tensors`),
or with ``adapter_only`` (``learner.lora.publish: adapter``) only the LoRA matrices and their scaling
(:func:`shared.weight_sync.params.adapter_tensors`): generators already hold the base weights (their model folder is
``learner.model``) and apply each adapter version onto them. The buffer is then the adapter's size, and it travels
like full weights over every transport (relay, process groups, CUDA IPC), each version's header saying its kind.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist

from shared.config.schema.weight_sync import WeightSyncConfig
from shared.protocol.client import HubClient, HubError, HubUnavailable
from shared.weight_sync.layout import Layout
from shared.weight_sync.params import (
    adapted_base_weights,
    adapter_metadata,
    adapter_tensors,
    gathered,
    policy_tensors,
)
from shared.weight_sync.sender import WeightSender, WeightsRefusedError

log = logging.getLogger("grpo.learner.weight_sync")
_REFUSED = 2  # what rank 0 broadcasts instead of go (1) / skip (0) once the hub refused its weights


class WeightPublisher:
    """Every rank builds one; rank 0 holds the buffer and the sender. :meth:`publish` is collective."""

    def __init__(self, module: torch.nn.Module, client_factory: Callable[[], HubClient], cfg: WeightSyncConfig, *,
                 rank: int,
                 world: int, device: torch.device, relay_version: int | None, adapter_only: bool = False) -> None:
        self.module, self.cfg, self.rank, self.world, self.device = module, cfg, rank, world, device
        dtype = next(module.parameters()).dtype
        metadata: dict[str, str] = {}
        if adapter_only:  # only the adapters: generators hold the base
            self.tensors, scaling = adapter_tensors(module)
            # the base is frozen: its fingerprint, computed once, lets generators check they hold the same one
            metadata = adapter_metadata(scaling, adapted_base_weights(module))
        else:
            self.tensors = policy_tensors(module)  # LoRA layers merged: generators get plain weights
        self.layout = Layout.build([(t.name, t.shape) for t in self.tensors], dtype)
        self.sender: WeightSender | None = None
        self.last_copied: int | None = None
        if rank == 0:
            on_gpu = device.type == "cuda" and cfg.transport != "http"
            buffer = torch.empty(self.layout.total_bytes, dtype=torch.uint8, device=device if on_gpu else "cpu")
            buffer.zero_()  # touch every page now, not during the first publish (a stall of its own)
            self.sender = WeightSender(client_factory, cfg, self.layout, buffer, relay_version, metadata=metadata)

    def _agree(self, flag: bool | int) -> int:
        """Rank 0's decision, on every rank (the ZeRO-3 gather below is a collective)."""
        if self.world == 1:
            return int(flag)
        tensor = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())

    def publish(self, version: int) -> float:
        """Copy the weights into the send buffer as ``version`` (unless a transfer still reads it); the stall.

        Raises :class:`WeightsRefusedError` on every rank once the hub refused rank 0's weights."""
        started = time.perf_counter()
        refused = self.sender is not None and self.sender.error is not None
        go = self._agree(_REFUSED if refused else (self.sender.begin_copy() if self.sender is not None else False))
        if go == _REFUSED:
            raise (self.sender.error if self.sender is not None else
                   WeightsRefusedError("the hub refused the learner's weights (rank 0's log says why)"))
        if not go:
            return time.perf_counter() - started
        self._copy()
        stall = time.perf_counter() - started
        if self.sender is not None:
            self.sender.end_copy(version, stall)
            self.last_copied = version
        return stall

    @torch.no_grad()
    def _copy(self) -> None:
        """Copy every parameter into the buffer (gathering ZeRO-3 partitions; every rank takes part). The finite
        check runs in the sender's thread afterwards: it is not part of the learner's stall."""
        buffer = self.sender.buffer if self.sender is not None else None
        for spec, tensor in zip(self.layout.tensors, self.tensors):
            with gathered(tensor.params):
                if buffer is not None and spec.end > spec.begin:
                    buffer[spec.begin:spec.end].view(spec.torch_dtype).copy_(tensor.compute().reshape(-1),
                                                                             non_blocking=True)

    def finish(self, version: int, stopping: bool = False) -> None:
        """End of the run (collective): wait for transfers, publish ``version`` if it never made it into the
        buffer (a publish skipped while the sender was busy), and leave it on the relay. ``stopping`` (a stop
        was requested): hub requests are tried once, so a hub that is gone costs no retry budget."""
        if self.sender is not None and stopping:
            self.sender.abort_requests()
        wait_s = self.cfg.timeout_s * 4
        idle = self.sender.wait_idle(wait_s) if self.sender is not None else True
        if not idle:
            log.warning("weight sync: transfers still running after %.0fs at the end of the run", wait_s)
        owed = (self.sender is not None and idle and version > 0
                and (self.last_copied is None or self.last_copied < version))
        if self._agree(owed):
            self.publish(version)
            if self.sender is not None:
                self.sender.wait_idle(wait_s)
        if self.sender is not None:
            try:
                self.sender.upload_final()
            except (HubError, HubUnavailable) as exc:
                log.warning("weight sync: the last version is not on the relay: %s", exc)

    def metrics(self) -> dict[str, float]:
        if self.sender is None:
            return {}
        with self.sender.lock:
            return {f"weight_sync_{k}": float(v) for k, v in asdict(self.sender.counters).items()}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
