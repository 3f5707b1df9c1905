"""generator/engines/hf_continuous.py: the transformers engine on the continuous schedule, against the batch engine
(TransformersEngine.generate) on the tiny Llama, across weight switches, aborts and random arrival schedules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from generator.engines.base import SequenceRequest
from generator.engines.hf import TransformersEngine
from generator.engines.hf_continuous import ContinuousTransformers, inverse_cdf, splicable
from shared.forward.logprobs import sequence_logprobs
from shared.protocol.records import SamplingParams

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33], [40], [41, 42, 43]]
MAX_TOKENS = [10, 3, 14, 6, 12, 1, 9]
# how the batch's cache changes rows: spliced (prefills in one chunk, or in chunks of at most 16 padded tokens), or
# rebuilt by one prefill of every row (the path of models whose cache layers are not plain)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CACHE_PATHS = {"spliced": {}, "spliced-chunked-prefill": {"prefill_tokens": 16}, "rebuilt": {"merge_caches": False}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TransformersEngine(tiny_model_dir)


def greedy_request(i: int, prompt: list[int], max_tokens: int) -> SequenceRequest:
    return SequenceRequest(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


def drain(continuous: ContinuousTransformers, arrivals: dict[int, list[SequenceRequest]] | None = None,
          limit: int = 500) -> dict:
    """Step until nothing is unfinished, submitting ``arrivals[step]`` before each step; the completions by id
    (a request returned twice fails), checking the batch never holds more than ``max_in_flight`` rows and a
    spliced cache never more columns than its longest row."""
    arrivals = dict(arrivals or {})
    done = {}
    for step in range(limit):
        continuous.submit(arrivals.pop(step, []))
        for finished in continuous.step():
            assert finished.request_id not in done
            done[finished.request_id] = finished.completion
        assert continuous.in_flight <= continuous.max_in_flight
        if continuous._splice and continuous._rows:   # as narrow as the longest row: unattended columns trimmed
            widest = max(len(row.context) for row in continuous._rows)
            assert continuous._cache.layers[0].keys.shape[-2] == continuous._width == widest
        if not arrivals and continuous.num_unfinished() == 0:
            return done
    raise AssertionError("the engine did not finish")


def batch_greedy(engine: TransformersEngine, prompt: list[int], max_tokens: int):
    return engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), n=1)[0][0]


def perturbed_weights(model_dir, path, seed: int = 0):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(path))
    return path


@pytest.mark.parametrize("cache", CACHE_PATHS.values(), ids=list(CACHE_PATHS))
def test_greedy_equals_the_batch_engine_with_staggered_arrivals_and_fewer_slots_than_requests(engine, cache):
    continuous = ContinuousTransformers(engine, max_in_flight=3, **cache)
    # arrivals at steps 0, 0, 1, 2, 5, 5, 9: rows join a batch whose others are mid-completion, some wait for a slot
    steps = [0, 0, 1, 2, 5, 5, 9]
    arrivals: dict[int, list[SequenceRequest]] = {}
    for i, (prompt, max_tokens, step) in enumerate(zip(PROMPTS, MAX_TOKENS, steps)):
        arrivals.setdefault(step, []).append(greedy_request(i, prompt, max_tokens))
    done = drain(continuous, arrivals)
    assert sorted(done) == sorted(f"r{i}" for i in range(len(PROMPTS)))
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
        expected, got = batch_greedy(engine, prompt, max_tokens), done[f"r{i}"]
        assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason
        assert len(got.token_ids) == max_tokens   # the untrained model's greedy path emits no EOS here
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
        assert got.versions == [0] * max_tokens
    assert continuous.in_flight == 0


@pytest.mark.parametrize("cache", CACHE_PATHS.values(), ids=list(CACHE_PATHS))
def test_a_weight_switch_mid_completion_continues_with_the_new_version_from_the_prefix(
        tiny_model_dir, tmp_path, engine, cache):
    path = perturbed_weights(tiny_model_dir, tmp_path / "v7.safetensors")
    switched, v7 = TransformersEngine(tiny_model_dir), TransformersEngine(tiny_model_dir)
    v7.load_weights(path)
    continuous = ContinuousTransformers(switched, max_in_flight=3, **cache)
    requests = [greedy_request(i, p, 12) for i, p in enumerate(PROMPTS[:4])]   # r3 waits for a slot
    continuous.submit(requests)
    switch_at = 4
    for _ in range(switch_at):
        assert continuous.step() == []
    switched.load_weights(path)   # the scheduler's safe point: between two steps
    continuous.weights_changed(7)
    done = drain(continuous)
    assert sorted(done) == ["r0", "r1", "r2", "r3"]
    for request in requests:
        got = done[request.request_id]
        k = switch_at if request.request_id != "r3" else 0   # r3 started after the switch
        # version 0 alone for the first k tokens, then version 7 alone from prompt + those tokens
        head = batch_greedy(engine, request.prompt_ids, 12)
        tail = batch_greedy(v7, request.prompt_ids + head.token_ids[:k], 12 - k)
        assert got.token_ids == head.token_ids[:k] + tail.token_ids
        assert got.versions == [0] * k + [7] * (12 - k)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(head.logprobs[:k] + tail.logprobs),
                                   atol=1e-4, rtol=0)
        assert got.token_ids != head.token_ids   # the switch changed the completion (the test can tell)


def test_each_request_samples_with_its_own_params_and_its_seed_reproduces_it_whatever_the_batch(engine):
    requests = [SequenceRequest("greedy", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30)),
                SequenceRequest("top-k", PROMPTS[1], SamplingParams(temperature=0.7, top_k=5, max_tokens=30), seed=1),
                SequenceRequest("top-p", PROMPTS[2], SamplingParams(temperature=1.3, top_p=0.8, max_tokens=30), seed=2),
                SequenceRequest("plain", PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=30), seed=3)]
    alone = {}
    for request in requests:
        alone.update(drain(ContinuousTransformers(engine, max_in_flight=1), {0: [request]}))
    # together, with unseeded neighbours arriving and leaving around them
    others = [SequenceRequest(f"other{i}", PROMPTS[4 + i % 3], SamplingParams(temperature=1.0, max_tokens=3 + 5 * i))
              for i in range(5)]
    together = drain(ContinuousTransformers(engine, max_in_flight=5), {0: others[:2] + requests, 3: others[2:]})
    eos = engine.tokenizer.eos_token_id
    for request in requests:
        got = together[request.request_id]
        assert got.token_ids == alone[request.request_id].token_ids
        assert got.logprobs == pytest.approx(alone[request.request_id].logprobs, abs=1e-5)
        if got.finish_reason == "stop":
            assert got.token_ids[-1] == eos and eos not in got.token_ids[:-1]
        else:
            assert got.finish_reason == "length" and len(got.token_ids) == 30
        ids = torch.tensor([request.prompt_ids + got.token_ids])
        prompt_len = len(request.prompt_ids)
        with torch.no_grad():
            recomputed = sequence_logprobs(engine.model, ids, torch.tensor([prompt_len]),
                                           temperature=request.sampling.temperature or 1.0)
            logits = engine.model(ids).logits[0, prompt_len - 1:-1]
        torch.testing.assert_close(torch.tensor(got.logprobs), recomputed.logprobs[0], atol=1e-4, rtol=0)
        if request.request_id == "greedy":
            assert got.token_ids == batch_greedy(engine, request.prompt_ids, 30).token_ids
        if request.request_id == "top-k":   # every token among the 5 likeliest
            top5 = logits.topk(5, dim=-1).indices
            assert all(t in top5[j].tolist() for j, t in enumerate(got.token_ids))
    assert {together[r.request_id].finish_reason for r in requests} == {"stop", "length"}   # both endings covered
    assert together["top-k"].token_ids != together["plain"].token_ids


@settings(max_examples=25, deadline=None)
@given(capacity=st.integers(1, 4), cache=st.sampled_from(list(CACHE_PATHS.values())),
       events=st.lists(st.tuples(st.lists(st.integers(1, 8), max_size=3),      # max_tokens of the arrivals
                                 st.lists(st.integers(0, 40), max_size=2),     # aborts: indices of submitted ids
                                 st.booleans()),                               # a weight switch before the step
                       min_size=1, max_size=12))
def test_every_request_comes_back_once_unless_aborted_whatever_the_schedule(engine, capacity, cache, events):
    continuous = ContinuousTransformers(engine, max_in_flight=capacity, **cache)
    submitted: list[str] = []
    returned: dict[str, object] = {}
    aborted: set[str] = set()
    version = 0

    def step() -> None:
        for finished in continuous.step():
            assert finished.request_id not in returned and finished.request_id not in aborted
            returned[finished.request_id] = finished.completion
        assert continuous.in_flight <= capacity
        assert continuous.num_unfinished() == len(submitted) - len(returned) - len(aborted)

    for arrivals, aborts, switch in events:
        new = [SequenceRequest(f"q{len(submitted) + j}", PROMPTS[(len(submitted) + j) % len(PROMPTS)],
                               SamplingParams(temperature=1.0, max_tokens=m), seed=len(submitted) + j)
               for j, m in enumerate(arrivals)]
        continuous.submit(new)
        submitted += [r.request_id for r in new]
        if submitted:
            ids = [submitted[a % len(submitted)] for a in aborts]
            aborted |= {i for i in ids if i not in returned}
            continuous.abort(ids)
        if switch:
            version += 1
            continuous.weights_changed(version)
        step()
    while continuous.num_unfinished():
        step()
    assert set(returned) == set(submitted) - aborted
    for completion in returned.values():
        assert len(completion.versions) == len(completion.token_ids) == len(completion.logprobs) >= 1
        assert completion.versions == sorted(completion.versions) and completion.versions[-1] <= version


def test_an_aborted_row_leaves_the_batch_and_the_others_continue_unchanged(engine):
    continuous = ContinuousTransformers(engine, max_in_flight=3)
    continuous.submit([greedy_request(i, PROMPTS[i], 10) for i in range(4)])
    for _ in range(3):
        continuous.step()
    continuous.abort(["r1", "r3", "never-submitted"])   # one running, one queued, one unknown
    assert continuous.in_flight == 2 and continuous.num_unfinished() == 2
    done = drain(continuous)
    assert sorted(done) == ["r0", "r2"]
    for i in (0, 2):
        assert done[f"r{i}"].token_ids == batch_greedy(engine, PROMPTS[i], 10).token_ids


def test_bad_requests_are_refused_with_the_reason(engine):
    with pytest.raises(ValueError, match="max_in_flight"):
        ContinuousTransformers(engine, max_in_flight=0)
    with pytest.raises(ValueError, match="prefill_tokens"):
        ContinuousTransformers(engine, max_in_flight=2, prefill_tokens=0)
    continuous = ContinuousTransformers(engine, max_in_flight=2)
    continuous.submit([greedy_request(0, PROMPTS[0], 4)])
    with pytest.raises(ValueError, match="'r0': its request_id is already unfinished"):
        continuous.submit([greedy_request(0, PROMPTS[1], 4)])
    with pytest.raises(ValueError, match="'r1': empty prompt"):
        continuous.submit([greedy_request(1, [], 4)])
    with pytest.raises(ValueError, match="'s': seed must be an integer"):
        continuous.submit([SequenceRequest("s", PROMPTS[0], GREEDY, seed=-1)])
    with pytest.raises(ValueError, match="admit_at_least"):
        ContinuousTransformers(engine, max_in_flight=2, admit_at_least=3)
    assert continuous.num_unfinished() == 1


def test_a_sliding_window_model_rebuilds_its_cache_and_still_decodes_greedily(tmp_path):
    from deploy.demo.tiny_model import build_char_tokenizer, save_model_dir

    tokenizer = build_char_tokenizer()
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    save_model_dir(MistralForCausalLM(config).eval(), tokenizer, tmp_path / "mistral")
    engine = TransformersEngine(tmp_path / "mistral")
    with torch.no_grad():
        assert not splicable(engine.model(torch.tensor([PROMPTS[0]]), use_cache=True).past_key_values)
    continuous = ContinuousTransformers(engine, max_in_flight=1)   # one row: no padding, as generate on one prompt
    done = drain(continuous, {0: [greedy_request(i, PROMPTS[i], 9) for i in range(3)]})
    assert not continuous._splice
    for i in range(3):
        assert done[f"r{i}"].token_ids == batch_greedy(engine, PROMPTS[i], 9).token_ids


def test_the_tiny_llama_cache_is_spliced(engine):
    with torch.no_grad():
        assert splicable(engine.model(torch.tensor([PROMPTS[0]]), use_cache=True).past_key_values)


def test_a_backlog_joins_a_running_batch_a_few_rows_at_a_time(engine):
    continuous = ContinuousTransformers(engine, max_in_flight=6, admit_at_least=3)
    continuous.submit([greedy_request(i, PROMPTS[i % 7], 2 + i) for i in range(12)])
    done, joins = {}, []
    while continuous.num_unfinished():
        running, queued = continuous.in_flight, continuous.num_unfinished() - continuous.in_flight
        finished = continuous.step()
        done.update((f.request_id, f.completion) for f in finished)
        joined = continuous.in_flight + len(finished) - running   # rows that started this step
        if joined and running:   # a running batch takes rows only with 3 free slots, or all that wait if fewer
            assert 6 - running >= min(3, queued) and joined >= min(3, queued)
            joins.append(joined)
    assert joins and len(done) == 12
    for i in range(12):
        assert done[f"r{i}"].token_ids == batch_greedy(engine, PROMPTS[i % 7], 2 + i).token_ids


def test_theinverse_cdf_draw_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    for u, expected in [(0.0, [1, 0, 4]), (0.2, [3, 0, 4]), (0.5, [3, 1, 4]), (1 - 1e-12, [3, 1, 4])]:
        chosen = inverse_cdf(probs, torch.full((3,), u, dtype=torch.float64))
        assert chosen.tolist() == expected
    # the frequencies follow the probabilities
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counts = torch.bincount(inverse_cdf(probs[:1].expand(20000, 5), uniforms), minlength=5)
    assert counts[[0, 2, 4]].tolist() == [0, 0, 0] and abs(counts[1].item() / 20000 - 0.2) < 0.015


def test_a_switch_that_keeps_the_prefix_cache_costs_no_prefill_and_labels_new_tokens(tiny_model_dir):
    """on_weights: keep: the tokens after the switch carry the new version and are sampled over the keys and values
    the old weights computed: with the old weights loaded again under a new version number, the greedy completion
    is the old one token for token (nothing recomputed, nothing changed); the prefill count does not grow."""
    engine = TransformersEngine(tiny_model_dir)
    cont = ContinuousTransformers(engine, max_in_flight=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    reference = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), n=1)
    cont.submit([SequenceRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=10))
                 for i, p in enumerate(prompts)])
    forwards = []
    original = engine.model.forward
    engine.model.forward = lambda *a, **kw: forwards.append(kw["input_ids"].shape[1]) or original(*a, **kw)
    finished = {}
    for step in range(30):
        if step == 3:
            cont.weights_changed(5, recompute=False)
        finished.update({f.request_id: f.completion for f in cont.step()})
        if len(finished) == 2:
            break
    assert max(forwards[1:]) == 1   # after the first (the prompts' prefill) every forward decodes one token
    for i, group in enumerate(reference):
        done = finished[f"r{i}"]
        assert done.token_ids == group[0].token_ids
        assert done.versions == [0] * 3 + [5] * (len(done.token_ids) - 3)


def test_a_lora_adapter_version_switched_mid_completion_continues_on_the_new_adapter(tiny_model_dir, tmp_path,
                                                                                   engine):
    """learner.lora.publish: adapter: the receiver applies the adapter to the engine's base (apply_adapter), then
    the schedule calls weights_changed: the unfinished sequences continue on base + the new adapter, from their
    prefix, exactly as an engine holding that adapter alone would."""
    from tests.generator.test_vllm_lora import relay_adapter

    adapters = [tmp_path / "a1.safetensors", tmp_path / "a2.safetensors"]
    for seed, path in enumerate(adapters, start=1):
        relay_adapter(tiny_model_dir, path, seed=seed)
    switched, first, second = (TransformersEngine(tiny_model_dir) for _ in range(3))
    switched.apply_adapter(adapters[0])
    first.apply_adapter(adapters[0])
    second.apply_adapter(adapters[1])
    continuous = ContinuousTransformers(switched, max_in_flight=4)
    continuous.weights_changed(1)
    requests = [greedy_request(i, p, 12) for i, p in enumerate(PROMPTS[:3])]
    continuous.submit(requests)
    for _ in range(5):
        assert continuous.step() == []
    switched.apply_adapter(adapters[1])   # a new adapter version replaces the old one on the same base
    continuous.weights_changed(2)
    done = drain(continuous)
    changed = 0
    for request in requests:
        head = batch_greedy(first, request.prompt_ids, 12)
        tail = batch_greedy(second, request.prompt_ids + head.token_ids[:5], 7)
        got = done[request.request_id]
        assert got.token_ids == head.token_ids[:5] + tail.token_ids
        assert got.versions == [1] * 5 + [2] * 7
        changed += got.token_ids != head.token_ids
    assert changed   # the second adapter changed what was sampled (the test can tell)
