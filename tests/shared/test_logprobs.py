import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from ref_server.scoring.top_logprobs import sequence_top_logprobs, top_logprobs_from_hidden
from shared.forward.logprobs import (
    DEFAULT_CHUNK_BYTES,
    GPU_CHUNK_BYTES,
    chunk_tokens_for,
    default_chunk_bytes,
    logprobs_from_hidden,
    naive_sequence_logprobs,
    sequence_logprobs,
)

VOCAB = 97


def _tiny(config_cls=LlamaConfig, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=8,
                        **extra)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny()


def _batch(seed=0, batch=4, seq=24):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
    prompts = torch.tensor([1, 5, 9, 3][:batch])
    completions = torch.tensor([23, 0, 10, 17][:batch])
    return ids, prompts, completions


@pytest.mark.parametrize("chunk_tokens", [1, 7, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_parity_with_naive_log_softmax(model, chunk_tokens, temperature):
    ids, prompts, completions = _batch()
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, temperature=temperature, chunk_tokens=chunk_tokens)
        want = naive_sequence_logprobs(model, ids, prompts, completions, temperature=temperature)
    assert got.logprobs.shape == (4, 23) and got.logprobs.dtype == torch.float32
    torch.testing.assert_close(got.logprobs, want, atol=1e-5, rtol=0)
    assert got.mask.sum().item() == 23 + 0 + 10 + 17
    assert (got.logprobs[~got.mask] == 0).all() and (got.logprobs[got.mask] < 0).all()


def test_values_are_the_models_next_token_logprobs(model):
    """Entry j of row i is log p(ids[i, P+j] | ids[i, :P+j]) from model(...).logits, checked position by position."""
    ids, prompts, completions = _batch(seed=3)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, temperature=0.5)
        for i in range(ids.shape[0]):
            for j in range(int(completions[i])):
                pos = int(prompts[i]) + j
                logits = model(ids[i:i + 1, :pos]).logits[0, -1] / 0.5
                expected = logits.log_softmax(-1)[ids[i, pos]]
                assert abs(got.logprobs[i, j].item() - expected.item()) < 1e-5


def test_padding_after_the_completion_does_not_change_values(model):
    ids, prompts, completions = _batch(seed=5, batch=2)
    with torch.no_grad():
        base = sequence_logprobs(model, ids[:, :12], prompts[:2], torch.tensor([11, 0]))
        padded = torch.cat([ids[:, :12], torch.zeros(2, 9, dtype=torch.long)], dim=1)
        wide = sequence_logprobs(model, padded, prompts[:2], torch.tensor([11, 0]))
    torch.testing.assert_close(wide.logprobs, base.logprobs, atol=1e-6, rtol=0)


def test_entropy_matches_full_distribution(model):
    ids, prompts, completions = _batch(seed=1)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, temperature=0.8, with_entropy=True, chunk_tokens=5)
        logits = model(ids).logits.float() / 0.8
    logp = logits.log_softmax(-1)
    full_entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
    for i in range(4):
        p, c = int(prompts[i]), int(completions[i])
        torch.testing.assert_close(got.entropy[i, :c], full_entropy[i, p - 1:p - 1 + c], atol=1e-5, rtol=0)
    assert (got.entropy[~got.mask] == 0).all()
    assert got.entropy[got.mask].max() <= torch.log(torch.tensor(float(VOCAB))) + 1e-5


def test_gradients_match_naive(model):
    ids, prompts, completions = _batch(seed=2)
    weights = torch.randn(4, 23, generator=torch.Generator().manual_seed(9))
    grads = []
    for fn in (lambda: sequence_logprobs(model, ids, prompts, completions, temperature=0.7, chunk_tokens=6).logprobs,
               lambda: naive_sequence_logprobs(model, ids, prompts, completions, temperature=0.7)):
        model.zero_grad()
        (fn() * weights).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for chunked, naive in zip(*grads):
        torch.testing.assert_close(chunked, naive, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True], ids=["fused-backward", "checkpointed"])
@pytest.mark.parametrize("temperature", [1.0, 0.9])
def test_logprobs_from_hidden_matches_log_softmax_and_entropy_gradient(bias, temperature):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = torch.randn(13, 16, requires_grad=True)
    targets = torch.randint(0, 50, (13,))
    weights = torch.randn(13, generator=torch.Generator().manual_seed(1))
    logp, ent = logprobs_from_hidden(hidden, head, targets, temperature=temperature, with_entropy=True,
                                     chunk_tokens=4)
    ((logp * weights).sum() + 0.3 * ent.sum()).backward()
    chunked_grads = [hidden.grad.clone(), head.weight.grad.clone()]
    hidden.grad = None
    head.weight.grad = None
    full = (head(hidden) / temperature).log_softmax(-1)
    ref_logp = full.gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    ((ref_logp * weights).sum() + 0.3 * ref_ent.sum()).backward()
    torch.testing.assert_close(chunked_grads[0], hidden.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunked_grads[1], head.weight.grad, atol=1e-5, rtol=1e-4)


def test_fused_path_gradient_without_entropy_and_only_weight_grad():
    torch.manual_seed(3)
    head = torch.nn.Linear(8, 30, bias=False)
    hidden = torch.randn(9, 8)  # no grad wanted for the input
    targets = torch.randint(0, 30, (9,))
    logp, ent = logprobs_from_hidden(hidden, head, targets, chunk_tokens=2)
    assert ent is None
    logp.sum().backward()
    fused = head.weight.grad.clone()
    head.weight.grad = None
    head(hidden).log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    torch.testing.assert_close(fused, head.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_other_architectures(arch):
    """Any AutoModelForCausalLM: Gemma 2 soft-caps its final logits inside forward(), which we must reproduce."""
    if arch == "qwen2":
        model = _tiny(Qwen2Config)
    else:
        model = _tiny(Gemma2Config, final_logit_softcapping=2.0, attn_logit_softcapping=None)
    ids, prompts, completions = _batch(seed=4)
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, chunk_tokens=5)
        want = naive_sequence_logprobs(model, ids, prompts, completions)
    torch.testing.assert_close(got.logprobs, want, atol=1e-5, rtol=0)


def test_rejects_bad_lengths_and_temperature(model):
    ids = torch.randint(0, VOCAB, (2, 8))
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(model, ids, torch.tensor([0, 2]), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="exceeds the sequence length"):
        sequence_logprobs(model, ids, torch.tensor([4, 2]), torch.tensor([5, 3]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        sequence_logprobs(model, ids, torch.tensor([4, 2]), torch.tensor([1, 3]), temperature=0.0)


def test_chunk_size_from_byte_budget():
    assert chunk_tokens_for(151936) == 220
    assert chunk_tokens_for(10**9) == 1
    assert default_chunk_bytes("cpu") == DEFAULT_CHUNK_BYTES == 128 * 2**20
    assert chunk_tokens_for(151936, device=torch.device("cpu")) == 220
    assert chunk_tokens_for(151936, 512 * 2**20) == 883


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
def test_gpu_chunks_are_bigger_where_memory_allows():
    free, _ = torch.cuda.mem_get_info()
    chunk_bytes = default_chunk_bytes("cuda")
    assert DEFAULT_CHUNK_BYTES <= chunk_bytes <= GPU_CHUNK_BYTES
    if free >= 32 * GPU_CHUNK_BYTES:
        assert chunk_bytes == GPU_CHUNK_BYTES and chunk_tokens_for(151936, device="cuda") == 883


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_bf16_head_gradients_match_autograd_in_bf16(device):
    """bf16 weights: the backward's matmuls run in bf16 (as autograd through the model's own head does) and the
    weight gradient is summed over chunks in fp32; against autograd of the plain bf16 expression."""
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(50, 32, generator=gen)).to(device, torch.bfloat16).requires_grad_()
    head = torch.nn.Linear(32, VOCAB, bias=False).to(device, torch.bfloat16)
    targets = torch.randint(0, VOCAB, (50,), generator=gen).to(device)
    weights = torch.rand(50, generator=gen).to(device)
    logp, entropy = logprobs_from_hidden(hidden, head, targets, temperature=0.7, with_entropy=True, chunk_tokens=16)
    ((logp * weights).sum() + 0.3 * entropy.sum()).backward()
    ours = hidden.grad.float().clone(), head.weight.grad.float().clone()
    assert head.weight.grad.dtype == torch.bfloat16
    hidden.grad, head.weight.grad = None, None
    full = (head(hidden).float() / 0.7).log_softmax(-1)
    want_logp = full.gather(-1, targets[:, None]).squeeze(-1)
    want_entropy = -(full.exp() * full).sum(-1)
    ((want_logp * weights).sum() + 0.3 * want_entropy.sum()).backward()
    torch.testing.assert_close(logp, want_logp.detach(), atol=1e-4, rtol=0)
    for got, want in zip(ours, (hidden.grad.float(), head.weight.grad.float())):
        scale = want.abs().max()
        assert scale > 0
        assert (got - want).abs().max() <= 0.02 * scale, ((got - want).abs().max(), scale)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=4),
       chunk=st.integers(1, 9), seed=st.integers(0, 1000))
def test_ragged_batches_property(model, rows, chunk, seed):
    prompts = torch.tensor([p for p, _ in rows])
    completions = torch.tensor([c for _, c in rows])
    width = int((prompts + completions).max()) + 2
    ids = torch.randint(0, VOCAB, (len(rows), width), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, chunk_tokens=chunk)
        want = naive_sequence_logprobs(model, ids, prompts, completions)
    assert got.logprobs.shape == (len(rows), int(completions.max()))
    torch.testing.assert_close(got.logprobs, want, atol=1e-5, rtol=0)


# -- top-k (the OpenAI-style /v1/completions path) ------------------------------------------------------------------
def _naive_top(model, ids, prompts, completions, k, temperature=1.0):
    """Full [B, T, V] log-softmax: per row, the top-k at positions prompt-1 .. prompt+completion-1."""
    with torch.no_grad():
        all_lp = (model(input_ids=ids).logits.float() / temperature).log_softmax(-1)
    out = []
    for i, (p, c) in enumerate(zip(prompts.tolist(), completions.tolist())):
        values, indices = all_lp[i, p - 1:p + c].topk(k, dim=-1)
        out.append((values, indices))
    return out


@pytest.mark.parametrize("chunk_tokens", [1, 5, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_top_logprobs_match_full_log_softmax(model, chunk_tokens, temperature):
    ids, prompts, completions = _batch()
    # rows end at their completion here (no padding), so the column after the last token is position T - 1 at most
    got = sequence_top_logprobs(model, ids, prompts, completions, k=3, temperature=temperature,
                                chunk_tokens=chunk_tokens)
    with torch.no_grad():
        want = naive_sequence_logprobs(model, ids, prompts, completions, temperature=temperature)
    assert got.top_logprobs.shape == (4, 24, 3) and got.top_ids.dtype == torch.long
    torch.testing.assert_close(got.logprobs, want, atol=1e-5, rtol=0)
    for i, (values, indices) in enumerate(_naive_top(model, ids, prompts, completions, 3, temperature)):
        c = int(completions[i])
        torch.testing.assert_close(got.top_logprobs[i, :c + 1], values, atol=1e-5, rtol=0)
        assert torch.equal(got.top_ids[i, :c + 1], indices)
        assert not got.top_logprobs[i, c + 1:].any() and not got.logprobs[i, c:].any()  # padding is 0


def test_greedy_token_logprob_is_bit_identical_to_top1(model):
    """lm-eval's is_greedy compares a token's logprob with max(top_logprobs) by ==: the two must be the same bits."""
    ids, prompts, completions = _batch(seed=3)
    first = sequence_top_logprobs(model, ids, prompts, completions, k=1)
    greedy = ids.clone()
    for i, (p, c) in enumerate(zip(prompts.tolist(), completions.tolist())):
        greedy[i, p:p + c] = first.top_ids[i, :c, 0]  # each completion token replaced by the argmax before it
    # teacher forcing changes the context, so check only the first completion token of each row (same prefix)
    again = sequence_top_logprobs(model, greedy, prompts, completions, k=1)
    for i, c in enumerate(completions.tolist()):
        if c:
            assert again.logprobs[i, 0].item() == again.top_logprobs[i, 0, 0].item()


@pytest.mark.parametrize("bias", [False, True], ids=["fused-weight", "module-head"])
def test_top_logprobs_from_hidden_matches_log_softmax(bias):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden, targets = torch.randn(13, 16), torch.randint(0, 50, (13,))
    logp, top, top_ids = top_logprobs_from_hidden(hidden, head, targets, k=60, temperature=0.8, chunk_tokens=4)
    full = (head(hidden).detach() / 0.8).log_softmax(-1)
    assert top.shape == (13, 50)  # k capped at the vocabulary
    torch.testing.assert_close(logp, full.gather(-1, targets[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(top, full.sort(-1, descending=True).values, atol=1e-5, rtol=0)
    assert torch.equal(full.gather(-1, top_ids), full.sort(-1, descending=True).values)
    with pytest.raises(ValueError, match="k must be"):
        top_logprobs_from_hidden(hidden, head, targets, k=0)


def test_top_logprobs_apply_architecture_logit_transforms():
    model = _tiny(Gemma2Config, final_logit_softcapping=5.0, attn_logit_softcapping=None)
    ids, prompts, completions = _batch()
    got = sequence_top_logprobs(model, ids, prompts, completions, k=2)
    for i, (values, _) in enumerate(_naive_top(model, ids, prompts, completions, 2)):
        torch.testing.assert_close(got.top_logprobs[i, :int(completions[i]) + 1], values, atol=1e-5, rtol=0)
