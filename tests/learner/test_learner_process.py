"""`grpo learner` with process supervision and the KL in the reward, against a live hub with a reference model:
the advantages it logs (learner.advantages_jsonl) are the definition's, and the step-reward and KL-in-reward
metrics reach metrics.jsonl."""

import json

import pytest
import torch

from shared.grpo.advantages import process_advantages
from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config

from .batches import sampled_groups
from .test_publish_resume import run_learner


@pytest.mark.slow
def test_learner_trains_on_step_rewards_and_logs_the_advantages_it_used(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        client = HubClient(live.url)
        for i, group in enumerate(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=3,
                                                 max_tokens=6)):
            ends = [int(n) - 1 for n in group.completion_lengths]
            group.step_rewards = torch.tensor([1.0, 0.0 + i, 0.5, 2.0])
            group.step_index = torch.tensor([0, 0, 1, 2] if i == 0 else [0, 1, 1, 2])
            group.step_end = torch.tensor([0, ends[0], 1, ends[2]] if i == 0 else [ends[0], 0, ends[1], 1])
            client.upload_group(group)
        path = tmp_path / "learner.yaml"
        path.write_text(json.dumps({
            # kl.beta 0: the return to go of the placed step rewards is the process advantage itself
            "algorithm": {"advantage": {"supervision": "process", "eps": 1e-6},
                          "kl": {"in_reward": True, "beta": 0.0}},
            "learner": {"model": str(tiny_model_dir), "hub_url": live.url, "groups_per_step": 2, "lr": 1e-3,
                        "max_steps": 1, "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
                        "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None,
                        "batch_wait_s": 1.0, "advantages_jsonl": str(tmp_path / "advantages.jsonl")}}))
        result = run_learner(path)
        assert result.returncode == 0, result.stderr[-3000:]
    (record,) = [json.loads(line) for line in (tmp_path / "advantages.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["supervision"] == "process" and record["kl_in_reward"] is True
    rows = record["rows"]
    assert len(rows) == 6 and sorted(r["step_ends"] != [] for r in rows) == [True] * 6
    steps = [(i, e, r) for i, row in enumerate(rows) for e, r in zip(row["step_ends"], row["step_rewards"])]
    expected = process_advantages(torch.tensor([r for _, _, r in steps]), torch.tensor([i for i, _, _ in steps]),
                                  torch.tensor([e for _, e, _ in steps]),
                                  torch.tensor([r["group_index"] for r in rows]),
                                  torch.tensor([r["completion_length"] for r in rows]), scale="group", eps=1e-6)
    for row, want in zip(rows, expected.tolist()):
        assert row["advantages"] == pytest.approx(want[:row["completion_length"]], abs=2e-6)
    assert any(abs(a) > 0.1 for row in rows for a in row["advantages"])
    (metrics,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics["steps_per_completion"] == pytest.approx(8 / 6) and metrics["rows_without_steps_frac"] == 0.0
    assert metrics["step_reward_mean"] == pytest.approx((1 + 0 + 0.5 + 2 + 1 + 1 + 0.5 + 2) / 8)
    assert {"kl_reward_mean", "return_min", "return_max", "kl_mean"} <= set(metrics)
    assert metrics["return_min"] < 0 < metrics["return_max"]
