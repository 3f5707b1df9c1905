"""The receiving end of one group, for any engine: the transformers engine runs it in the generator process, the
vLLM worker extension in each worker. What to do with the tensors is the caller's ``apply``.

Each :meth:`GroupReceiver.receive` first asks the learner for the version (its first worker sets the next
:func:`groups.request_key` in the learner's store), then takes it: the learner serves only receivers that asked, at
once, so a receiver's time in the receive is the transfer itself.

A transfer is all or nothing for the protocol: whatever ``apply`` does (a shape that does not fit, a layout that
differs from the sender's), the receiver still takes every bucket and then answers the completion step with
"refused", so the learner's sender never waits on a receiver that gave up half-way. Its weights may then be
mixed: :class:`TransferRefused` says so, and the generator reloads a whole version over HTTP.

What a version holds is in its header: the whole policy (handed to ``apply`` bucket by bucket, e.g. into the
module's parameters) or, with ``learner.lora.publish: adapter``, only the LoRA matrices: those are collected (the
adapter is small) and handed whole, with the header's scaling and the learner's base fingerprint from the offer, to
``apply_adapter`` (the transformers engine's :meth:`shared.weight_sync.adapter.AdapterApplier.apply_tensors`). A
version of the other kind than the layout the member joined on is refused, never copied.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch

from shared.weight_sync import groups
from shared.weight_sync.layout import BASE_SAMPLES_KEY, KIND_ADAPTER, BucketUnpacker, Layout, bucket_ranges

log = logging.getLogger("grpo.weight_sync.receiver")
Apply = Callable[[Iterator[tuple[str, torch.Tensor]]], None]
# an adapter version: (its tensors by name, its scaling, the learner's base fingerprint JSON or None)
ApplyAdapter = Callable[[dict[str, torch.Tensor], float, "str | None"], object]


class TransferRefused(RuntimeError):
    """This receiver could not apply the version (its weights may be partly updated)."""


class GroupReceiver:
    """Rank ``rank`` of a group the learner formed; ``device`` is where received tensors land."""

    def __init__(self, offer: dict, rank: int, device: torch.device, group=None) -> None:
        self.offer, self.rank, self.device = offer, rank, device
        self.layout = Layout.from_json(offer["layout"])
        self.kind = self.layout.kind       # what this member joined on: every version must be of this kind
        self.metadata = dict(offer.get("metadata") or {})  # the versions' safetensors metadata (adapter: base check)
        self.bytes_received = 0            # broadcast bytes taken, all versions (CUDA IPC: none)
        self.timeout_s = float(offer["timeout_s"])
        self.via_ipc = offer["transport"] == "ipc"
        self.group = group
        self.store = None  # ours to release after the group when we built the group
        if self.group is None:
            self.store = groups.join_store(offer["host"], offer["port"], offer["world_size"], self.timeout_s)
            self.group = groups.build_group(self.store, offer["group_id"], rank, offer["world_size"],
                                            offer["backend"], self.timeout_s)
        self.asks = rank == offer.get("first_rank", 1)  # one worker per engine asks for each version
        self.request_store = self.store   # a group built elsewhere (vLLM's helper): a client of our own, lazily
        self.requests = 0                 # versions asked for over this group
        self.fingerprint = self.layout.fingerprint()
        # an engine with one worker knows the group's verdict without waiting for it (the learner's part is
        # always "applied"): its completion step finishes in the background, settled before the next use
        self.sole_worker = offer["world_size"] == 2
        self.unsettled = None             # (flag, work) of a completion step still running
        self.wire_device = device if offer["backend"] == "nccl" else torch.device("cpu")
        self.shared: torch.Tensor | None = None
        if self.via_ipc:
            from shared.weight_sync.ipc import open_handle

            self.shared = open_handle(offer["ipc_handle"])
        self.buffers: list[torch.Tensor] | None = None  # two buckets' worth, allocated at the first transfer

    def receive(self, apply: Apply, apply_adapter: ApplyAdapter | None = None) -> int:
        """One version: ask for it, then header, buckets (or the IPC buffer), completion. Returns the version.
        A full version goes to ``apply``, an adapter version to ``apply_adapter`` (None: this engine cannot take
        adapters over a group, and the version is refused)."""
        self._settle()
        self._ask()
        header_tensor = torch.zeros(groups.HEADER_LEN, dtype=torch.int64, device=self.wire_device)
        groups.broadcast(self.group, header_tensor, self.timeout_s)
        header = groups.VersionHeader.from_tensor(header_tensor)
        problem = None
        if header.kind != self.kind:
            problem = (f"it holds {header.kind} weights and this member joined on a {self.kind} layout (the "
                       "learner's learner.lora.publish changed under it)")
        elif header.fingerprint != self.fingerprint or header.total_bytes != self.layout.total_bytes:
            problem = "the sender's layout differs from the one it offered"
        elif header.kind == KIND_ADAPTER and apply_adapter is None:
            problem = "it is a LoRA adapter (learner.lora.publish: adapter) and this engine cannot apply adapters"
        chunks = self._chunks(header)
        if problem is None:
            try:
                if header.kind == KIND_ADAPTER:
                    # whole before anything changes (the adapter is small); cloned out of the receive buffers
                    # (or the learner's mapped IPC buffer), which the next bucket / publish overwrites
                    tensors = {name: tensor.clone() for name, tensor in self._tensors(chunks)}
                    apply_adapter(tensors, header.scaling, self.metadata.get(BASE_SAMPLES_KEY))
                else:
                    apply(self._tensors(chunks))
            except (RuntimeError, ValueError, KeyError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
        for _ in chunks:  # drain what apply did not take: the sender's broadcasts must all complete
            pass
        if self.via_ipc and self.device.type == "cuda":
            # the copies out of the learner's mapped buffer are queued on our stream: "applied" must mean read,
            # or the learner's next publish could overwrite the buffer under them
            torch.cuda.synchronize(self.device)
        flag, work = groups.start_agreement(self.group, problem is None, self.wire_device)
        if self.sole_worker and problem is None:
            self.unsettled = (flag, work)  # the learner's answer is "applied": the engine may go on at once
            return header.version
        groups.finish(work, self.timeout_s)
        applied = bool(flag.item() == 1)
        if problem is not None:
            raise TransferRefused(f"version {header.version} refused: {problem}")
        if not applied:
            raise TransferRefused(f"version {header.version}: another worker of this engine refused it")
        return header.version

    def _settle(self) -> None:
        """Finish the previous version's completion step (long done in practice; a learner that died meanwhile
        fails this receive, like any other transfer error)."""
        if self.unsettled is not None:
            _, work = self.unsettled
            self.unsettled = None
            groups.finish(work, self.timeout_s)

    def _ask(self) -> None:
        """Tell the learner's thread for this group that we wait in the receive (it starts the transfer now)."""
        if not self.asks:
            return
        if self.request_store is None:
            self.request_store = groups.join_store(self.offer["host"], self.offer["port"], self.offer["world_size"],
                                                   self.timeout_s)
        self.requests += 1
        self.request_store.set(groups.request_key(self.requests), b"1")

    def _chunks(self, header: groups.VersionHeader) -> Iterator[tuple[int, torch.Tensor]]:
        """Buckets in order. Two receive buffers: the next bucket's receive is posted before the current one is
        handed out, so the learner sends it while this side copies the current one into the model."""
        ranges = bucket_ranges(header.total_bytes, header.bucket_bytes)
        if self.via_ipc:
            for begin, end in ranges:
                yield begin, self.shared[begin:end]
            return
        size = min(header.bucket_bytes, header.total_bytes)
        if self.buffers is None or self.buffers[0].numel() < size:
            self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.wire_device) for _ in range(2)]

        def start(index: int):
            begin, end = ranges[index]
            chunk = self.buffers[index % 2][:end - begin]
            return chunk, groups.start_broadcast(self.group, chunk)

        pending = start(0) if ranges else None
        for index, (begin, _) in enumerate(ranges):
            chunk, work = pending
            groups.finish(work, self.timeout_s)
            self.bytes_received += chunk.numel()
            pending = start(index + 1) if index + 1 < len(ranges) else None
            yield begin, chunk

    def _tensors(self, chunks: Iterator[tuple[int, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        unpacker = BucketUnpacker(self.layout)
        for begin, chunk in chunks:
            for name, tensor in unpacker.feed(begin, chunk):
                yield name, tensor.to(self.device) if tensor.device != self.device else tensor
            if unpacker.done:
                return

    def close(self) -> None:
        """Shut the group down and drop it, then the store, now (idempotent; bounded even with the learner gone,
        see :func:`groups.close_group`)."""
        try:
            self._settle()
        except RuntimeError as exc:  # the learner is gone: nothing left to agree with
            log.info("weight sync: the last completion step did not finish: %s", exc)
        group, self.group = self.group, None
        groups.close_group(group)
        del group
        self.store = self.request_store = None
        self.buffers = None


def copy_into_module(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Copy each named tensor into the parameter/buffer of that name (tied copies share storage)."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers()))
    count = 0
    with torch.no_grad():
        for name, tensor in tensors:
            target = state.get(name)
            if target is None:
                raise KeyError(f"tensor {name!r} is not in the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model has {tuple(target.shape)}")
            target.copy_(tensor)
            count += 1
    return count


def check_layout_fits(model: torch.nn.Module, layout: Layout, adapters=None) -> str | None:
    """Why ``layout`` cannot be loaded into ``model`` (unknown names, shapes, uncovered parameters), or None. An
    adapter layout is checked by the engine's ``adapters`` (:class:`shared.weight_sync.adapter.AdapterApplier`;
    None: the engine cannot apply adapters)."""
    if layout.kind == KIND_ADAPTER:
        if adapters is None:
            return "the learner publishes LoRA adapters (learner.lora.publish: adapter) and this engine cannot apply them"
        return adapters.layout_problem(layout)
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers()))
    covered = set()
    for spec in layout.tensors:
        target = state.get(spec.name)
        if target is None:
            return f"tensor {spec.name!r} is not in the model"
        if tuple(target.shape) != spec.shape:
            return f"{spec.name} has shape {spec.shape}, the model has {tuple(target.shape)}"
        covered.add(id(target))
    missing = [n for n, p in model.named_parameters() if id(p) not in covered]
    return f"no values for {missing[:5]}" if missing else None
