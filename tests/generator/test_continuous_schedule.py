"""The continuous schedule (generator/continuous/) against a live hub: groups uploaded as they finish, the engine
kept full, every group uploaded once, weights taken between steps, failures raised from the upload thread.

The schedule is tested here with a scripted engine (the ContinuousEngine contract: one token per running sequence
per step, lengths chosen per request), so stragglers and switches happen exactly where a test puts them; the real
engines are tested against the same contract in test_hf_continuous.py and tests/vllm/, and end to end in
tests/e2e/."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.continuous.schedule import ContinuousRollouts
from generator.engines.base import FinishedSequence, SampledCompletion, SequenceRequest
from generator.failures import FailureRateExceeded
from generator.rewards import RewardSet
from shared.config.schema import RewardSpec
from shared.protocol.client import HubClient
from tests.generator.test_loop import engine, make_loop  # noqa: F401 -- the module's engine fixture
from tests.live_server import LiveServer, make_config

pytestmark = pytest.mark.slow  # a live hub (LiveServer)


class ScriptedEngine:
    """Each running sequence gets one token per step; a request's length is ``length(request)``. Weights are
    loaded through ``base`` (a real TransformersEngine: the receiver loads into it)."""

    name = "scripted"

    def __init__(self, base, max_in_flight: int, length) -> None:
        self.base, self.max_in_flight, self.length = base, max_in_flight, length
        self.queued: list[SequenceRequest] = []
        self.running: dict[str, tuple[SequenceRequest, list[int]]] = {}
        self.version = 0
        self.switches: list[tuple[int, int]] = []     # (step, version) of each weights_changed
        self.steps = 0
        self.most_running = 0
        self.aborted: list[str] = []

    def submit(self, requests):
        self.queued += requests

    def num_unfinished(self):
        return len(self.queued) + len(self.running)

    def weights_changed(self, version, recompute=True):
        self.version = version
        self.switches.append((self.steps, version))

    def abort(self, request_ids):
        self.aborted += request_ids
        self.queued = [r for r in self.queued if r.request_id not in request_ids]
        for request_id in request_ids:
            self.running.pop(request_id, None)

    def step(self):
        while self.queued and len(self.running) < self.max_in_flight:
            request = self.queued.pop(0)
            self.running[request.request_id] = (request, [])
        self.most_running = max(self.most_running, len(self.running))
        self.steps += 1
        finished = []
        for request_id, (request, versions) in list(self.running.items()):
            versions.append(self.version)
            if len(versions) == min(self.length(request), request.sampling.max_tokens):
                del self.running[request_id]
                tokens = [5 + len(versions) % 7 for _ in versions]
                reason = "length" if len(versions) == request.sampling.max_tokens else "stop"
                finished.append(FinishedSequence(request_id, SampledCompletion(tokens, [-1.0] * len(tokens),
                                                                               reason, versions=versions)))
        return finished


def straggling_first_group(request: SequenceRequest) -> int:
    """Group 0's sequences are stragglers (30 tokens); every other sequence takes 2 + its sample index tokens."""
    group, _, sample = request.request_id.partition("/")
    return 30 if group == "0" else 2 + int(sample)


def schedule(loop, engine_, **kw):
    return ContinuousRollouts(loop, engine_, max_in_flight=engine_.max_in_flight, upload_interval_s=0.0,
                              check_interval_s=0.05, **kw)


def test_groups_are_uploaded_as_they_finish_and_the_engine_stays_full(engine, tmp_path):  # noqa: F811
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.sampling = loop.sampling.__class__(temperature=1.0, max_tokens=32)
        scripted = ScriptedEngine(engine, max_in_flight=8, length=straggling_first_group)
        stats = schedule(loop, scripted).run(threading.Event(), max_groups=10)
        assert stats.groups_uploaded == 10 and live.state.hub.depth() == 10
        batch = HubClient(live.url).get_batch(10, wait_s=30)   # depth counts groups still being scored
    # the straggler (group 0, 30 steps) did not hold the others: while it ran, its 4 free slots finished a short
    # group (5 steps) every 5 steps, each uploaded at once: 5 of them reached the hub before it
    lengths = batch.completion_lengths.view(10, 4)
    straggler = lengths[:, 0].tolist().index(30)
    assert straggler >= 5 and lengths[:straggler].max() <= 5 and lengths[straggler].tolist() == [30] * 4
    # the engine was refilled as sequences finished: never above its capacity, full while groups were wanted
    assert scripted.most_running == 8
    assert stats.schedule.steps < 45 and stats.schedule.slot_steps / stats.schedule.steps > 5
    assert set(batch.group_ids) == set(batch.group_ids) and len(set(batch.group_ids)) == 10


def test_new_weights_reach_the_engine_between_steps_and_groups_take_their_oldest_version(
        engine, tmp_path, tiny_model_dir):  # noqa: F811
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.sampling = loop.sampling.__class__(temperature=1.0, max_tokens=32)
        scripted = ScriptedEngine(engine, max_in_flight=8, length=straggling_first_group)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)
        path = tmp_path / "v4.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(path))
        original = scripted.step

        def step_then_publish():   # version 4 is published while the straggler is half-way
            if scripted.steps == 10:
                HubClient(live.url).upload_weights(4, path)
            return original()

        scripted.step = step_then_publish
        # the hub is asked for a new version before every step (check_interval_s 0): the switch comes right after
        # the step during which it was published, whatever the machine's speed
        stats = ContinuousRollouts(loop, scripted, max_in_flight=8, upload_interval_s=0.0,
                                   check_interval_s=0.0).run(threading.Event(), max_groups=12)
        batch = HubClient(live.url).get_batch(12, wait_s=30)
    switch = next(step for step, version in scripted.switches if version == 4)
    assert switch == 11 and stats.weight_updates == 1
    torch.testing.assert_close(engine.model.model.norm.weight, model.model.norm.weight)
    versions = batch.policy_versions.view(12, 4)[:, 0].tolist()
    straggler = batch.completion_lengths.view(12, 4)[:, 0].tolist().index(30)
    assert versions[straggler] == 0      # its first tokens were sampled with version 0: the oldest is its version
    others = versions[:straggler] + versions[straggler + 1:]
    assert others[-1] == 4 and others == sorted(others)
    # the straggler's tokens: those sampled before the switch carry 0, those after it 4
    row = batch.token_versions[straggler * 4].tolist()[:30]
    assert row == [0] * switch + [4] * (30 - switch)


def failing_reward(prompt, completion, example):
    raise ValueError("this reward always fails")


def test_a_reward_failing_on_the_upload_thread_stops_the_schedule_with_its_error(engine, tmp_path):  # noqa: F811
    rewards = RewardSet.from_specs([RewardSpec(name="python", args={
        "function": "tests.generator.test_continuous_schedule:failing_reward"})])
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False, rewards=rewards)
        scripted = ScriptedEngine(engine, max_in_flight=8, length=lambda request: 3)
        with pytest.raises(FailureRateExceeded, match="this reward always fails"):
            schedule(loop, scripted).run(threading.Event(), max_groups=50)
        assert live.state.hub.depth() == 0 and loop.stats.groups_uploaded == 0
    assert scripted.num_unfinished() == 0   # what was in flight was aborted


def test_a_stop_uploads_the_complete_groups_and_aborts_the_rest(engine, tmp_path):  # noqa: F811
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.sampling = loop.sampling.__class__(temperature=1.0, max_tokens=32)
        stop = threading.Event()
        scripted = ScriptedEngine(engine, max_in_flight=8, length=straggling_first_group)
        original = scripted.step

        def step_then_stop():
            finished = original()
            if scripted.steps == 12:
                stop.set()
            return finished

        scripted.step = step_then_stop
        stats = schedule(loop, scripted).run(stop)
        assert live.state.hub.depth() == stats.groups_uploaded == 2   # the short groups done by step 10
    assert {r.partition("/")[0] for r in scripted.aborted} >= {"0"} and scripted.num_unfinished() == 0


@pytest.mark.parametrize("share", [1.0, 0.2])
def test_a_learner_publishing_at_every_step_gets_at_most_the_switch_share(engine, tmp_path, tiny_model_dir,  # noqa: F811
                                                                         share):
    """A new version before every step and switches that cost more than a step (a 40 ms recompute stand-in):
    with share 1 every check switches; with 0.2 the switches' measured cost stays within a fifth of the run (plus
    the last one's), and the engine still takes the newest version after each wait."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}, str(path))
    with LiveServer(make_config(tmp_path)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False)
        loop.sampling = loop.sampling.__class__(temperature=1.0, max_tokens=6)
        scripted = ScriptedEngine(engine, max_in_flight=8, length=lambda request: 6)
        publisher, step, changed = HubClient(live.url), scripted.step, scripted.weights_changed

        def publish_then_step():
            publisher.upload_weights(scripted.steps + 1, path)
            time.sleep(0.005)
            return step()

        def slow_switch(version, recompute=True):
            time.sleep(0.04)
            changed(version, recompute)

        scripted.step, scripted.weights_changed = publish_then_step, slow_switch
        rollouts = ContinuousRollouts(loop, scripted, max_in_flight=8, upload_interval_s=0.0, check_interval_s=0.0,
                                      max_switch_share=share)
        costs, stepped = [], rollouts.switches.stepped

        def recording(step_s, now):   # each switch's measured cost (load + the step after it over a usual one)
            before = rollouts.switches.switch_s
            stepped(step_s, now)
            if rollouts.switches.switch_s > before:
                costs.append(rollouts.switches.switch_s - before)

        rollouts.switches.stepped = recording
        started = time.perf_counter()
        stats = rollouts.run(threading.Event(), max_groups=30)
        wall = time.perf_counter() - started
    switches = [version for step_, version in scripted.switches if step_ > 0]
    steps = scripted.steps
    seen = f"{steps} steps, switches to {switches}, costs {costs}, {wall:.2f}s"
    assert stats.groups_uploaded == 30 and steps >= 40, seen
    assert switches == sorted(switches) and len(set(switches)) == len(switches), seen
    assert all(cost >= 0.04 for cost in costs), seen   # each switch measured at least its 40 ms
    if share == 1.0:
        assert len(switches) >= steps - 2, seen        # every check found a newer version and took it
    else:
        assert sum(costs) <= 0.2 * wall + max(costs), seen   # a fifth of the run, plus the last switch's cost
        assert 1 <= len(switches) <= steps / 3, seen
        assert all(later - earlier >= 2 for earlier, later in zip(switches, switches[1:])), seen   # skipped some
