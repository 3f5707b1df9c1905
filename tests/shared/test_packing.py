"""Packed (padding-free) rows against padded ones on real transformers models, and token-budget splitting."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from ref_server.scoring.top_logprobs import sequence_top_logprobs
from shared.forward.logprobs import sequence_logprobs
from shared.forward.packing import (
    choose_layout,
    layout_costs,
    micro_batch_cost,
    pack_rows,
    split_by_token_budget,
    supports_packing,
)

VOCAB = 101
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _tiny(config_cls, attn="sdpa", seed=0):
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=8,
                        attn_implementation=attn)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _rows(seed=0):
    """Four rows of different lengths (prompt + completion 9, 20, 4, 14) right-padded to 20."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (4, 20), generator=gen)
    prompts, completions = torch.tensor([3, 6, 1, 5]), torch.tensor([6, 14, 3, 9])
    return ids, prompts, completions


def test_pack_rows_concatenates_rows_without_padding_and_restarts_positions():
    ids = torch.tensor([[1, 2, 3, 0], [4, 0, 0, 0], [5, 6, 7, 8]])
    packed = pack_rows(ids, torch.tensor([3, 1, 4]))
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.offsets.tolist() == [0, 3, 4]
    assert packed.index(torch.tensor([2, 0]), torch.tensor([3, 1])).tolist() == [7, 1]


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_and_padded_give_the_same_logprobs_entropy_and_gradients(config_cls, attn):
    model = _tiny(config_cls, attn)
    ids, prompts, completions = _rows()
    results = {}
    for layout in ("padded", "packed"):
        model.zero_grad()
        out = sequence_logprobs(model, ids, prompts, completions, temperature=0.8, with_entropy=True,
                                chunk_tokens=5, layout=layout)
        # a loss touching every token with different weights, so a misplaced row shows in the gradients
        weights = torch.linspace(0.5, 1.5, out.logprobs.numel()).view_as(out.logprobs)
        loss = -(out.logprobs * weights * out.mask).sum() / out.mask.sum() + 0.1 * out.entropy.sum()
        loss.backward()
        results[layout] = (out.logprobs.detach(), out.entropy.detach(), loss.detach(),
                           {n: p.grad.clone() for n, p in model.named_parameters()})
    (lp_a, ent_a, loss_a, grads_a), (lp_b, ent_b, loss_b, grads_b) = results["padded"], results["packed"]
    assert lp_a.shape == (4, 14) and (lp_a[lp_a != 0] < 0).all()
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=0)
    for name, grad in grads_a.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads_b[name], grad, atol=1e-5, rtol=0, msg=name)


def test_packed_top_logprobs_equal_padded():
    model = _tiny(Qwen2Config).eval()
    ids, prompts, completions = _rows(seed=1)
    padded = sequence_top_logprobs(model, ids, prompts, completions, k=4, layout="padded")
    packed = sequence_top_logprobs(model, ids, prompts, completions, k=4, layout="packed")
    torch.testing.assert_close(packed.logprobs, padded.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.top_logprobs, padded.top_logprobs, atol=1e-5, rtol=0)
    assert torch.equal(packed.top_ids, padded.top_ids)


def test_a_model_that_ignores_packed_positions_fails_the_probe_and_stays_padded(caplog):
    """A body that always builds a KV cache (as older models do) makes transformers skip the packed-sequence
    mask: the second copy of the probe row would attend to the first. The probe must see that and pad."""
    model = _tiny(LlamaConfig, seed=3).eval()
    forward = model.model.forward
    model.model.forward = lambda **kw: forward(**{**kw, "use_cache": True})
    ids, prompts, completions = _rows(seed=2)
    with caplog.at_level(logging.INFO, logger="grpo.packing"):
        assert not supports_packing(model)
        assert choose_layout(model, [9, 20, 4], "packed") == "padded"
    assert "NOT supported" in caplog.text
    with torch.no_grad():
        padded = sequence_logprobs(model, ids, prompts, completions, layout="padded").logprobs
        asked_packed = sequence_logprobs(model, ids, prompts, completions, layout="packed").logprobs
    torch.testing.assert_close(asked_packed, padded, atol=1e-6, rtol=0)
    assert supports_packing(_tiny(LlamaConfig, seed=3))


def test_layout_choice_follows_the_cost_estimate(caplog):
    caplog.set_level(logging.INFO, logger="grpo.packing")
    model = _tiny(LlamaConfig)
    # equal lengths or one row: nothing to remove
    assert choose_layout(model, [8, 8, 8], "auto") == "padded"
    assert choose_layout(model, [30], "packed") == "padded"
    assert choose_layout(model, [3, 40], "padded") == "padded"
    assert choose_layout(model, [3, 40], "packed") == "packed"
    # dense (SDPA) mask: packing pays for 3 short rows next to a long one, not for 64 rows of nearly one length
    costs = layout_costs(model, [4, 4, 4, 60])
    assert costs["packed"] < costs["padded"]
    assert choose_layout(model, [4, 4, 4, 60], "auto") == "packed"
    many = [60] * 63 + [59]
    assert layout_costs(model, many)["packed"] > layout_costs(model, many)["padded"]
    assert choose_layout(model, many, "auto") == "padded"
    # each layout logged once, however often it is chosen
    assert caplog.text.count("attention layout: padded") == 1 and caplog.text.count("attention layout: packed") == 1
    # with a variable-length kernel the packed attention is sum(l^2): never more than padded
    model.config._attn_implementation = "flash_attention_2"
    costs = layout_costs(model, many)
    assert costs["packed"] < costs["padded"]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [None, 1, 40, 100, 1000])
def test_token_budget_split_keeps_every_row_once_and_respects_the_budget(packed, budget):
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 60, (37,), generator=gen).tolist()
    parts = split_by_token_budget(lengths, budget, packed=packed)
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(len(lengths)))
    for part in parts:
        assert part == sorted(part)
        cost = micro_batch_cost([lengths[i] for i in part], packed)
        assert budget is None or cost <= budget or len(part) == 1, (part, cost)
    if budget is None:
        assert len(parts) == 1
    if budget == 1:
        assert len(parts) == len(lengths)  # every row is over budget: each alone
    if budget == 1000 and packed:
        assert len(parts) == -(-sum(lengths) // 1000)  # first-fit-decreasing reaches the bound here


def test_token_budget_split_into_at_least_or_exactly_n_parts():
    lengths = [10, 50, 20, 30, 40, 5]
    assert len(split_by_token_budget(lengths, 1000, packed=True)) == 1
    parts = split_by_token_budget(lengths, 1000, packed=True, min_parts=3)
    assert len(parts) == 3 and sorted(i for p in parts for i in p) == list(range(6))
    # halves balanced by tokens: 155 tokens over 3 parts, none above 80
    assert max(sum(lengths[i] for i in p) for p in parts) <= 80
    assert len(split_by_token_budget(lengths, 60, packed=True, parts=5)) == 5
    with pytest.raises(ValueError, match="more than the 2 asked for"):
        split_by_token_budget(lengths, 60, packed=True, parts=2)
    with pytest.raises(ValueError, match="cannot split 6 rows into 7"):
        split_by_token_budget(lengths, 60, packed=True, min_parts=7)
    assert micro_batch_cost([3, 7, 5], packed=True) == 15 and micro_batch_cost([3, 7, 5], packed=False) == 21


@CUDA
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_bf16_on_gpu_matches_padded(attn):
    """bf16 on the GPU: packed and padded differ only by bf16 rounding (tolerance 0.05 nats per token)."""
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation=attn)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids, prompts, completions = (t.cuda() for t in _rows())
    assert supports_packing(model)
    with torch.no_grad():
        padded = sequence_logprobs(model, ids, prompts, completions, layout="padded").logprobs
        packed = sequence_logprobs(model, ids, prompts, completions, layout="packed").logprobs
    torch.testing.assert_close(packed, padded, atol=0.05, rtol=0)
