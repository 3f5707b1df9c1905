"""LoRA on the learner (learner.lora): config errors, the optimizer holding only the adapters, frozen base weights,
merged policy tensors, the reference with adapters switched off."""

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from learner.engine import create_engine
from learner.lora import LoraSetupError, adapter_parameters, adapters_disabled, apply_lora
from learner.step import grpo_step, split_micro_batches
from shared.config.loader import load_config
from shared.config.schema import LearnerConfig, LossConfig
from shared.config.schema.learner import LoraConfig
from shared.errors import UsageError
from shared.forward.logprobs import naive_sequence_logprobs
from shared.weight_sync.params import iter_parameters, policy_tensors

from .batches import advantages_of, batch_of, sampled_groups

CPU = torch.device("cpu")


def load(model_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def lora_model(model_dir, **lora) -> torch.nn.Module:
    model = apply_lora(load(model_dir), LoraConfig(**lora))
    with torch.no_grad():  # peft starts B at zero (the adapter a no-op); a random B makes the merge checks bite
        for name, param in adapter_parameters(model):
            if ".lora_B." in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_rank_zero_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ValidationError, match="r\n.*greater than or equal to 1"):
        LearnerConfig(lora={"r": 0})
    config = tmp_path / "c.yaml"
    config.write_text("learner:\n  lora:\n    r: 0\n")
    with pytest.raises(UsageError, match=r"learner\.lora\.r"):
        load_config(config)
    config.write_text("learner:\n  lora:\n    rank: 8\n")
    with pytest.raises(UsageError, match=r"learner\.lora\.rank"):
        load_config(config)


def test_unknown_target_module_is_an_error_naming_the_key_and_the_layers(tiny_model_dir):
    with pytest.raises(LoraSetupError, match=r"learner\.lora\.target_modules: 'qproj' matches no module.*'q_proj'"):
        apply_lora(load(tiny_model_dir), LoraConfig(target_modules=["q_proj", "qproj"]))
    with pytest.raises(LoraSetupError, match="'norm' is not a linear layer"):
        apply_lora(load(tiny_model_dir), LoraConfig(target_modules=["norm"]))
    with pytest.raises(LoraSetupError, match="'lm_head' is the LM head"):
        apply_lora(load(tiny_model_dir), LoraConfig(target_modules=["lm_head"]))


def test_only_adapters_require_grad_and_a_fresh_adapter_changes_nothing(tiny_model_dir):
    base = load(tiny_model_dir)
    model = apply_lora(load(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    layers = sum(1 for name, _ in base.named_modules() if name.endswith(("q_proj", "v_proj")))
    assert len(trainable) == 2 * layers and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # B starts at zero: the merged policy is the base model, tensor for tensor, under the base model's names
    merged = dict(iter_parameters(model))
    assert list(merged) == [name for name, _ in base.named_parameters()]
    for name, param in base.named_parameters():
        assert torch.equal(merged[name], param.detach()), name


def test_merged_policy_tensors_give_the_lora_models_logprobs(tiny_model_dir):
    model = lora_model(tiny_model_dir, r=4, alpha=8.0, target_modules="all-linear")
    merged = load(tiny_model_dir)
    result = merged.load_state_dict(dict(iter_parameters(model)), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}  # tied to the embedding
    ids = torch.randint(3, 40, (3, 24), generator=torch.Generator().manual_seed(0))
    prompt, completion = torch.tensor([5, 8, 3]), torch.tensor([19, 16, 21])
    with torch.no_grad():
        ours = naive_sequence_logprobs(model, ids, prompt, completion)
        theirs = naive_sequence_logprobs(merged, ids, prompt, completion)
        base = naive_sequence_logprobs(load(tiny_model_dir), ids, prompt, completion)
        with adapters_disabled(model):
            reference = naive_sequence_logprobs(model, ids, prompt, completion)
    assert (ours - base).abs().max() > 1e-3  # the adapter does something
    assert (ours - theirs).abs().max() <= 1e-5
    assert torch.equal(reference, base)  # adapters off: exactly the base model
    assert [t.name for t in policy_tensors(model)] == [n for n, _ in merged.named_parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_lora_step_trains_only_the_adapter(distributed, tiny_model_dir, zero_stage):
    """The optimizer holds exactly the adapter parameters; after a step they moved and every base weight is
    bitwise what it was."""
    from shared.weight_sync.params import gathered

    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=1)
    batch = batch_of(groups)
    cfg = LearnerConfig(model=str(tiny_model_dir), tensorboard_dir=None, metrics_jsonl=None, lr=1e-2, grad_clip=0.0,
                        groups_per_step=2, zero_stage=zero_stage,
                        lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    base = {name: p.detach().clone() for name, p in load(tiny_model_dir).named_parameters()}
    engine = create_engine(cfg, load(tiny_model_dir), CPU)
    adapters = adapter_parameters(engine.module)
    optimized = [p for group in engine.optimizer.param_groups for p in group["params"]] if zero_stage == 0 else None
    if optimized is not None:
        assert {id(p) for p in optimized} == {id(p) for _, p in adapters}
    held = sum(p.numel() for p in optimized) if optimized is not None else sum(
        p.numel() for group in engine.optimizer.bit16_groups for p in group)
    assert held == sum(p.numel() for _, p in adapters) > 0

    def snapshot(named):
        out = {}
        for name, param in named:
            with gathered(param):
                out[name] = param.detach().clone()
        return out

    adapters_before = snapshot(adapters)
    micro = split_micro_batches(batch, advantages_of(batch), 1, False, CPU)
    outcome = grpo_step(engine, micro, LossConfig(beta=0.0), temperature=1.0, old_mode="behaviour", world_size=1,
                        log_entropy=False, chunk_tokens=None)
    assert outcome.finite
    adapters_after = snapshot(adapter_parameters(engine.module))
    moved = [n for n in adapters_before if not torch.equal(adapters_before[n], adapters_after[n])]
    assert moved and all(".lora_" in n for n in moved)
    frozen = snapshot((n, p) for n, p in engine.module.named_parameters() if not p.requires_grad)
    assert len(frozen) == len(base)
    for name, value in frozen.items():
        assert torch.equal(value, base[name.replace(".base_layer.", ".")]), name


def test_reference_in_the_learner_is_the_base_model(tiny_model_dir):
    """learner.lora.reference 'learner': the batch's reference logprobs from the LoRA model with its adapters off
    are the base model's (what the ref server scores), and the model is left as it was (adapters on, train mode)."""
    from learner.lora import reference_logprobs

    batch = batch_of(sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]], seed=3))
    batch.temperature = 0.7
    model = lora_model(tiny_model_dir, r=4, target_modules="all-linear").train()
    base = load(tiny_model_dir).eval()
    # small row chunks: the rows go through in several pieces, each cut to its own longest row
    ours = reference_logprobs(model, batch, CPU, row_tokens=3 * batch.input_ids.shape[1])
    assert ours.shape == batch.behaviour_logprobs.shape and ours.dtype == torch.float32
    with torch.no_grad():
        expected = naive_sequence_logprobs(base, batch.input_ids, batch.prompt_lengths, batch.completion_lengths,
                                           temperature=0.7)
        policy = naive_sequence_logprobs(model, batch.input_ids, batch.prompt_lengths, batch.completion_lengths,
                                         temperature=0.7)
    width = expected.shape[1]
    assert (ours[:, :width] - expected).abs().max() <= 1e-5
    assert not ours[:, width:].any()
    for row, length in enumerate(batch.completion_lengths.tolist()):
        assert not ours[row, length:].any()
    assert model.training and (policy - expected).abs().max() > 1e-3  # adapters back on


def test_ref_server_loads_no_reference_model_when_the_learner_scores_it(tmp_path, monkeypatch):
    from ref_server.server import ModelLoadError, build_state

    monkeypatch.chdir(tmp_path)  # its spool and weights folders
    from shared.config.schema import GRPOConfig

    config = GRPOConfig.model_validate({"algorithm": {"loss": {"beta": 0.04}},
                                        "learner": {"lora": {"reference": "learner"}}})
    state = build_state(config)  # no ref_server.model: fine, nothing to load
    assert state.scorer is None
    with pytest.raises(ModelLoadError, match="needs ref_server.model"):
        build_state(GRPOConfig.model_validate({"algorithm": {"loss": {"beta": 0.04}},
                                               "learner": {"lora": {"reference": "hub"}}}))
