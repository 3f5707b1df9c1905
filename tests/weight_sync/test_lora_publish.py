"""Adapter-only publishing (``learner.lora.publish: adapter``): the learner sends lora_A/lora_B and the scaling,
the relay checks them against the registered adapter layout, the transformers engine applies them onto its base
weights in place (never onto an already merged weight)."""

import json
import time

import pytest
import requests
import torch
from pydantic import ValidationError
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine, WeightLoadError
from learner.lora import adapter_parameters, apply_lora
from shared.config.schema import GRPOConfig, WeightSyncConfig
from shared.config.schema.learner import LoraConfig
from shared.forward.logprobs import naive_sequence_logprobs
from shared.protocol.client import LEARNER_SESSION_HEADER, HubClient, RetryPolicy
from shared.weight_sync.layout import Layout
from shared.weight_sync.params import (
    adapted_base_weights,
    adapter_metadata,
    adapter_tensors,
    iter_parameters,
    policy_tensors,
)
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def lora_model(model_dir, seed: int, r: int = 8, alpha: float = 24.0, targets=TARGETS) -> torch.nn.Module:
    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                       LoraConfig(r=r, alpha=alpha, target_modules=targets))
    randomize(model, seed)
    return model


def randomize(model, seed: int) -> None:
    """A trained-looking adapter (peft starts B at zero: a no-op adapter would make every check pass)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in adapter_parameters(model):
            param.normal_(0.0, 0.05, generator=generator)


def adapter_header(model, metadata=None) -> tuple[Layout, dict]:
    tensors, scaling = adapter_tensors(model)
    layout = Layout.build([(t.name, t.shape) for t in tensors], torch.float32)
    raw = layout.safetensors_header(adapter_metadata(scaling) if metadata is None else metadata)
    return layout, json.loads(raw[8:])


def write_adapter(model, path) -> None:
    """What the learner's publisher sends (its layout's bytes, header metadata included)."""
    tensors, scaling = adapter_tensors(model)
    save_file({t.name: t.compute().contiguous() for t in tensors}, str(path),
              metadata=adapter_metadata(scaling, adapted_base_weights(model)))


def logprobs(model) -> torch.Tensor:
    ids = torch.randint(3, 40, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return naive_sequence_logprobs(model, ids, torch.tensor([5, 8, 3]), torch.tensor([19, 16, 21]))


def test_the_adapter_layout_is_accepted_and_everything_else_refused(tiny_model_dir):
    model = lora_model(tiny_model_dir, seed=1)
    layout, header = adapter_header(model)
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(tuple(TARGETS)))
    assert layout.kind == "lora_adapter" and len(layout.tensors) == 2 * layers
    assert all(t.name.endswith((".lora_A.weight", ".lora_B.weight")) and ".default." not in t.name
               for t in layout.tensors)
    assert layout.mismatch(header) is None
    assert header["__metadata__"]["grpo_lora_scaling"] == "3.0"  # alpha / r = 24 / 8, exact
    # full weights (the merged policy), or an adapter file without its kind or scaling, do not pass
    full = Layout.build([(t.name, t.shape) for t in policy_tensors(model)], torch.float32)
    full_header = json.loads(full.safetensors_header({"grpo_version": "1"})[8:])
    assert full.kind == "full" and full.mismatch(full_header) is None
    assert "the file holds 'full' weights" in layout.mismatch(full_header)
    assert "the file holds 'lora_adapter' weights" in full.mismatch(header)
    assert "the file holds 'full' weights" in layout.mismatch(adapter_header(model, {})[1])
    no_scaling = adapter_header(model, {"grpo_weights": "lora_adapter"})[1]
    assert "needs its scaling (grpo_lora_scaling metadata), got None" in layout.mismatch(no_scaling)
    bad_scaling = adapter_header(model, {"grpo_weights": "lora_adapter", "grpo_lora_scaling": "nan"})[1]
    assert "scaling must be finite" in layout.mismatch(bad_scaling)
    # another rank: the shapes differ
    _, rank4 = adapter_header(lora_model(tiny_model_dir, seed=1, r=4, alpha=12.0))
    assert "has shape [4, " in layout.mismatch(rank4)


def test_adapter_publish_to_vllm_over_a_group_transport_is_a_config_error_naming_the_key():
    for transport in ("collective", "ipc"):  # the transformers engine takes adapters over groups and IPC
        assert GRPOConfig.model_validate({"learner": {"lora": {}}, "weight_sync": {"transport": transport}})
        with pytest.raises(ValidationError, match=r"learner\.lora\.publish: 'adapter' reaches generator\.engine "
                           r"'vllm' over the HTTP relay only; weight_sync\.transport '(collective|ipc)' needs"):
            GRPOConfig.model_validate({"learner": {"lora": {}}, "weight_sync": {"transport": transport},
                                       "generator": {"engine": "vllm"}})
        merged = GRPOConfig.model_validate({"learner": {"lora": {"publish": "merged"}},
                                            "weight_sync": {"transport": transport}})
        assert merged.learner.lora.publish == "merged"
    # the vllm engine serves adapters as LoRARequests (tests/vllm/test_lora_vllm.py) up to vLLM's largest rank
    assert GRPOConfig.model_validate({"learner": {"lora": {}}, "generator": {"engine": "vllm"}}).learner.lora.r == 16
    with pytest.raises(ValidationError, match=r"learner\.lora\.r: 600 is above the largest rank the vllm engine"):
        GRPOConfig.model_validate({"learner": {"lora": {"r": 600}}, "generator": {"engine": "vllm"}})
    assert GRPOConfig.model_validate({"learner": {"lora": {}}}).learner.lora.publish == "adapter"


def test_the_engine_applies_each_adapter_onto_the_base_never_onto_a_merged_weight(tiny_model_dir, tmp_path):
    engine = TransformersEngine(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    first, second = lora_model(tiny_model_dir, seed=1), lora_model(tiny_model_dir, seed=2)
    for version, learner in enumerate([first, second, first], start=1):  # back to the first: same weights again
        write_adapter(learner, tmp_path / f"v{version}.safetensors")
        engine.apply_adapter(tmp_path / f"v{version}.safetensors")
        merged = dict(iter_parameters(learner))
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, merged.get(name, base[name])), (version, name)
    # fewer layers adapted: the others go back to their base
    fewer = lora_model(tiny_model_dir, seed=3, targets=["q_proj"])
    write_adapter(fewer, tmp_path / "fewer.safetensors")
    engine.apply_adapter(tmp_path / "fewer.safetensors")
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, dict(iter_parameters(fewer))[name]), name
    # an adapter that does not fit changes nothing
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    wrong = lora_model(tiny_model_dir, seed=4)
    tensors, scaling = adapter_tensors(wrong)
    state = {t.name: t.compute().contiguous() for t in tensors}
    last = tensors[-1].name
    state[last] = state[last][:, :-1].contiguous()
    save_file(state, str(tmp_path / "wrong.safetensors"), metadata=adapter_metadata(scaling))
    with pytest.raises(WeightLoadError, match=r"lora_A \[8, \d+\] / lora_B \[\d+, 7\] do not fit"):
        engine.apply_adapter(tmp_path / "wrong.safetensors")
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_after_a_full_load_the_base_of_a_new_layer_comes_from_the_model_folder(tiny_model_dir, tmp_path):
    engine = TransformersEngine(tiny_model_dir)
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.5)
    save_file({n: p.detach().contiguous() for n, p in other.named_parameters() if n != "lm_head.weight"},
              str(tmp_path / "full.safetensors"))
    engine.load_weights(tmp_path / "full.safetensors")
    learner = lora_model(tiny_model_dir, seed=5)
    write_adapter(learner, tmp_path / "a.safetensors")
    engine.apply_adapter(tmp_path / "a.safetensors")
    merged = dict(iter_parameters(learner))
    adapted = {t.name.rsplit(".lora_", 1)[0] + ".weight" for t in adapter_tensors(learner)[0]}
    for name, param in engine.model.named_parameters():
        if name in adapted:  # base + B @ A, the base read again from the folder, not the loaded +0.5 weights
            assert torch.equal(param, merged[name]), name


def test_an_adapter_trained_on_another_base_is_refused_and_changes_nothing(tiny_model_dir, tmp_path):
    from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    other_dir = save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=2)), tokenizer, tmp_path / "other")
    engine = TransformersEngine(other_dir)  # generator.model is not learner.model
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    write_adapter(lora_model(tiny_model_dir, seed=6), tmp_path / "a.safetensors")
    with pytest.raises(WeightLoadError, match=r"trained on another base model: layer 'model\.layers\.0\.[a-z_.]+' "
                       r"of the learner's base holds \[.*\] where this generator's \(.*other\) holds \[.*\]; "
                       r"generator.model must be the folder of learner.model"):
        engine.apply_adapter(tmp_path / "a.safetensors")
    for name, param in engine.model.named_parameters():
        assert torch.equal(param, before[name]), name
    # the same base held in bfloat16 by the generator passes the check
    bf16 = TransformersEngine(tiny_model_dir, dtype=torch.bfloat16)
    bf16.apply_adapter(tmp_path / "a.safetensors")


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2))


def sync_until(receiver: WeightReceiver, have: int, version: int, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while have < version:
        assert time.monotonic() < deadline, f"stuck at version {have}"
        have = receiver.sync(have) or have
        time.sleep(0.02)
    return have


@pytest.mark.slow
def test_generators_serve_the_learners_lora_policy_from_adapter_publishes_over_the_relay(tiny_model_dir, tmp_path):
    learner = lora_model(tiny_model_dir, seed=11)
    with LiveServer(make_config(tmp_path)) as live:
        hub = client(live.url)
        # http: the relay only (tests/weight_sync/test_lora_groups.py: the same over a group)
        publisher = WeightPublisher(learner, lambda: hub, WeightSyncConfig(transport="http", poll_s=0.2), rank=0,
                                    world=1, device=torch.device("cpu"), relay_version=None, adapter_only=True)
        try:
            assert publisher.sender.groups_enabled is False
            hub.register_learner(0, 2, publisher.layout.to_json())
            engine = TransformersEngine(tiny_model_dir)
            receiver = WeightReceiver(engine, client(live.url), WeightSyncConfig(transport="auto"), "gen",
                                      tmp_path / "gen")
            have = 0
            for version in (1, 2, 3):
                if version > 1:
                    randomize(learner, seed=100 + version)  # the learner trained on
                assert publisher.sender.wait_idle(20)
                publisher.publish(version)
                assert publisher.sender.wait_idle(20)
                have = sync_until(receiver, have, version)
                sent = (tmp_path / "weights" / f"v{version:010d}.safetensors").stat().st_size
                full = sum(p.numel() * 4 for p in engine.model.parameters())
                assert publisher.layout.total_bytes < sent < publisher.layout.total_bytes + 2**16 < 0.2 * full
                assert (logprobs(engine.model) - logprobs(learner)).abs().max() <= 1e-5
            assert receiver.transport is None  # never joined a group
            # the relay refuses the full (merged) weights and a mislabelled adapter
            merged = {n: v.contiguous() for n, v in iter_parameters(learner)}
            save_file(merged, str(tmp_path / "merged.safetensors"), metadata={"grpo_version": "9"})
            headers = {"Content-Type": "application/octet-stream", LEARNER_SESSION_HEADER: hub.learner.id}
            answer = requests.put(f"{live.url}/v1/weights/4", data=(tmp_path / "merged.safetensors").read_bytes(),
                                  headers=headers, timeout=30)
            assert answer.status_code == 400
            assert "the file holds 'full' weights (grpo_weights metadata), the learner publishes lora_adapter" \
                in answer.json()["detail"]
            tensors, _ = adapter_tensors(learner)
            save_file({t.name: t.compute().contiguous() for t in tensors}, str(tmp_path / "plain.safetensors"))
            answer = requests.put(f"{live.url}/v1/weights/4", data=(tmp_path / "plain.safetensors").read_bytes(),
                                  headers=headers, timeout=30)
            assert answer.status_code == 400 and "holds 'full' weights" in answer.json()["detail"]
        finally:
            publisher.close()
