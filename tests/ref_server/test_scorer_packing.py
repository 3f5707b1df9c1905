"""The reference scorer with packed rows: same logprobs as padded, micro-batches cut by summed tokens."""

import pytest
import torch

from ref_server.scoring.scorer import ReferenceScorer, Row
from shared.forward.logprobs import naive_sequence_logprobs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(count=9, seed=0):
    """Rows of 3..30 tokens, prompts of 1..3 tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 31, (count,), generator=gen).tolist()
    return [Row(torch.randint(4, 80, (n,), generator=gen).tolist(), 1 + i % 3) for i, n in enumerate(lengths)]


def _naive(model, row):
    with torch.no_grad():
        return naive_sequence_logprobs(model, torch.tensor([row.input_ids]), torch.tensor([row.prompt_length]))[0]


def _score(model, rows, packing, batch_tokens, top_k=0, record=None):
    scorer = ReferenceScorer(model, vocab_size=model.config.vocab_size, max_context=256, batch_tokens=batch_tokens,
                             packing=packing)
    if record is not None:
        inner = scorer._forward

        def recording_forward(input_ids, prompt_lengths, completion_lengths, temperature):
            record.append((prompt_lengths + completion_lengths).tolist())
            return inner(input_ids, prompt_lengths, completion_lengths, temperature)

        scorer._forward = recording_forward
    try:
        return scorer.score(rows, timeout=120, top_k=top_k), scorer.forward_batches
    finally:
        scorer.close()


def test_packed_scoring_equals_padded_and_the_models_own_logprobs(tiny_model):
    rows = _rows()
    padded, _ = _score(tiny_model, rows, "padded", 10_000)
    packed, _ = _score(tiny_model, rows, "packed", 10_000)
    for row, a, b in zip(rows, padded, packed):
        assert a.shape == (row.tokens - row.prompt_length,)
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
        torch.testing.assert_close(b, _naive(tiny_model, row), atol=1e-5, rtol=0)
    top_padded, _ = _score(tiny_model, rows, "padded", 10_000, top_k=3)
    top_packed, _ = _score(tiny_model, rows, "packed", 10_000, top_k=3)
    for a, b in zip(top_padded, top_packed):
        torch.testing.assert_close(b.top_logprobs, a.top_logprobs, atol=1e-5, rtol=0)
        assert torch.equal(b.top_ids, a.top_ids)


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_micro_batches_respect_the_token_budget_as_each_layout_counts_it(tiny_model, packing):
    rows = _rows(count=12, seed=1)
    budget = 60
    batches: list[list[int]] = []
    results, forwards = _score(tiny_model, rows, packing, budget, record=batches)
    assert forwards == len(batches) and sum(len(b) for b in batches) == len(rows)
    assert [n for b in batches for n in b] == [r.tokens for r in rows]  # every row once, in order
    for lengths in batches:
        cost = sum(lengths) if packing == "packed" else len(lengths) * max(lengths)
        assert cost <= budget or len(lengths) == 1, lengths
    for row, got in zip(rows, results):
        torch.testing.assert_close(got, _naive(tiny_model, row), atol=1e-5, rtol=0)


def test_summed_budget_needs_fewer_forwards_for_mixed_lengths(tiny_model):
    rows = [Row(list(range(4, 4 + n)), 1) for n in (40, 4, 5, 6, 40, 3, 4, 5)]
    _, padded = _score(tiny_model, rows, "padded", 80)
    _, packed = _score(tiny_model, rows, "packed", 80)
    # padded, a 40-token row fills 80 with one short row: [40, 4] [5, 6] [40, 3] [4, 5]; packed: 55 + 52 tokens
    assert (padded, packed) == (4, 2)


@CUDA
def test_bf16_scoring_on_gpu_is_within_bf16_tolerance_of_fp32_cpu(tiny_model_dir, tiny_model):
    """The server's default on a GPU (device auto: bf16) against float32 on the CPU: 0.05 nats per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda().eval()
    rows = _rows(seed=3)
    for packing in ("packed", "padded"):
        results, _ = _score(model, rows, packing, 10_000)
        for row, got in zip(rows, results):
            assert got.dtype == torch.float32 and got.device.type == "cpu"
            torch.testing.assert_close(got, _naive(tiny_model, row), atol=0.05, rtol=0)
