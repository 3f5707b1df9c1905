"""Two DeepSpeed ranks (gloo, torchrun) take the same step as one rank given all the groups.

Every case runs in one launch per world size (tests/learner/dist_step.py: a launch costs each rank ~10 s of CPU in
imports), shared by the tests below and by the pytest-xdist workers (``built_once``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import built_once

from .batches import sampled_groups

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
REWARDS = [[1.0, 0.0, 0.0], [0.0, 0.5, 1.0], [1.0, 1.0, 0.0], [0.2, 0.0, 0.9]]


def launch(nproc: int, model_dir: Path, cases: list[dict], cases_file: Path) -> None:
    cases_file.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", str(nproc),
                             str(ROOT / "tests/learner/dist_step.py"), str(model_dir), str(cases_file)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]


def write_groups(folder: Path, groups) -> Path:
    folder.mkdir()
    for i, group in enumerate(groups):
        (folder / f"{i:02d}.group").write_bytes(group.to_bytes())
    return folder


def case(name: str, groups: Path, out: Path, micro: int, scale: str, token_budget: int | None = None,
         packing: str = "padded") -> dict:
    return {"name": name, "groups": str(groups), "out": str(out / name), "micro": micro, "scale": scale,
            "token_budget": token_budget, "packing": packing}


@pytest.fixture(scope="session")
def steps(tmp_path_factory, tiny_model_dir) -> Path:
    """Each case's step on two ranks (``<case>-2``) and on one (``<case>-1``): folders of result.json and
    params.safetensors."""
    def build(folder: Path) -> Path:
        groups = sampled_groups(tiny_model_dir, REWARDS, seed=7, max_tokens=8)
        plain = write_groups(folder / "groups", groups)
        for i, group in enumerate(groups):  # rank 0's rows long (8 tokens), rank 1's short (2)
            group.completion_lengths = torch.full_like(group.completion_lengths, 8 if i < 2 else 2)
        uneven = write_groups(folder / "uneven", groups)
        two = [case("group-2", plain, folder, 1, "group"), case("batch-2", plain, folder, 1, "batch"),
               case("budget-2", uneven, folder, 1, "group", 24, "packed")]
        one = [case("group-1", plain, folder, 2, "group"), case("batch-1", plain, folder, 2, "batch"),
               case("budget-1", uneven, folder, 1, "group")]
        launch(2, tiny_model_dir, two, folder / "two.json")
        launch(1, tiny_model_dir, one, folder / "one.json")
        return folder

    return built_once(tmp_path_factory, "distributed-steps", build)


def result(steps: Path, name: str) -> tuple[dict, dict]:
    return (json.loads((steps / name / "result.json").read_text()),
            load_file(str(steps / name / "params.safetensors")))


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_two_ranks_equal_one_rank_with_two_accumulation_steps(steps, tiny_model_dir, scale):
    """The ranks' rewards differ ([1,0,0],[0,.5,1] and [1,1,0],[.2,0,.9]), so with scale: batch a per-rank std
    would give other advantages than the global batch's: equality means the std was all-reduced."""
    two_ranks, params_2 = result(steps, f"{scale}-2")
    one_rank, params_1 = result(steps, f"{scale}-1")
    assert two_ranks["loss"] == pytest.approx(one_rank["loss"], rel=1e-5, abs=1e-7)
    assert two_ranks["loss_tokens"] == one_rank["loss_tokens"]
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    moved = 0.0
    for name, value in params_1.items():
        torch.testing.assert_close(params_2[name], value, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, float((value - initial.get(name, value)).abs().max()))
    assert moved > 1e-4  # the step did change the parameters


@pytest.mark.slow
def test_the_two_scales_give_different_steps(steps):
    """With these rewards a per-group and a whole-batch std differ: the cases above test two different things."""
    per_group, per_batch = result(steps, "group-1")[1], result(steps, "batch-1")[1]
    assert max(float((per_group[name] - per_batch[name]).abs().max()) for name in per_group) > 1e-5


@pytest.mark.slow
def test_token_budget_micro_batches_agree_across_ranks_and_match_one_rank(steps):
    """Rank 0's rows are long (11 tokens), rank 1's short (5): a 24-token budget needs 3 packed micro-batches on
    rank 0 and 2 on rank 1, so rank 1 must run 3 too (or the ranks' collectives would not pair up). The update
    equals one rank's with all groups in one padded micro-batch."""
    two_ranks, params_2 = result(steps, "budget-2")
    one_rank, params_1 = result(steps, "budget-1")
    assert two_ranks["micro_batches_per_rank"] == [3, 3] and one_rank["micro_batches_per_rank"] == [1]
    assert two_ranks["loss"] == pytest.approx(one_rank["loss"], rel=1e-5, abs=1e-7)
    assert two_ranks["loss_tokens"] == one_rank["loss_tokens"] == 2 * 3 * 8 + 2 * 3 * 2
    for name, value in params_1.items():
        torch.testing.assert_close(params_2[name], value, atol=1e-6, rtol=1e-5, msg=name)
