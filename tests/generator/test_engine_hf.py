import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine, WeightLoadError, load_safetensors_into
from shared.logprobs import sequence_logprobs
from shared.protocol import SamplingParams

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
