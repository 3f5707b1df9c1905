"""What an agent's generator does with the episodes it is driving when it stops or is killed: a stop drops each
group with an unfinished episode whole (counted) and keeps the finished ones; the journal of the episodes being
driven lets the next generator count what a killed one lost. Real processes killed: tests/e2e/test_agent_kill.py."""

from __future__ import annotations

import threading

import pytest
import requests

from generator.agent.journal import EpisodeJournal, claim_orphans
from generator.agent.runner import AgentRollouts
from generator.engines.hf import TransformersEngine
from shared.config.schema.agent import AgentConfig
from shared.protocol.records import SamplingParams
from tests.generator import agent_kit
from tests.generator.test_failures_cli import wait_for


def test_the_journal_of_a_dead_process_is_counted_once_and_a_live_or_closed_one_never(tmp_path):
    live = EpisodeJournal(tmp_path)
    live.opened(["a1", "a2"])
    (tmp_path / "host-1-0.open").write_text("d1\nd2\nd3\n")   # what a killed process leaves: no lock held
    (tmp_path / "host-2-0.open").write_text("")                # a killed one between batches: nothing lost
    (tmp_path / "unrelated.txt").write_text("x\n")
    assert claim_orphans(tmp_path) == {"host-1-0.open": 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.path.name, "unrelated.txt"])
    assert live.path.read_text() == "a1\na2\n" and claim_orphans(tmp_path) == {}   # the live one is held
    live.handed_on()
    live.opened(["b1"])
    assert live.path.read_text() == "b1\n"
    live.close()
    assert not live.path.exists() and claim_orphans(tmp_path) == {} and claim_orphans(tmp_path / "none") == {}


@pytest.fixture(scope="module")
def untrained_dir(tmp_path_factory):
    from deploy.demo.tiny_model import TinyModelSpec, build_tiny_model, save_model_dir

    tokenizer = agent_kit.chat_tokenizer()
    return str(save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=1)), tokenizer,
                              tmp_path_factory.mktemp("agent-untrained")))


@pytest.mark.slow
def test_a_stop_drops_groups_with_unfinished_episodes_whole_counted_and_keeps_the_finished_ones(untrained_dir,
                                                                                                  tmp_path):
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    engine = TransformersEngine(untrained_dir)
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(fn="tests.generator.agent_kit:holding_agent", port=0),
                          sampling, seed=3, journal_dir=tmp_path)
    gate, held, stop = threading.Event(), threading.Semaphore(0), threading.Event()
    agent.stopping = stop.is_set
    examples = [{"question": "ab", "reward": 0.5},
                {"question": "cd", "reward": 0.25, "gate": gate, "held": held, "urls": []},
                {"question": "ef", "reward": 0.75}]
    result = {}
    driving = threading.Thread(target=lambda: result.update(out=agent.generate(examples, [[0]] * 3, sampling, 2)))
    try:
        driving.start()
        for _ in range(2):
            assert held.acquire(timeout=60)
        wait_for(lambda: agent.book.open_count() == 2, "the other groups' rewards")   # only the held two open
        assert len(agent.journal.path.read_text().split()) == 6 and driving.is_alive()
        stop.set()
        driving.join(timeout=10)
        assert not driving.is_alive()
        prompts, groups = result["out"]
        assert [len(group) for group in groups] == [2, 0, 2] and prompts[1] == []
        assert [c.env_reward for c in groups[0] + groups[2]] == [0.5, 0.5, 0.75, 0.75]
        assert not any(c.env_failed for c in groups[0] + groups[2])
        stats = agent.stats
        assert stats.episodes_dropped == 2 and stats.env_errors == 0 and stats.trajectories == 6
        assert agent.journal.path.read_text() == ""   # the batch is handed on: nothing is being driven
        for url in examples[1]["urls"]:   # the dropped episodes are gone
            assert requests.post(url, json=1.0, timeout=10).status_code == 404
    finally:
        gate.set()
        stop.set()
        driving.join(timeout=30)
        agent.close()
    assert list(tmp_path.iterdir()) == []   # a clean close leaves no journal to count


@pytest.mark.slow
def test_a_folder_where_no_journal_can_be_kept_is_a_warning_and_the_generator_goes_on(untrained_dir, tmp_path,
                                                                                      caplog):
    sampling = SamplingParams(temperature=1.0, max_tokens=3)
    engine = TransformersEngine(untrained_dir)
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    agent = AgentRollouts(engine, engine.tokenizer, AgentConfig(fn="tests.generator.agent_kit:holding_agent", port=0),
                          sampling, seed=3, journal_dir=blocked)
    try:
        assert agent.journal is None
        assert f"the agent's episode journal cannot be kept in {blocked}" in caplog.text
        _, groups = agent.generate([{"question": "ab", "reward": 1.0}], [[0]], sampling, 2)
        assert [c.env_reward for c in groups[0]] == [1.0, 1.0]
    finally:
        agent.close()
