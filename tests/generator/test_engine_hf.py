import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import (
    TransformersEngine,
    WeightLoadError,
    filter_logits,
    load_safetensors_into,
    sample_with_logprobs,
)
from shared.forward.logprobs import sequence_logprobs
from shared.protocol.records import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_groups_have_shapes_finish_reasons_and_consistent_logprobs(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    sampling = SamplingParams(temperature=0.8, max_tokens=12)
    groups = engine.generate(PROMPTS, sampling, n=4, seed=3)
    assert [len(g) for g in groups] == [4, 4, 4]
    eos = engine.tokenizer.eos_token_id
    for prompt, group in zip(PROMPTS, groups):
        for sample in group:
            assert 1 <= len(sample.token_ids) <= 12 and len(sample.logprobs) == len(sample.token_ids)
            if sample.finish_reason == "stop":
                assert sample.token_ids[-1] == eos and eos not in sample.token_ids[:-1]
            else:
                assert sample.finish_reason == "length" and len(sample.token_ids) == 12
            # behaviour logprobs equal what the learner will compute for the same tokens at the same temperature
            ids = torch.tensor([prompt + sample.token_ids])
            with torch.no_grad():
                recomputed = sequence_logprobs(engine.model, ids, torch.tensor([len(prompt)]), temperature=0.8)
            torch.testing.assert_close(torch.tensor(sample.logprobs), recomputed.logprobs[0], atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    sampling = SamplingParams(temperature=1.0, max_tokens=8)
    first = engine.generate(PROMPTS, sampling, n=3, seed=11)
    again = engine.generate(PROMPTS, sampling, n=3, seed=11)
    assert [[s.token_ids for s in g] for g in first] == [[s.token_ids for s in g] for g in again]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    a = engine.generate(PROMPTS, greedy, n=2)
    assert all(g[0].token_ids == g[1].token_ids for g in a)


def test_weight_update_changes_outputs_and_matches_a_fresh_model(tiny_model_dir, tmp_path):
    engine = TransformersEngine(tiny_model_dir)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    before = [g[0].token_ids for g in engine.generate(PROMPTS, greedy, n=1)]
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    path = tmp_path / "v1.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"}, str(path))
    engine.load_weights(path)
    after = [g[0].token_ids for g in engine.generate(PROMPTS, greedy, n=1)]
    assert after != before
    eos = engine.tokenizer.eos_token_id
    for prompt, tokens in zip(PROMPTS, after):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=eos)
        expected = out[0, len(prompt):].tolist()
        if eos in expected:
            expected = expected[:expected.index(eos) + 1]
        assert tokens == expected


def test_weight_files_that_do_not_fit_are_refused(tiny_model_dir, tmp_path):
    engine = TransformersEngine(tiny_model_dir)
    wrong = tmp_path / "wrong.safetensors"
    save_file({"model.not_a_layer.weight": torch.zeros(2)}, str(wrong))
    try:
        load_safetensors_into(engine.model, wrong)
        raise AssertionError("expected WeightLoadError")
    except WeightLoadError as exc:
        assert "not in the model" in str(exc)
    partial = tmp_path / "partial.safetensors"
    save_file({"model.norm.weight": torch.ones(engine.model.config.hidden_size)}, str(partial))
    try:
        load_safetensors_into(engine.model, partial)
        raise AssertionError("expected WeightLoadError")
    except WeightLoadError as exc:
        assert "no values for" in str(exc)


class _ForceTokens:
    """A logits processor that makes ``generate`` emit given tokens (its raw ``output_logits`` stay untouched)."""

    def __init__(self, forced: torch.Tensor, width: int) -> None:
        self.forced, self.width = forced, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        keep = self.forced[:, step:step + 1]
        return torch.full_like(scores, float("-inf")).scatter(-1, keep, 0.0)


def _old_full_logits_logprobs(model, input_ids, attention, tokens, temperature, pad_id):
    """The engine's former computation: every step's raw logits from ``generate`` ([rows, steps, V] fp32), divided
    by the temperature, log-softmaxed, gathered at the sampled tokens; here with the tokens forced."""
    from transformers import LogitsProcessorList

    out = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=tokens.shape[1],
                         min_new_tokens=tokens.shape[1], do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=pad_id, eos_token_id=None,
                         logits_processor=LogitsProcessorList([_ForceTokens(tokens, input_ids.shape[1])]))
    assert torch.equal(out.sequences[:, input_ids.shape[1]:], tokens)
    logits = torch.stack(out.logits, dim=1).float()
    return (logits / temperature).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _left_padded(prompts, pad_id):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def test_sampled_token_logprobs_equal_the_old_full_logits_computation(tiny_model, tiny_model_dir):
    """Same values within 1e-5 as the former [rows, steps, V] path, for sampled (top-k/top-p) and greedy decoding,
    with left padding and the prompt's cache shared by the n samples of each prompt."""
    pad = 0
    ids, mask = _left_padded(PROMPTS, pad)
    for sampling, n in ((SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_tokens=10), 3),
                        (SamplingParams(temperature=0.0, max_tokens=10), 1)):
        torch.manual_seed(5)
        tokens, logprobs = sample_with_logprobs(tiny_model, ids, mask, n, sampling, eos_ids=[], pad_id=pad)
        assert tokens.shape == logprobs.shape == (len(PROMPTS) * n, 10)
        temperature = sampling.temperature or 1.0
        old = _old_full_logits_logprobs(tiny_model, ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0),
                                        tokens, temperature, pad)
        assert torch.all(logprobs < 0)
        torch.testing.assert_close(logprobs, old, atol=1e-5, rtol=0)


def test_greedy_tokens_equal_generate_and_rows_stop_at_eos(tiny_model):
    ids, mask = _left_padded(PROMPTS, 0)
    reference = tiny_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0, eos_token_id=None)[:, ids.shape[1]:]
    tokens, _ = sample_with_logprobs(tiny_model, ids, mask, 1, SamplingParams(temperature=0.0, max_tokens=12),
                                     eos_ids=[], pad_id=0)
    assert torch.equal(tokens, reference)
    # make each row's third token its EOS: later steps are padding with logprob 0, like generate's padding
    eos = int(reference[1, 2])
    tokens, logprobs = sample_with_logprobs(tiny_model, ids, mask, 1, SamplingParams(temperature=0.0, max_tokens=12),
                                            eos_ids=[eos], pad_id=0)
    first = int((reference[1] == eos).nonzero()[0])
    assert first <= 2 and tokens[1, first] == eos
    assert torch.all(tokens[1, first + 1:] == 0) and torch.all(logprobs[1, first + 1:] == 0)
    assert torch.all(logprobs[1, :first + 1] < 0)


def test_on_the_cpu_decoding_stops_at_the_step_where_the_last_row_ended(tiny_model):
    """Every step past the last EOS is a whole forward of the batch: on the CPU the loop checks at every step."""
    ids, mask = _left_padded(PROMPTS, 0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    reference, _ = sample_with_logprobs(tiny_model, ids, mask, 1, greedy, eos_ids=[], pad_id=0)
    # each row's third greedy token ends it: all rows have ended after step 3, so 3 columns come back, not 8 or 12
    eos_ids = sorted({int(t) for t in reference[:, 2]})
    calls = []
    hook = tiny_model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        tokens, _ = sample_with_logprobs(tiny_model, ids, mask, 1, greedy, eos_ids=eos_ids, pad_id=0)
    finally:
        hook.remove()
    last_end = max(int(next(i for i, t in enumerate(row.tolist()) if t in eos_ids)) for row in reference)
    assert last_end <= 2
    assert tokens.shape[1] == last_end + 1
    assert len(calls) == last_end + 1  # the prompt's forward, then one per decoded step before the last


def test_filters_match_generates_top_k_and_top_p_warpers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_k, top_p in ((5, 1.0), (-1, 0.8), (10, 0.5), (-1, 1.0)):
        expected = scores
        if top_k > 0:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        got = filter_logits(scores, top_k, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), (top_k, top_p)
        assert torch.equal(got[~torch.isinf(got)], scores[~torch.isinf(got)])
    kept = (~torch.isinf(filter_logits(scores, -1, 0.5))).sum(-1)
    assert torch.all(kept >= 1) and torch.all(kept < 50)
