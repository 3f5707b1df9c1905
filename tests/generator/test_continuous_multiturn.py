"""Multi-turn trajectories on the continuous schedule (generator/continuous/trajectories.py) with the transformers
engine and the tiny model that calls the calculator: each turn a sequence of its own, the environment between
them off the engine loop. Against the call-at-a-time rollouts (generator/multiturn.py): the same greedy tokens,
mask, logprobs and ends; across a weight switch in the middle of a turn, each token's version and behaviour logprob
are those of the weights that sampled it; with a live hub, every group uploaded once."""

import copy
import threading
import time

import pytest
import torch

from generator.continuous.schedule import ContinuousRollouts
from generator.continuous.trajectories import TrajectoriesInFlight
from generator.datasets import Example
from generator.engines.hf import TransformersEngine
from generator.engines.hf_continuous import ContinuousTransformers
from generator.multiturn import MultiTurnRollouts
from generator.rewards import RewardSet
from generator.stats import LoopStats
from shared.config.schema import RewardSpec
from shared.config.schema.generator import EnvironmentConfig
from shared.forward.logprobs import naive_sequence_logprobs
from shared.protocol.client import HubClient
from shared.protocol.records import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
QUESTIONS = ["7*8=", "3*4=", "12*5=", "9*9="]
ANSWERS = {"7*8=": "56", "3*4=": "12", "12*5=": "60", "9*9=": "81"}


@pytest.fixture(scope="module")
def engine(calc_model_dir):
    return TransformersEngine(calc_model_dir)


def encode(engine, text):
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"]


def drive(engine, cfg, questions, n, max_in_flight, on_step=None, limit=3000, continuous=None):
    """Every question's group through TrajectoriesInFlight and ``continuous`` (default: a ContinuousTransformers of
    ``max_in_flight`` rows), as the schedule drives them; ``on_step(step, continuous)`` before each engine step. The
    groups by question (a group completed twice fails) and the environment stats."""
    multiturn = MultiTurnRollouts(engine, engine.tokenizer, cfg)
    continuous = continuous or ContinuousTransformers(engine, max_in_flight=max_in_flight)
    flights = TrajectoriesInFlight(multiturn, n, seed=0, generator_id="g", stats=LoopStats(), max_workers=4)
    for question in questions:
        assert flights.submit(Example(question), encode(engine, question), GREEDY, version=0) == []
    groups, _ = run_flights(flights, continuous, on_step=on_step, limit=limit)
    return groups, multiturn.stats


def run_flights(flights, continuous, on_step=None, stop_at=None, limit=3000, wait_s=1.0):
    """Drive ``flights`` (opened groups: trajectories or episodes) on ``continuous`` as the schedule does, until none
    is open or waiting; ``stop_at``: abandon everything before that engine step. The complete groups by question
    (each completed once, stamped ``completed_at``) and what abandon returned (None: no stop)."""
    groups, steps = {}, 0
    while True:
        requests, complete = flights.poll()
        continuous.submit(requests)
        for group in complete:
            assert group.example.question not in groups and group.complete
            groups[group.example.question] = group
            group.completed_at = time.monotonic()
        if not (flights.open or flights.waiting):
            return groups, None
        if stop_at is not None and steps == stop_at:
            aborted = flights.abandon()
            continuous.abort(aborted)
            return groups, aborted
        if continuous.num_unfinished() == 0:
            flights.wait(wait_s)
            continue
        if on_step is not None:
            on_step(steps, continuous)
        for finished in continuous.step():
            flights.finish(finished)
        steps += 1
        assert steps < limit


@pytest.mark.parametrize("max_in_flight", [8, 3])
def test_greedy_trajectories_equal_the_call_at_a_time_rollouts(engine, max_in_flight):
    cfg = EnvironmentConfig(name="calculator", max_turns=3)
    batch_runner = MultiTurnRollouts(engine, engine.tokenizer, cfg)
    prompts = [encode(engine, q) for q in QUESTIONS]
    _, expected = batch_runner.generate([{"question": q} for q in QUESTIONS], prompts, GREEDY, 2, seed=0)
    # 8 trajectories: all at once, or 3 rows at a time (turns queue for a slot, rows join mid-turn)
    groups, stats = drive(engine, cfg, QUESTIONS, 2, max_in_flight)
    assert sorted(groups) == sorted(QUESTIONS)
    for question, prompt, want in zip(QUESTIONS, prompts, expected):
        group = groups[question]
        assert group.prompt_ids == prompt and group.opened_version == 0
        for got, ref in zip(group.samples, want):
            assert got.token_ids == ref.token_ids and got.mask == ref.mask and 0 in got.mask
            assert got.finish_reason == ref.finish_reason == "stop" and not got.env_failed
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), atol=1e-4, rtol=0)
            assert got.versions == [0] * len(got.token_ids)   # one version: the group's
            assert ANSWERS[question] in engine.tokenizer.decode(got.token_ids[-4:])
    # the same counts as the batch rollouts: 8 trajectories of two model turns and one calculator call each
    assert (stats.trajectories, stats.turns, stats.env_calls, stats.env_errors) == (8, 16, 8, 0)
    assert (stats.env_tokens, stats.model_tokens) == (batch_runner.stats.env_tokens, batch_runner.stats.model_tokens)


def test_limits_end_trajectories_as_in_batch_mode(engine):
    for cfg, length in ((EnvironmentConfig(name="calculator", max_turns=1), 16),           # asked for a 2nd turn
                        (EnvironmentConfig(name="calculator", max_total_tokens=20), 16),   # no room for the result
                        (EnvironmentConfig(name="calculator", max_turn_tokens=5), 5)):     # turn 1 cut
        groups, _ = drive(engine, cfg, ["7*8="], 1, 4)
        sample = groups["7*8="].samples[0]
        assert sample.finish_reason == "length" and len(sample.token_ids) == length and 0 not in sample.mask


def test_a_weight_switch_mid_turn_gives_each_token_the_version_and_logprob_that_sampled_it(engine):
    before = copy.deepcopy(engine.model)
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}

    def switch(step, continuous):
        if step == 5:   # turn 1 (16 tokens) is running: a group whose environments answered first is 5 tokens in
            with torch.no_grad():
                engine.model.model.norm.weight.mul_(1.3)
            continuous.weights_changed(1)

    try:
        groups, _ = drive(engine, EnvironmentConfig(name="calculator"), QUESTIONS, 2, 8, on_step=switch)
        after = engine.model
        # a trajectory whose reset (on the environments' thread pool) came after the switch is all version 1
        olds = check_switched(engine, groups, before, after)
        assert max(olds) >= 1, olds   # at least one trajectory switched in the middle of its first turn
    finally:
        engine.model.load_state_dict(saved)


SLOW_ONE = '''
import time

from generator.environments.calculator import Calculator


class SlowOne(Calculator):
    def reset(self, sample):
        self.question = sample["question"]

    def step(self, text):
        if self.question == "7*8=":
            time.sleep(1.5)
        return super().step(text)
'''


def test_a_slow_environment_does_not_hold_the_other_trajectories(engine, tmp_path):
    path = tmp_path / "slow.py"
    path.write_text(SLOW_ONE)
    groups, stats = drive(engine, EnvironmentConfig(name=f"{path}:SlowOne", timeout_s=5.0), QUESTIONS, 2, 8)
    assert sorted(groups) == sorted(QUESTIONS) and stats.env_errors == 0 and stats.env_time_s > 1.5
    # while 7*8's calculator slept (1.5 s), the engine went on with the other trajectories' second turns: their
    # groups were complete well before it (call at a time, every trajectory waits for the turn's slowest call)
    others = max(groups[q].completed_at for q in QUESTIONS if q != "7*8=")
    assert groups["7*8="].completed_at - others > 0.8


@pytest.mark.slow  # a live hub
def test_every_multiturn_group_is_uploaded_once_through_the_schedule(engine, tmp_path, calc_model_dir):
    from tests.generator.test_loop import make_loop
    from tests.live_server import LiveServer, make_config

    with LiveServer(make_config(tmp_path, calc_model_dir)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False,
                         rewards=RewardSet.from_specs([RewardSpec(name="arithmetic")]),
                         environment=EnvironmentConfig(name="calculator", max_turns=3, max_total_tokens=64))
        loop.sampling = SamplingParams(temperature=1.0, max_tokens=24)
        continuous = ContinuousTransformers(engine, max_in_flight=8)
        schedule = ContinuousRollouts(loop, continuous, max_in_flight=8, upload_interval_s=0.0, check_interval_s=0.05)
        stats = schedule.run(threading.Event(), max_groups=6)
        assert stats.groups_uploaded == 6 and live.state.hub.depth() == 6
        batch = HubClient(live.url).get_batch(6, wait_s=30)   # depth counts groups still being scored
    assert len(set(batch.group_ids)) == 6 and schedule.groups.open == {} and not schedule.groups.waiting
    assert batch.completion_mask is not None and not batch.completion_mask.all()   # the calculator's tokens: 0
    assert stats.environment.trajectories >= 24 and stats.environment.turns >= 24
    assert stats.completion_tokens >= int(batch.completion_lengths.sum())


FAULTY = '''
import itertools

from generator.environments.calculator import Calculator

COUNT = itertools.count()


class Broken(Calculator):
    def step(self, text):
        raise RuntimeError("the tool is broken")


class Wordy(Calculator):
    def reset(self, sample):   # a different text per trajectory, longer than max_total_tokens
        return "1" * 40 + str(next(COUNT) % 10)
'''


@pytest.mark.slow  # a live hub
def test_the_failure_and_refusal_rules_stop_the_schedule_as_they_stop_batch_mode(engine, tmp_path, calc_model_dir):
    from generator.failures import FailureRateExceeded
    from generator.refusals import GroupsRefused
    from tests.generator.test_loop import make_loop
    from tests.live_server import LiveServer, make_config

    path = tmp_path / "faulty.py"
    path.write_text(FAULTY)
    rules = {"Broken": (EnvironmentConfig(name=f"{path}:Broken"), FailureRateExceeded, "the tool is broken"),
             "Wordy": (EnvironmentConfig(name=f"{path}:Wordy", max_total_tokens=32), GroupsRefused,
                       "leaves no room for a model token")}
    with LiveServer(make_config(tmp_path, calc_model_dir)) as live:
        for name, (cfg, error, reason) in rules.items():
            loop = make_loop(engine, live.url, tmp_path, generator_id=name, wait_for_budget=False,
                             rewards=RewardSet.from_specs([RewardSpec(name="arithmetic")]), environment=cfg,
                             max_refused_in_a_row=3)
            loop.sampling = GREEDY   # every trajectory calls the calculator: every one fails, or is refused
            continuous = ContinuousTransformers(engine, max_in_flight=8)
            schedule = ContinuousRollouts(loop, continuous, max_in_flight=8, upload_interval_s=0.0,
                                          check_interval_s=0.05)
            with pytest.raises(error, match=reason):
                schedule.run(threading.Event(), max_groups=20)
            assert loop.stats.groups_uploaded == 0 and continuous.num_unfinished() == 0
        assert live.state.hub.depth() == 0


def check_switched(engine, groups, before, after, switch_step: int = 5) -> list[int]:
    """Groups sampled across one switch (version 0 -> 1) at engine step ``switch_step``, in the first model turn:
    each sample is version 0 up to the switch and 1 after (text the model did not sample takes its model token's
    version), each model token's logprob that of the model of its version, the others' 0. The version-0 token
    count of each sample."""
    olds = []
    for question, group in groups.items():
        prompt = encode(engine, question)
        for sample in group.samples:
            versions, mask = sample.versions, sample.mask
            old = versions.count(0)
            olds.append(old)
            assert old <= switch_step < mask.index(0) and versions == [0] * old + [1] * (len(versions) - old)
            ids = torch.tensor([prompt + sample.token_ids])
            for model, version in ((before, 0), (after, 1)):
                with torch.no_grad():
                    full = naive_sequence_logprobs(model, ids, torch.tensor([len(prompt)]),
                                                   torch.tensor([len(sample.token_ids)]))[0]
                mine = torch.tensor([m == 1 and v == version for m, v in zip(mask, versions)])
                torch.testing.assert_close(torch.tensor(sample.logprobs)[mine], full[mine], atol=1e-4, rtol=0)
            assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if m == 0)
    return olds
