"""An agent's episodes on the continuous schedule (generator/continuous/episodes.py) with the transformers engine,
the tiny model that calls the calculator and the calculator agent (deploy/demo/calc_agent.py) through the real
endpoint: each call one engine sequence. Against the calculator environment on the same schedule: the same greedy
tokens, mask and logprobs; across a weight switch in the middle of a call, each token's version and behaviour
logprob are those of the weights that sampled it; a stop drops the open groups whole; with a live hub, every group
is uploaded once."""

import copy
import threading
import time
from pathlib import Path

import pytest
import torch

from generator.agent.runner import AgentRollouts
from generator.continuous.episodes import EpisodesInFlight
from generator.continuous.schedule import ContinuousRollouts
from generator.datasets import Example
from generator.engines.hf_continuous import ContinuousTransformers
from generator.stats import LoopStats
from shared.config.schema import RewardSpec
from shared.config.schema.agent import AgentConfig
from shared.config.schema.generator import EnvironmentConfig
from shared.protocol.client import HubClient
from shared.protocol.records import SamplingParams
from tests.generator.test_continuous_multiturn import (  # noqa: F401
    GREEDY,
    QUESTIONS,
    check_switched,
    drive,
    encode,
    engine,
    run_flights,
)

pytestmark = pytest.mark.slow   # the agent endpoint: a uvicorn server
CALC_AGENT = str(Path(__file__).resolve().parents[2] / "deploy" / "demo" / "calc_agent.py") + ":calculator_agent"
AGENT = AgentConfig(fn=CALC_AGENT, reward="rewards", max_total_tokens=64, timeout_s=60)


def drive_agents(engine, questions, n, max_in_flight, on_step=None, stop_at=None, limit=3000):  # noqa: F811
    """Every question's group of ``n`` calculator-agent episodes through EpisodesInFlight and the engine's
    continuous wrapper (``max_in_flight`` rows), as the schedule drives them; ``on_step(step, continuous)`` before
    each engine step; ``stop_at``: abandon everything before that step. The groups by question, the agent, what
    abandon returned."""
    from generator.continuous.engines import continuous_engine

    agent = AgentRollouts(engine, engine.tokenizer, AGENT, GREEDY, seed=0)
    continuous = continuous_engine(engine, max_in_flight)
    flights = EpisodesInFlight(agent, n, seed=0, generator_id="g", sampling=GREEDY, stats=LoopStats())
    try:
        for question in questions:
            assert flights.submit(Example(question), encode(engine, question), GREEDY, version=0) == []
        groups, aborted = run_flights(flights, continuous, on_step=on_step, stop_at=stop_at, limit=limit, wait_s=0.2)
        return groups, agent, aborted
    finally:
        agent.close()


@pytest.mark.parametrize("max_in_flight", [8, 3])
def test_greedy_episodes_equal_the_calculator_environments_trajectories(engine, max_in_flight):  # noqa: F811
    want, _ = drive(engine, EnvironmentConfig(name="calculator", max_turns=2, max_total_tokens=64), QUESTIONS, 2, 8)
    # 8 episodes: their calls all at once, or 3 rows at a time (calls queue for a slot, join mid-step)
    groups, agent, _ = drive_agents(engine, QUESTIONS, 2, max_in_flight)
    assert sorted(groups) == sorted(QUESTIONS)
    for question in QUESTIONS:
        got, ref = groups[question], want[question]
        assert got.prompt_ids == ref.prompt_ids and got.opened_version == 0
        for mine, theirs in zip(got.samples, ref.samples):
            assert mine.token_ids == theirs.token_ids and mine.mask == theirs.mask and 0 in mine.mask
            torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-4, rtol=0)
            assert mine.versions == [0] * len(mine.token_ids) and not mine.env_failed
    stats = agent.stats
    assert (stats.trajectories, stats.turns, stats.env_calls, stats.env_errors) == (8, 16, 8, 0)
    assert stats.template_mismatches == 0 and agent.book.open_count() == 0


def test_a_weight_switch_mid_call_gives_each_token_the_version_and_logprob_that_sampled_it(engine):  # noqa: F811
    before = copy.deepcopy(engine.model)
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}

    def switch(step, continuous):
        if step == 5:   # the first calls (16 tokens each) are running
            with torch.no_grad():
                engine.model.model.norm.weight.mul_(1.3)
            continuous.weights_changed(1)

    try:
        groups, _, _ = drive_agents(engine, QUESTIONS, 2, 8, on_step=switch)
        olds = check_switched(engine, groups, before, engine.model)   # tool text: its model token's version
        assert max(olds) >= 1, olds   # at least one episode switched in the middle of its first call
    finally:
        engine.model.load_state_dict(saved)


def test_a_stop_drops_the_open_groups_whole_and_answers_their_calls(engine):  # noqa: F811
    groups, agent, aborted = drive_agents(engine, QUESTIONS, 2, 8, stop_at=3)
    assert groups == {} and aborted   # calls were in the engine: their ids are aborted
    deadline = time.monotonic() + 10
    while agent.book.open_count() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.stats.episodes_dropped == 8 and agent.book.open_count() == 0


def test_every_agent_group_is_uploaded_once_through_the_schedule(engine, tmp_path, calc_model_dir):  # noqa: F811
    from generator.rewards import RewardSet
    from tests.generator.test_loop import make_loop
    from tests.live_server import LiveServer, make_config

    with LiveServer(make_config(tmp_path, calc_model_dir)) as live:
        loop = make_loop(engine, live.url, tmp_path, wait_for_budget=False,
                         rewards=RewardSet.from_specs([RewardSpec(name="arithmetic")]))
        loop.sampling = SamplingParams(temperature=1.0, max_tokens=24)
        agent = AgentRollouts(engine, engine.tokenizer, AGENT, loop.sampling, seed=0)
        loop.use_agent(agent, AGENT)
        try:
            schedule = ContinuousRollouts(loop, ContinuousTransformers(engine, max_in_flight=8), max_in_flight=8,
                                          upload_interval_s=0.0, check_interval_s=0.05)
            stats = schedule.run(threading.Event(), max_groups=6)
            assert stats.groups_uploaded == 6 and live.state.hub.depth() == 6
            batch = HubClient(live.url).get_batch(6, wait_s=30)
        finally:
            agent.close()
    assert len(set(batch.group_ids)) == 6 and schedule.groups.open == {}
    assert batch.completion_mask is not None and not batch.completion_mask.all()   # the calculator's text: 0
    assert agent.stats.trajectories >= 24 and agent.stats.turns >= 24
