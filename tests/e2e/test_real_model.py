"""End to end on a real pretrained model: SmolLM2-135M-Instruct (49,152-token vocabulary, chat template) through
the ref server (reference logprobs), the transformers generator and the DeepSpeed learner, as real processes."""

import json
import math
import os
import time

import pytest
import torch
from safetensors.torch import load_file

from tests import service_forks as forks
from tests.e2e.test_run import GRPO, free_port, stray_processes


def real_model_config(tmp_path, model_dir, port):
    config = {
        "seed": 0,
        "algorithm": {"loss": {"beta": 0.04}},  # > 0: the ref server scores every completion at the real vocabulary
        "ref_server": {"model": str(model_dir), "port": port, "spool_dir": str(tmp_path / "spool"),
                       "weights_dir": str(tmp_path / "relay"), "queue_capacity": 4, "dtype": "float32",
                       "device": "cpu",
                       # groups of an older version are refused: once version 1 is out the generator must load it
                       # (it does while the second step trains, which itself uses a batch leased during the first)
                       "max_staleness": 0},
        "generator": {"model": str(model_dir), "engine": "transformers", "device": "cpu", "group_size": 4,
                      "prompts_per_batch": 2, "sampling": {"temperature": 0.7, "max_tokens": 8},
                      "dataset": {"kind": "arithmetic_words", "arithmetic": {"ops": ["+"]}},
                      "rewards": [{"name": "final_number"},
                                  {"name": "format", "label": "one_line", "weight": 0.2,
                                   "args": {"pattern": r"^[^\n]*?[0-9]\.?$", "match": 1.0, "mismatch": 0.0}}],
                      "weights_dir": str(tmp_path / "gen-weights")},
        "learner": {"model": str(model_dir), "groups_per_step": 2, "max_steps": 2, "lr": 1e-5, "device": "cpu",
                    "checkpoint_every": None, "checkpoint_dir": str(tmp_path / "ckpt"),
                    "output_dir": str(tmp_path / "final"), "metrics_jsonl": str(tmp_path / "metrics.jsonl"),
                    "tensorboard_dir": None, "batch_wait_s": 2.0},
        # the default: a gloo group between the learner and the generator (540 MB of fp32 weights per version)
        "weight_sync": {"transport": "auto"},
        "run": {"run_dir": str(tmp_path / "run"), "stop_grace_s": 20},
    }
    path = tmp_path / "real.yaml"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_learner_steps_on_smollm2(smollm2_dir, tmp_path):
    config = real_model_config(tmp_path, smollm2_dir, free_port())
    start = time.monotonic()
    result = forks.run([GRPO, "run", str(config)], capture_output=True, text=True, timeout=280,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-4000:]
    assert "[grpo run] the learner finished: stopping the other services" in result.stdout
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and metrics[-1]["version"] == 2
    first = metrics[0]
    assert first["staleness_max"] == 0
    # three implementations of the same logprob at V = 49,152 agree on the first step (same weights everywhere):
    # the generator's sampled-token logprobs vs the learner's chunked ones, the ref server's vs the learner's (KL)
    assert first["logprob_diff_max"] < 1e-3, first
    assert 0 <= first["kl_mean"] < 1e-4, first
    assert all(math.isfinite(m["loss"]) for m in metrics)
    assert {"reward/final_number", "reward/one_line"} <= set(first)
    assert first["completion_len_max"] <= 8 and first["loss_tokens"] > 0
    generator_log = (tmp_path / "run" / "logs" / "gen-0.log").read_text()
    assert "policy version 0 -> 1" in generator_log  # the relay's file, loaded by path into the engine
    assert metrics[1]["kl_mean"] > 0  # the reference stayed where it was while the policy moved
    # the learner wrote a model of the same shape that moved away from the start
    final, start_weights = load_file(str(tmp_path / "final" / "model.safetensors")), load_file(
        str(smollm2_dir + "/model.safetensors"))
    assert final["model.embed_tokens.weight"].shape == (49152, 576)
    moved = [k for k in start_weights if not torch.equal(final[k].float(), start_weights[k].float())]
    assert len(moved) > 100
    assert stray_processes(str(config)) == []
    print(f"two learner steps on SmolLM2 in {seconds:.0f} s")
