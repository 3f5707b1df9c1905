"""The chunked forward's extra-target gather (top-k distillation's student side): its logprobs at k extra ids per
completion position equal ``model(ids).logits.log_softmax(-1).gather(...)`` on a real tiny transformers model, and
so do the gradients they send into the model's weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from shared.forward.logprobs import sequence_logprobs

VOCAB = 97
K = 5


def _tiny(tie: bool = False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, head_dim=8,
                         tie_word_embeddings=tie)
    return AutoModelForCausalLM.from_config(config).double().float().eval()


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 20), generator=gen)
    prompts, completions = torch.tensor([2, 6, 4]), torch.tensor([18, 0, 11])
    extra = torch.randint(0, VOCAB, (3, 18, K), generator=gen)
    return ids, prompts, completions, extra


def _naive(model, ids, prompts, completions, extra, temperature):
    """``[B, L, k]`` from the full ``[B, T, V]`` log-softmax: entry (i, j) is the distribution predicting the token
    at prompts[i] + j, gathered at extra[i, j]."""
    mask = (torch.arange(ids.shape[1])[None] < (prompts + completions)[:, None]).long()
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float() / temperature
    logp = logits.log_softmax(-1)
    out = torch.zeros(ids.shape[0], int(completions.max()), K)
    for i, (p, c) in enumerate(zip(prompts.tolist(), completions.tolist())):
        out[i, :c] = logp[i, p - 1:p - 1 + c].gather(-1, extra[i, :c])
    return out


@pytest.mark.parametrize("chunk_tokens", [1, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tie", [False, True])
def test_extra_logprobs_equal_the_full_log_softmax(chunk_tokens, temperature, tie):
    model = _tiny(tie)
    ids, prompts, completions, extra = _batch()
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, temperature=temperature, chunk_tokens=chunk_tokens,
                                extra_targets=extra)
        plain = sequence_logprobs(model, ids, prompts, completions, temperature=temperature)
        want = _naive(model, ids, prompts, completions, extra, temperature)
    assert got.extra_logprobs.shape == (3, 18, K) and got.extra_logprobs.dtype == torch.float32
    torch.testing.assert_close(got.extra_logprobs, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.logprobs, plain.logprobs, atol=1e-5, rtol=0)  # the sampled tokens' unchanged
    assert (got.extra_logprobs[1] == 0).all() and (got.extra_logprobs[2, 11:] == 0).all()  # padding: 0


def test_extra_logprobs_with_entropy_and_packed_layout():
    model = _tiny()
    ids, prompts, completions, extra = _batch()
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, with_entropy=True, layout="packed",
                                extra_targets=extra, chunk_tokens=4)
        plain = sequence_logprobs(model, ids, prompts, completions, with_entropy=True)
        want = _naive(model, ids, prompts, completions, extra, 1.0)
    torch.testing.assert_close(got.extra_logprobs, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got.entropy, plain.entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
def test_gradients_match_the_full_log_softmax(tie):
    """A weighted sum of the extra logprobs (and the sampled tokens') backpropagates the same gradients into every
    weight as the naive [B, T, V] log-softmax does."""
    model = _tiny(tie)
    ids, prompts, completions, extra = _batch()
    weights = torch.randn(3, 18, K, generator=torch.Generator().manual_seed(2))
    got = sequence_logprobs(model, ids, prompts, completions, temperature=0.8, chunk_tokens=5, extra_targets=extra)
    assert got.extra_logprobs.requires_grad
    ((got.extra_logprobs * weights).sum() + got.logprobs.sum()).backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    naive = _naive(model, ids, prompts, completions, extra, 0.8)
    plain = sequence_logprobs(model, ids, prompts, completions, temperature=0.8)
    ((naive * weights).sum() + plain.logprobs.sum()).backward()
    theirs = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys() and len(ours) > 5
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], atol=2e-5, rtol=1e-4, msg=name)
    assert max(float(g.abs().max()) for g in ours.values()) > 1e-3  # not a vacuous all-zero match


def test_bad_extra_targets_are_refused():
    model = _tiny()
    ids, prompts, completions, extra = _batch()
    with pytest.raises(ValueError, match="extra_targets must be"):
        sequence_logprobs(model, ids, prompts, completions, extra_targets=extra[:, :5])
    with pytest.raises(ValueError, match="extra_targets must be"):
        sequence_logprobs(model, ids, prompts, completions, extra_targets=extra[..., 0])


def test_extra_logprobs_with_a_shared_prompt_pass():
    """Rows continuing one prompt share one pass of it (learner.prefix_sharing): the same extra logprobs."""
    from shared.forward.prefix_sharing import prefix_rows

    model = _tiny()
    ids, _, completions, extra = _batch()
    ids[:, :4] = ids[0, :4]
    prompts = torch.tensor([4, 4, 4])
    completions = torch.tensor([16, 0, 11])
    with torch.no_grad():
        got = sequence_logprobs(model, ids, prompts, completions, extra_targets=extra,
                                prefix=prefix_rows(ids, prompts))
        want = _naive(model, ids, prompts, completions, extra, 1.0)
    torch.testing.assert_close(got.extra_logprobs, want[:, :16], atol=1e-5, rtol=0)
