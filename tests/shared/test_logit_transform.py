"""The chunked logprobs apply each architecture's logit transform, found by probing the model: equal to the model's
own forward for every architecture that scales or soft-caps its logits (RecurrentGemma and Falcon-H1 were 10+ nats
off before the probe), and a model whose forward does something else is refused by name, at load too."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3Config,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
)

from ref_server.scoring.loading import load_reference_model
from ref_server.scoring.top_logprobs import sequence_top_logprobs
from shared.forward.logit_transform import (
    PROBE_TOKENS,
    LogitTransform,
    UnsupportedHeadError,
    candidate_transforms,
    final_logit_transform,
    probe_ids,
    probe_logit_transform,
)
from shared.forward.logprobs import naive_sequence_logprobs, sequence_logprobs

VOCAB = 97
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, head_dim=8)
# each architecture with the field its forward reads, set so that it matters
ARCHITECTURES = {
    "cohere": dict(logit_scale=3.0),
    "granite": dict(logits_scaling=0.25),
    "gemma2": dict(final_logit_softcapping=0.5, attn_logit_softcapping=None),
    "nanochat": dict(final_logit_softcapping=0.5),
    "recurrent_gemma": dict(logits_soft_cap=0.5, lru_width=32, attention_window_size=16,
                            block_types=["recurrent", "attention"]),
    "falcon_h1": dict(lm_head_multiplier=5.0, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                      mamba_n_groups=1),
    "llama": {},
}
WANT = {
    "cohere": LogitTransform(multiply=3.0),
    "granite": LogitTransform(divide=0.25),
    "gemma2": LogitTransform(softcap=0.5),
    "nanochat": LogitTransform(softcap=0.5),
    "recurrent_gemma": LogitTransform(softcap=0.5),
    "falcon_h1": LogitTransform(multiply=5.0),
    "llama": LogitTransform(),
}


def _scaled_head(model, factor=8.0):
    """Logits large enough that a soft cap or a scale changes every logprob by far more than rounding."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(factor)
    return model.eval()


def _tiny(arch, **extra):
    torch.manual_seed(0)
    return _scaled_head(AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**BASE, **extra})))


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (3, 14), generator=gen), torch.tensor([2, 5, 4]), torch.tensor([12, 6, 10])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_each_architecture_logprobs_equal_its_own_forward(arch):
    model = _tiny(arch, **ARCHITECTURES[arch])
    ids, prompts, completions = _batch()
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, chunk_tokens=5)
        want = naive_sequence_logprobs(model, ids, prompts, completions)
    torch.testing.assert_close(got.logprobs, want, atol=2e-5, rtol=0)
    assert probe_logit_transform(model) == WANT[arch]


@pytest.mark.parametrize("arch", ["recurrent_gemma", "falcon_h1"])
def test_the_fields_the_old_list_missed_change_the_logprobs_by_nats(arch):
    """Without their transform these two were off by 10+ nats: the identity is far from their forward."""
    model = _tiny(arch, **ARCHITECTURES[arch])
    ids, prompts, completions = _batch()
    with torch.no_grad():
        want = naive_sequence_logprobs(model, ids, prompts, completions)
        body, head = model.get_decoder(), model.get_output_embeddings()
        raw = torch.log_softmax(head(body(input_ids=ids).last_hidden_state).float(), -1)
        untransformed = raw[0, prompts[0] - 1:prompts[0] - 1 + completions[0]].gather(
            -1, ids[0, prompts[0]:prompts[0] + completions[0], None])[:, 0]
    assert float((untransformed - want[0, :completions[0]]).abs().max()) > 1.0


def test_top_logprobs_take_the_probed_transform():
    model = _tiny("falcon_h1", **ARCHITECTURES["falcon_h1"])
    ids, prompts, completions = _batch()
    with torch.no_grad():
        got = sequence_top_logprobs(model, ids, prompts, completions, k=3)
        full = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    for row in range(3):
        start, n = int(prompts[row]) - 1, int(completions[row]) + 1
        want = full[row, start:start + n].topk(3, dim=-1).values
        torch.testing.assert_close(got.top_logprobs[row, :n], want, atol=2e-5, rtol=0)


def test_a_wrapper_that_ignores_its_text_configs_soft_cap_is_not_given_one():
    """Gemma 3's multimodal wrapper does not soft-cap although its text config names a cap: the probe follows the
    forward, not the field."""
    text = Gemma3TextConfig(**BASE, final_logit_softcapping=0.5)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=VOCAB - 1, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)
    torch.manual_seed(0)
    model = _scaled_head(AutoModelForCausalLM.from_config(config))
    assert LogitTransform(softcap=0.5) in candidate_transforms(model)
    ids, prompts, completions = _batch()
    ids = ids.clamp(max=VOCAB - 4)   # no image tokens
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions)
        want = naive_sequence_logprobs(model, ids, prompts, completions)
    torch.testing.assert_close(got.logprobs, want, atol=2e-5, rtol=0)


def test_where_the_probe_cannot_tell_the_config_field_wins():
    """Logits far below the cap: soft-capped or not agree to rounding, and the config's cap is kept (it matters
    once training grows the logits)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma2", **BASE, **ARCHITECTURES["gemma2"]))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(1e-3)
    assert final_logit_transform(model.eval()) == LogitTransform(softcap=0.5)


def test_bfloat16_model_is_matched_within_its_rounding():
    model = _tiny("gemma2", **ARCHITECTURES["gemma2"]).to(torch.bfloat16)
    assert probe_logit_transform(model) == LogitTransform(softcap=0.5)


class _SecretConfig(LlamaConfig):
    model_type = "grpo_test_secretly_scaled"


class _SecretlyScaled(LlamaForCausalLM):
    """A forward that does what no config field says: what a model the project never saw may do."""

    config_class = _SecretConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3.0 + 1.0 * torch.arange(out.logits.shape[-1], dtype=out.logits.dtype) / 10
        return out


AutoConfig.register(_SecretConfig.model_type, _SecretConfig, exist_ok=True)
AutoModelForCausalLM.register(_SecretConfig, _SecretlyScaled, exist_ok=True)


class _Truncated(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits[..., :VOCAB - 5]
        return out


def _llama_like(cls, config_cls=LlamaConfig):
    torch.manual_seed(0)
    return _scaled_head(cls(config_cls(**BASE)))


def test_a_forward_no_candidate_reproduces_is_refused_by_name():
    model = _llama_like(_SecretlyScaled, _SecretConfig)
    with pytest.raises(UnsupportedHeadError, match=r"_SecretlyScaled \(grpo_test_secretly_scaled\).*not its LM head's output") as info:
        final_logit_transform(model)
    assert "tolerance" in str(info.value)
    ids, prompts, completions = _batch()
    with pytest.raises(UnsupportedHeadError):  # never a logprob that is not the model's own
        sequence_logprobs(model, ids, prompts, completions)


def test_a_forward_of_another_width_is_refused_naming_both_shapes():
    with pytest.raises(UnsupportedHeadError, match=rf"\({PROBE_TOKENS}, {VOCAB - 5}\).*\({PROBE_TOKENS}, {VOCAB}\)"):
        final_logit_transform(_llama_like(_Truncated))


def test_a_model_with_non_finite_logits_is_refused_as_such():
    model = _llama_like(LlamaForCausalLM)
    with torch.no_grad():
        model.get_output_embeddings().weight[3, 0] = float("nan")
    with pytest.raises(UnsupportedHeadError, match="not finite"):
        probe_logit_transform(model)


def test_probed_once_per_model():
    model = _tiny("cohere", **ARCHITECTURES["cohere"])
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    ids, prompts, completions = _batch()
    with torch.no_grad():
        for _ in range(3):
            sequence_logprobs(model, ids, prompts, completions)
    assert len(calls) == 1   # the probe's own forward; the logprobs run the body and head, never forward


def test_training_mode_is_kept_and_dropout_does_not_fool_the_probe():
    torch.manual_seed(0)
    model = _scaled_head(LlamaForCausalLM(LlamaConfig(**BASE, attention_dropout=0.5))).train()
    assert probe_logit_transform(model) == LogitTransform()
    assert model.training


def test_reference_loading_refuses_such_a_model_at_start(tmp_path):
    """The hub, a joined scorer and the teacher load through load_reference_model: the refusal is at start, by name
    (a UsageError: the CLI prints it without a traceback)."""
    _llama_like(_SecretlyScaled, _SecretConfig).save_pretrained(tmp_path / "secret")
    with pytest.raises(UnsupportedHeadError, match="_SecretlyScaled"):
        load_reference_model(str(tmp_path / "secret"), torch.device("cpu"), torch.float32)
    _llama_like(LlamaForCausalLM).save_pretrained(tmp_path / "plain")
    assert final_logit_transform(load_reference_model(str(tmp_path / "plain"), torch.device("cpu"),
                                                      torch.float32)) is None


@settings(max_examples=200, deadline=None)
@given(vocab=st.integers(1, 5000), data=st.data())
def test_probe_ids_are_distinct_in_range_and_avoid_named_ids(vocab, data):
    avoid = set(data.draw(st.lists(st.integers(0, vocab - 1), max_size=min(vocab, 30))))
    ids = probe_ids(vocab, avoid)
    assert len(ids) == len(set(ids)) == min(PROBE_TOKENS, vocab - len(avoid))
    assert all(0 <= i < vocab and i not in avoid for i in ids)
