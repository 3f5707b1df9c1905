"""Two ranks (torchrun, gloo) with ``scale: batch``: the per-token advantages of each rank's share equal the
single-process advantages of the whole batch, i.e. the step rewards' std is taken over the global batch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .dist_advantages import CASES, advantages_by_case, step_groups

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.mark.slow
def test_two_ranks_batch_scale_equals_one_process_on_the_whole_batch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = tmp_path / "advantages.json"
    result = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2",
                             str(ROOT / "tests/learner/dist_advantages.py"), str(out)], capture_output=True, text=True,
                            timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    two_ranks = json.loads(out.read_text())
    groups, refs = step_groups()
    whole = advantages_by_case(groups, refs)
    alone = advantages_by_case(groups[:2], refs[:2])  # rank 0's share with its own std
    assert set(two_ranks) == {f"{s}-{k}" for s, k in CASES}
    for case, rows in whole.items():
        assert len(two_ranks[case]) == len(rows) == 12
        for got, want in zip(two_ranks[case], rows):
            assert got == pytest.approx(want, abs=1e-6), case
        # a per-rank std would have given other values: the equality above is the all-reduce's
        assert any(a != pytest.approx(b, abs=1e-3) for x, y in zip(alone[case], rows[:6]) for a, b in zip(x, y))
