"""One learner rank for test_collective_timeout.py (run as a script with RANK/WORLD_SIZE/MASTER_* set): it joins
the process group as the learner does (learner.engine.init_distributed with learner.collective_timeout_s), agrees
once with its peer as the learner does on each batch, then rank 1 stops dead (SIGSTOP: its sockets stay open and it
never answers, like a node that hangs or is cut off) and rank 0 agrees again. Rank 0 prints the wall-clock time at
which it started waiting, and exits as ``grpo learner`` does on a GrpoError: one line on stderr, its exit code."""

import os
import signal
import sys
import time
from pathlib import Path

import deepspeed  # noqa: F401 - imported before the ranks meet (imported_together)
import torch
import torch.distributed as dist

from learner.engine import collective_errors, init_distributed
from shared.errors import GrpoError


def agree(device: torch.device) -> None:
    """What learner.step.ranks_agree does on each batch (one all-reduce of a flag), without importing the learner's
    model stack: start-up stays a few seconds."""
    dist.all_reduce(torch.ones(1, device=device), op=dist.ReduceOp.MAX)


def imported_together(folder: Path, rank: int, world: int) -> None:
    """Both ranks have imported torch and DeepSpeed: they join within a moment of each other (rank 0 waits only
    collective_timeout_s for the others to connect, and imports on a loaded machine can take longer than that)."""
    (folder / f"imported-{rank}").touch()
    deadline = time.monotonic() + 300   # imports can take minutes on a loaded machine
    while not all((folder / f"imported-{r}").exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> int:
    timeout_s = float(sys.argv[1])
    imported_together(Path(sys.argv[2]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    device = torch.device("cpu")
    try:
        with collective_errors(timeout_s):
            init_distributed(device, rendezvous_timeout_s=30.0, collective_timeout_s=timeout_s)
            agree(device)
            if os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.5)   # the peer is stopped by now
            print(f"waiting since {time.time()}", flush=True)
            agree(device)
    except GrpoError as exc:
        print(f"grpo learner: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
