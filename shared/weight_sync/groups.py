"""Process groups between the learner's rank 0 (group rank 0) and one generator's engine workers (ranks 1..N).

Built from a TCPStore (the learner hosts it on a port the OS picks) and a PrefixStore named after the store's
``tcp://host:port`` address, with the backend wrapped in a ``ProcessGroup`` and its sequence number exchanged
through the store: the construction of vLLM's ``stateless_init_torch_distributed_process_group`` (gloo) and of its
CUDA platform's ``stateless_init_device_torch_dist_pg`` (NCCL), so a vLLM worker calling vLLM's helper joins a
group the learner built with this module. The global default group (the learner's DeepSpeed world) is never
touched, and every operation is bounded by the group's timeout: a dead peer is an exception, never a hang.

A receiver asks for each version itself: entering the receive, its first worker sets the key
:func:`request_key` (n = 1, 2, ... per group) in the learner's store, where the learner's thread for that group
waits on it (the store's server wakes it in well under a millisecond, no hub round trip and no polling). The
learner therefore starts a transfer only for a receiver already waiting in it, and at once.

One version on the wire: a header ``int64[HEADER_LEN]`` broadcast from rank 0, the buckets (broadcasts from rank
0; none for CUDA IPC, where receivers read the shared buffer), then a completion all-reduce (MIN of each rank's
status: 1 applied, 0 refused) so the learner knows every worker holds the version before it reuses the buffer.
The header says what the version holds (:class:`VersionHeader` ``kind``: the whole policy, or only LoRA adapters
with their scaling, ``learner.lora.publish: adapter``), so a receiver never copies one kind as the other.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroup, TCPStore

from shared.weight_sync.layout import KIND_ADAPTER, KIND_FULL

log = logging.getLogger("grpo.weight_sync.groups")
HEADER_LEN = 8
MAGIC = 0x67727073  # "grps"
KIND_CODES = {KIND_FULL: 0, KIND_ADAPTER: 1}  # the header's kind field


@dataclass(frozen=True)
class VersionHeader:
    version: int
    total_bytes: int
    bucket_bytes: int
    fingerprint: int      # Layout.fingerprint(): both ends hold the same layout
    via_ipc: bool         # receivers read the CUDA IPC buffer instead of broadcast buckets
    kind: str = KIND_FULL  # what the version holds: the whole policy, or LoRA adapters only (layout.KIND_*)
    scaling: float = 0.0   # the adapters' alpha / r (kind lora_adapter), sent as its float64 bits: exact

    def to_tensor(self) -> torch.Tensor:
        scaling_bits = struct.unpack("<q", struct.pack("<d", float(self.scaling)))[0]
        return torch.tensor([MAGIC, self.version, self.total_bytes, self.bucket_bytes, self.fingerprint,
                             int(self.via_ipc), KIND_CODES[self.kind], scaling_bits], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> VersionHeader:
        magic, version, total, bucket, fingerprint, ipc, kind, scaling_bits = (int(v) for v in tensor.cpu().tolist())
        if magic != MAGIC:
            raise ConnectionError(f"weight-sync header has magic {magic:#x}, expected {MAGIC:#x}")
        kinds = {code: name for name, code in KIND_CODES.items()}
        if kind not in kinds:
            raise ConnectionError(f"weight-sync header has kind {kind}, expected one of {sorted(kinds)}")
        scaling = struct.unpack("<d", struct.pack("<q", scaling_bits))[0]
        return cls(version, total, bucket, fingerprint, bool(ipc), kinds[kind], scaling)


def request_key(n: int) -> str:
    """The store key a receiver sets to ask for its ``n``-th version (n >= 1) over this group."""
    return f"grpo-weight-sync/request/{n}"


def store_address(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def host_store(host: str, world_size: int, timeout_s: float) -> TCPStore:
    """The learner's side of a group's rendezvous: a TCPStore server on ``host`` and a free port (``store.port``);
    it does not wait for the workers (the group's construction does, bounded by the timeout)."""
    return TCPStore(host, 0, world_size, is_master=True, wait_for_workers=False,
                    timeout=timedelta(seconds=timeout_s))


def join_store(host: str, port: int, world_size: int, timeout_s: float) -> TCPStore:
    return TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def build_group(store: TCPStore, address: str, rank: int, world_size: int, backend: str,
                timeout_s: float) -> ProcessGroup:
    """A process group over ``store`` (blocks until all ``world_size`` ranks arrive, at most the timeout)."""
    prefix_store = PrefixStore(address, store)
    timeout = timedelta(seconds=timeout_s)
    group = ProcessGroup(prefix_store, rank, world_size)
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        backend_group = ProcessGroupGloo(prefix_store, rank, world_size, timeout)
        backend_type, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif backend == "nccl":
        from torch.distributed.distributed_c10d import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend_group = ProcessGroupNCCL(prefix_store, rank, world_size, options)
        backend_type, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        raise ValueError(f"weight-sync backend must be 'gloo' or 'nccl', got {backend!r}")
    group._set_default_backend(backend_type)
    backend_group._set_sequence_number_for_group()
    group._register_backend(device, backend_type, backend_group)
    return group


def close_group(group: ProcessGroup | None) -> None:
    """Shut a group's backend down now, in the calling thread: its connections closed and its worker threads
    joined. Callers then drop their last reference to the group (and after it to its store), so the C++ objects
    are destroyed here and not at interpreter exit, where a backend torn down with its threads still joinable ends
    the process in ``std::terminate`` (exit status -6) after the work is done. A peer that died may make the
    shutdown fail; ``abort`` then closes what is left without waiting for anyone."""
    if group is None:
        return
    try:
        group.shutdown()
    except RuntimeError as exc:  # the peer is gone: nothing left to shut down cleanly
        log.info("weight sync: group shutdown failed (%s); aborting it", exc)
        try:
            group.abort()
        except RuntimeError as abort_exc:
            log.info("weight sync: group abort failed too: %s", abort_exc)


def start_broadcast(group: ProcessGroup, tensor: torch.Tensor):
    """Start rank 0's ``tensor`` into everyone's ``tensor``; returns the work to :func:`finish` (receivers post
    the next bucket's receive this way while they apply the current one)."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


def finish(work, timeout_s: float) -> None:
    work.wait(timedelta(seconds=timeout_s))


def broadcast(group: ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Rank 0's ``tensor`` into everyone's ``tensor`` (in place), bounded by ``timeout_s``."""
    finish(start_broadcast(group, tensor), timeout_s)


def start_agreement(group: ProcessGroup, applied: bool, device: torch.device):
    """Start the completion step: (flag, work); once the work is finished, ``flag`` is 1 when every rank applied
    the version (MIN of 1/0 over the group)."""
    from torch.distributed import AllreduceOptions, ReduceOp

    flag = torch.tensor([1 if applied else 0], dtype=torch.int32, device=device)
    options = AllreduceOptions()
    options.reduceOp = ReduceOp.MIN
    return flag, group.allreduce([flag], options)


def agree_all_applied(group: ProcessGroup, applied: bool, device: torch.device, timeout_s: float) -> bool:
    """The completion step: True when every rank applied the version (MIN of 1/0 over the group)."""
    flag, work = start_agreement(group, applied, device)
    finish(work, timeout_s)
    return bool(flag.item() == 1)
