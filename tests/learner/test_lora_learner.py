"""A LoRA learner end to end (`grpo learner` against a live hub): reference logprobs from the learner itself
(the hub loads no reference model), adapter-only publishes on the relay (learner.lora.publish: adapter, the
default) that a generator's base + adapter turns into the final folder's merged weights, a checkpoint that
`grpo export --merge` turns into those same weights, and a resume."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from deploy.cli import main as grpo
from shared.config.schema import GRPOConfig
from shared.protocol.client import HubClient
from shared.weight_sync.adapter import AdapterApplier
from tests.live_server import LiveServer

from .test_publish_resume import fill_hub, learner_config, run_learner


@pytest.mark.slow
def test_lora_learner_publishes_adapters_scores_its_own_reference_and_resumes(tiny_model_dir, tmp_path):
    lora = {"r": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "gate_proj"], "reference": "learner"}
    hub_config = GRPOConfig.model_validate({
        "algorithm": {"loss": {"beta": 0.04}}, "learner": {"lora": lora},
        "ref_server": {"model": None, "spool_dir": str(tmp_path / "spool"), "weights_dir": str(tmp_path / "weights"),
                       "max_long_poll_s": 5.0}})
    with LiveServer(hub_config) as live:
        assert live.state.scorer is None  # no reference model on the hub
        fill_hub(live.url, tiny_model_dir, 6)
        config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.04, max_steps=2, lr=5e-2,
                                checkpoint_every=1, lora=lora)
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "LoRA rank 4" in result.stderr
        client = HubClient(live.url)
        assert client.weights_version() == 2
        adapter = client.download_weights(2, tmp_path / "v2.safetensors")
        assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in load_file(str(adapter)))
        final = load_file(str(tmp_path / "final" / "model.safetensors"))
        generator = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        AdapterApplier(generator, tiny_model_dir).apply(adapter)  # what the transformers engine does with it
        published = {n: p.detach() for n, p in generator.named_parameters() if n in final}
        assert set(published) == set(final) and not any("lora" in n or "base_layer" in n for n in published)
        assert all(torch.equal(published[n], final[n]) for n in final)
        base = load_file(str(tiny_model_dir / "model.safetensors"))
        changed = {n for n in base if n in published and not torch.equal(base[n], published[n])}
        assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight", "gate_proj.weight")) for n in changed)
        metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        # step 1: a fresh adapter is a no-op, policy == reference; step 2: the policy moved away from it
        assert metrics[0]["kl_mean"] == pytest.approx(0.0, abs=1e-6) and metrics[1]["kl_mean"] > 1e-7

        # the checkpoint's adapter, merged by grpo export, is what the relay got
        assert grpo(["export", "--merge", str(tmp_path / "ckpt" / "step00000002"), str(tmp_path / "merged")]) == 0
        merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
        for name, value in published.items():
            torch.testing.assert_close(merged[name], value, atol=1e-6, rtol=0)

        more = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.04, max_steps=3, lr=5e-2,
                              checkpoint_every=1, lora=lora)
        result = run_learner(more, "--resume")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "resumed from step00000002 (step 2, version 2)" in result.stderr
        assert client.weights_version() == 3
