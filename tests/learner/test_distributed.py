import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .batches import sampled_groups

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def run(nproc, model_dir, groups_dir, out, micro, scale, *budget_and_packing):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", str(nproc),
                             str(ROOT / "tests/learner/dist_step.py"), str(model_dir), str(groups_dir), str(out),
                             str(micro), scale, *map(str, budget_and_packing)], capture_output=True, text=True,
                            timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), load_file(str(out / "params.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_two_ranks_equal_one_rank_with_two_accumulation_steps(tiny_model_dir, tmp_path, scale):
    """The ranks' rewards differ ([1,0,0],[0,.5,1] and [1,1,0],[.2,0,.9]), so with scale: batch a per-rank std
    would give other advantages than the global batch's: equality means the std was all-reduced."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0], [0.0, 0.5, 1.0], [1.0, 1.0, 0.0], [0.2, 0.0, 0.9]],
                            seed=7, max_tokens=8)
    groups_dir = tmp_path / "groups"
    groups_dir.mkdir()
    for i, group in enumerate(groups):
        (groups_dir / f"{i:02d}.group").write_bytes(group.to_bytes())
    two_ranks, params_2 = run(2, tiny_model_dir, groups_dir, tmp_path / "w2", micro=1, scale=scale)
    one_rank, params_1 = run(1, tiny_model_dir, groups_dir, tmp_path / "w1", micro=2, scale=scale)
    assert two_ranks["loss"] == pytest.approx(one_rank["loss"], rel=1e-5, abs=1e-7)
    assert two_ranks["loss_tokens"] == one_rank["loss_tokens"]
    moved = 0.0
    for name, value in params_1.items():
        torch.testing.assert_close(params_2[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, float((value - load_file(str(Path(tiny_model_dir) / "model.safetensors"))
                                  .get(name, value)).abs().max()))
    assert moved > 1e-4  # the step did change the parameters


@pytest.mark.slow
def test_token_budget_micro_batches_agree_across_ranks_and_match_one_rank(tiny_model_dir, tmp_path):
    """Rank 0's rows are long (11 tokens), rank 1's short (5): a 24-token budget needs 3 packed micro-batches on
    rank 0 and 2 on rank 1, so rank 1 must run 3 too (or the ranks' collectives would not pair up). The update
    equals one rank's with all groups in one padded micro-batch."""
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0], [0.0, 0.5, 1.0], [1.0, 1.0, 0.0], [0.2, 0.0, 0.9]],
                            seed=7, max_tokens=8)
    groups_dir = tmp_path / "groups"
    groups_dir.mkdir()
    for i, group in enumerate(groups):
        group.completion_lengths = torch.full_like(group.completion_lengths, 8 if i < 2 else 2)
        (groups_dir / f"{i:02d}.group").write_bytes(group.to_bytes())
    two_ranks, params_2 = run(2, tiny_model_dir, groups_dir, tmp_path / "w2", 1, "group", 24, "packed")
    one_rank, params_1 = run(1, tiny_model_dir, groups_dir, tmp_path / "w1", 1, "group")
    assert two_ranks["micro_batches_per_rank"] == [3, 3] and one_rank["micro_batches_per_rank"] == [1]
    assert two_ranks["loss"] == pytest.approx(one_rank["loss"], rel=1e-5, abs=1e-7)
    assert two_ranks["loss_tokens"] == one_rank["loss_tokens"] == 2 * 3 * 8 + 2 * 3 * 2
    for name, value in params_1.items():
        torch.testing.assert_close(params_2[name], value, atol=1e-6, rtol=1e-5, msg=name)
