"""End to end, process supervision (issue 23): `grpo run` on the tiny model with one reward per reasoning step from
the multi-step chain task; the per-token advantages the learner used (learner.advantages_jsonl) equal DeepSeekMath's
definition, recomputed here from the uploaded step rewards with plain Python (not the project's functions)."""

import json
import math
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from deploy.demo.tiny_model import build_tiny_model_dir
from generator.tasks.chain import ChainTask
from shared.config.schema import DemoConfig
from tests import service_forks as forks
from tests.e2e.test_run import free_port, stray_processes

GRPO = str(Path(sys.executable).parent / "grpo")
EPS = 1e-4
STEPS = 4


@pytest.fixture(scope="module")
def chain_model_dir(tmp_path_factory):
    """A tiny model warmed up briefly on the chain task: it writes lines of numbers, some right and some wrong, so
    groups carry step rewards that differ (an untrained model's lines would all score 0)."""
    path = tmp_path_factory.mktemp("chain") / "tiny-model"
    build_tiny_model_dir(path, task=ChainTask(num_operands=3), seed=0, warmup=DemoConfig(
        warmup_steps=150, batch_size=32, warmup_lr_ramp_steps=10, warmup_min_lr_ratio=0.1,
        warmup_target_accuracy=None, flawed_steps=0, flawed_target_accuracy=None, heldout_examples=10))
    return path


def write_config(tmp_path, model_dir, port):
    config = {
        "seed": 0,
        "algorithm": {"advantage": {"supervision": "process", "scale": "group", "eps": EPS},
                      "loss": {"beta": 0.0}},
        "ref_server": {"port": port, "spool_dir": str(tmp_path / "spool"), "weights_dir": str(tmp_path / "relay"),
                       "queue_capacity": 4},
        "generator": {"model": str(model_dir), "engine": "transformers", "group_size": 4, "prompts_per_batch": 2,
                      "sampling": {"max_tokens": 12, "temperature": 1.0},
                      "weights_dir": str(tmp_path / "gen-weights"),
                      "dataset": {"kind": "chain", "chain": {"num_operands": 3}},
                      "rewards": [{"name": "chain_steps"}], "step_rewards": {"outcome": "none"}},
        "learner": {"model": str(model_dir), "groups_per_step": 2, "max_steps": STEPS, "lr": 1e-3,
                    "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
                    "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None,
                    "advantages_jsonl": str(tmp_path / "advantages.jsonl"), "batch_wait_s": 2.0},
        "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))
    return path


def definition(rows: list[dict]) -> dict[int, list[float]]:
    """DeepSeekMath §4.1.3 by hand: per group, r~ = (r - mean R) / (std R + eps) over every step reward R of the
    group (unbiased std; 0 when R has < 2 values or all equal); A_t = sum of r~ over the steps ending at or after
    t; 0 past the last step."""
    groups = defaultdict(list)
    for row in rows:
        groups[row["group_index"]].append(row)
    advantages = {}
    for members in groups.values():
        rewards = [r for row in members for r in row["step_rewards"]]
        n = len(rewards)
        mean = sum(rewards) / n if n else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1)) if n > 1 else 0.0
        constant = n < 2 or max(rewards) == min(rewards)
        for row in members:
            normalised = [0.0 if constant else (r - mean) / (std + EPS) for r in row["step_rewards"]]
            advantages[row["row"]] = [sum(v for v, end in zip(normalised, row["step_ends"]) if end >= t)
                                      for t in range(row["completion_length"])]
    return advantages


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_run_with_step_rewards_uses_the_process_advantages(chain_model_dir, tmp_path):
    config = write_config(tmp_path, chain_model_dir, free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=800, env=env)
    assert result.returncode == 0, result.stdout[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(math.isfinite(m["loss"]) and "step_reward_mean" in m for m in metrics)

    records = [json.loads(line) for line in (tmp_path / "advantages.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and all(r["supervision"] == "process" for r in records)
    checked = nonzero = 0
    for record in records:
        expected = definition(record["rows"])
        for row in record["rows"]:
            ends, length = row["step_ends"], row["completion_length"]
            # one step per non-empty line: ends strictly increasing inside the completion, rewards 1 (right) or 0
            assert ends == sorted(set(ends)) and all(0 <= e < length for e in ends)
            assert set(row["step_rewards"]) <= {0.0, 1.0} and len(row["step_rewards"]) == len(ends)
            assert len(row["advantages"]) == length
            assert row["advantages"] == pytest.approx(expected[row["row"]], abs=2e-6)
            checked += length
            nonzero += sum(a != 0 for a in row["advantages"])
    # the run had a learning signal: some groups' step rewards differed, so some token advantages are not 0
    assert checked > 0 and nonzero > 0
    assert stray_processes(str(config)) == []
