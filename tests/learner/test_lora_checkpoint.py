"""A LoRA run's checkpoint holds the adapter (and its optimizer state), resumes to the same state, and
``grpo export --merge`` turns it into a plain Hugging Face folder with the learner's logprobs."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy.cli import main as grpo
from learner.checkpoint import load_latest, save_checkpoint
from learner.engine import create_engine
from learner.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_parameters
from learner.step import grpo_step, split_micro_batches
from shared.config.schema import LearnerConfig, LossConfig
from shared.config.schema.learner import LoraConfig
from shared.forward.logprobs import naive_sequence_logprobs

from .batches import advantages_of, batch_of, sampled_groups

CPU = torch.device("cpu")


def lora_engine(model_dir, zero_stage):
    cfg = LearnerConfig(model=str(model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=1e-2, grad_clip=0.0,
                        groups_per_step=2, zero_stage=zero_stage,
                        lora=LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "up_proj"]))
    return create_engine(cfg, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), CPU), cfg


def optimizer_state(engine) -> list[torch.Tensor]:
    state = engine.optimizer.state_dict()
    inner = state.get("base_optimizer_state", state.get("optimizer_state_dict", state))
    if isinstance(inner, dict) and "state" in inner:
        inner = inner["state"]
    if isinstance(inner, list):  # ZeRO-2: one state per flat group
        inner = dict(enumerate(inner))
    return [t for _, s in sorted(inner.items()) for _, t in sorted(s.items()) if isinstance(t, torch.Tensor)]


@pytest.mark.slow
def test_lora_checkpoint_resumes_and_exports_a_merged_folder(distributed, tiny_model_dir, tmp_path):
    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=2))
    engine, cfg = lora_engine(tiny_model_dir, zero_stage=2)
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    for _ in range(2):
        assert grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                         log_entropy=False, chunk_tokens=None).finite
    tag = save_checkpoint(engine, tmp_path / "ckpt", step=2, version=2, keep=2, rank=0, consumed=["g1"],
                          lora=cfg.lora, base_model=cfg.model)
    folder = tmp_path / "ckpt" / tag
    assert (folder / ADAPTER_WEIGHTS).is_file()
    assert json.loads((folder / ADAPTER_CONFIG).read_text())["r"] == 4
    # the DeepSpeed module file holds the adapter only: far smaller than the model
    model_bytes = sum(p.numel() * 4 for p in engine.module.parameters())
    module_file = next(folder.glob("mp_rank_00_model_states.pt"))
    assert module_file.stat().st_size < model_bytes / 4
    # no frozen parameter under any name, the tied lm_head.weight included (a model tied like SmolLM2)
    names = dict(engine.module.named_parameters(remove_duplicate=False))
    assert names["lm_head.weight"] is names["model.embed_tokens.weight"]
    saved = torch.load(module_file, map_location="cpu", weights_only=False)["module"]
    assert set(saved) == {n for n, p in names.items() if p.requires_grad} == {n for n, _ in adapter_parameters(
        engine.module)}
    adapter_bytes = sum(p.numel() * 4 for _, p in adapter_parameters(engine.module))
    tied_bytes = names["lm_head.weight"].numel() * 4
    # the module file: the adapter and ~24 kB of client state (RNG states); with the tied copy it was 66 kB more
    assert module_file.stat().st_size < adapter_bytes + 30_000 < adapter_bytes + tied_bytes
    # the tag folder: the adapter twice (DeepSpeed's file, peft's), fp32 master and two Adam moments, bookkeeping
    folder_bytes = sum(f.stat().st_size for f in folder.iterdir())
    assert folder_bytes < 5 * adapter_bytes + 50_000 < 5 * adapter_bytes + tied_bytes

    trained = {n: p.detach().clone() for n, p in adapter_parameters(engine.module)}
    state = optimizer_state(engine)
    resumed, _ = lora_engine(tiny_model_dir, zero_stage=2)
    assert not all(torch.equal(trained[n], p) for n, p in adapter_parameters(resumed.module))
    client = load_latest(resumed, tmp_path / "ckpt")
    assert client["step"] == 2 and client["consumed"] == ["g1"]
    for name, param in adapter_parameters(resumed.module):
        assert torch.equal(param, trained[name]), name
    whole = dict(engine.module.named_parameters(remove_duplicate=False))  # the frozen ones from the base model
    assert all(torch.equal(p, whole[n]) for n, p in resumed.module.named_parameters(remove_duplicate=False))
    resumed_state = optimizer_state(resumed)
    assert len(resumed_state) == len(state) > 0
    assert all(torch.equal(a, b) for a, b in zip(state, resumed_state))

    # grpo export --merge: the merged folder scores like the learner's LoRA model (fp32)
    out = tmp_path / "merged"
    assert grpo(["export", "--merge", str(folder), str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any(".lora_" in n or "base_layer" in n for n, _ in merged.named_parameters())
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()
    with torch.no_grad():
        ours = naive_sequence_logprobs(engine.module, batch.input_ids, batch.prompt_lengths,
                                       batch.completion_lengths)
        theirs = naive_sequence_logprobs(merged, batch.input_ids, batch.prompt_lengths, batch.completion_lengths)
        base = naive_sequence_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                       batch.input_ids, batch.prompt_lengths, batch.completion_lengths)
    assert (ours - base).abs().max() > 1e-4  # two steps moved the policy
    assert (ours - theirs).abs().max() <= 1e-5


def test_export_of_a_folder_without_an_adapter_exits_2_with_one_line(tmp_path, capsys):
    assert grpo(["export", "--merge", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds no LoRA adapter" in err and len(err.splitlines()) == 1
    assert grpo(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "pass --merge" in capsys.readouterr().err
