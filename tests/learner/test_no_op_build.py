"""A learner process group on the CPU builds no DeepSpeed C++ op: DeepSpeed would JIT-compile its shared-memory
all-reduce (~2 min of CPU on 2 cores, again whenever its compile command changes) that gloo training never uses."""

import os
import subprocess
import sys

import pytest

CHECK = """
import torch
from deepspeed.ops.op_builder.builder import OpBuilder

def refuse(self, *args, **kwargs):
    raise SystemExit(f"DeepSpeed tried to build or load the {self.name} op")

OpBuilder.load = OpBuilder.jit_load = refuse
from learner.engine import ensure_single_process_env, init_distributed
ensure_single_process_env()
init_distributed(torch.device("cpu"))
import deepspeed.comm.comm as ds_comm
print("shm op:", ds_comm.cdb.shm_comm_op, "world:", torch.distributed.get_world_size())
"""


@pytest.mark.slow
def test_a_cpu_process_group_builds_no_deepspeed_op(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "shm op: None world: 1" in out.stdout
    assert not (tmp_path / "extensions").exists()  # nothing compiled, not even a build folder
