"""An agent's generator killed and stopped mid-batch, real processes on 127.0.0.1: nothing the hub accepted is lost
or delivered twice, nothing of an unfinished episode's group is uploaded, and the episodes lost are counted.

`grpo generator` (the tiny model, an agent file the test writes) uploads to a live hub until the test makes its
agent hold the episodes it is driving (each holds after its model call, on a file, and says so with a marker file:
those episodes are provably mid-flight, tokens recorded, no reward). Then the generator is SIGKILLed; a new one on
the same config (the same ``generator.weights_dir``) counts the killed one's batch from its journal
(``episodes_dropped_at_restart``), uploads, is made to hold again and gets SIGTERM: its finished groups go, the
unfinished ones are dropped and counted (``episodes_dropped``). The agent's reward is its example's ``n``, so
each group the hub hands out says which example it came from.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from shared.protocol.client import HubClient
from tests.faults.services import Service
from tests.generator.test_cli import write_config
from tests.live_server import LiveServer, make_config

G, PROMPTS = 3, 2   # write_config's group_size and prompts_per_batch: a batch is 6 episodes

AGENT = '''import os
import pathlib
import time

import requests

HERE = pathlib.Path(__file__).parent


def run(client, example):
    """One model call; then, while the file 'hold' exists, hold the episode (a marker names it); then post the
    episode's reward (its example's n) and say so."""
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    mark = f"{os.getpid()}.{base.rsplit('/', 1)[1]}.{example['n']}"
    (HERE / "started" / mark).touch()
    client.completions.create(model="policy", prompt=example["question"], max_tokens=4)
    if (HERE / "hold").exists():
        (HERE / "held" / mark).touch()
        while (HERE / "hold").exists():
            time.sleep(0.05)
    requests.post(base + "/reward", json=float(example["n"]), timeout=30).raise_for_status()
    (HERE / "done" / mark).touch()
    return float(example["n"])
'''


def wait_for(condition, what: str, service: Service, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert service.alive(), f"the generator exited while waiting for {what}: {service.tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {service.tail()}"
        time.sleep(0.1)


class Markers:
    """The agent's marker files of one generator process: ``<pid>.<episode>.<n>`` in started/, held/, done/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("started", "held", "done"):
            (root / name).mkdir()

    def of(self, kind: str, pid: int) -> list[str]:
        return [p.name for p in (self.root / kind).glob(f"{pid}.*")]

    def settled(self, pid: int) -> bool:
        """Every episode of the process's batches has started (whole batches), and each has held or finished:
        none is between its start and one of those."""
        started, held, done = (len(self.of(kind, pid)) for kind in ("started", "held", "done"))
        return held > 0 and started % (G * PROMPTS) == 0 and started == held + done

    def held_examples(self, pid: int) -> set[int]:
        return {int(mark.rsplit(".", 1)[1]) for mark in self.of("held", pid)}


def generator_groups(batch) -> dict[str, list[int]]:
    """Generator id -> the example n of each of its groups in a leased batch (every row's reward is its n)."""
    rewards = batch.rewards.tolist()
    found: dict[str, list[int]] = {}
    for index, generator in enumerate(batch.generator_ids):
        rows = [r for r, g in zip(rewards, batch.group_index.tolist()) if g == index]
        assert len(rows) == G and len(set(rows)) == 1, rows   # a whole group, of one example
        found.setdefault(generator, []).append(int(rows[0]))
    return found


def counted(log: str, name: str) -> int:
    """The counter ``name`` on the generator's closing line (its summary dict)."""
    found = re.findall(rf"done: .*'{name}': (\d+)", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


@pytest.mark.slow
def test_a_killed_then_stopped_agent_generator_loses_and_repeats_nothing_and_counts_its_dropped_episodes(
        tmp_path, tiny_model_dir):
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"question": f"q{n}", "answer": "", "n": n}) + "\n"
                                                  for n in range(200)))
    markers, hold = Markers(tmp_path), tmp_path / "hold"
    with LiveServer(make_config(tmp_path)) as live:
        counters = live.state.hub.counters
        config = write_config(tmp_path, live.url, tiny_model_dir, agent=f"{{fn: {tmp_path}/agent.py:run, "
                              "timeout_s: 300}", dataset=f"{{kind: jsonl, path: {tmp_path}/tasks.jsonl}}")
        args = ["generator", "--config", str(config)]

        killed = Service("gen-killed", args, tmp_path / "gen-killed.log").start()
        try:
            wait_for(lambda: counters.accepted >= 2, "two groups uploaded", killed)
            hold.touch()
            wait_for(lambda: markers.settled(killed.proc.pid), "a batch held mid-flight", killed)
            accepted_at_kill = counters.accepted
        finally:
            killed.kill()
        held_at_kill = markers.held_examples(killed.proc.pid)
        journals = list((tmp_path / "gw" / "agent-episodes").glob("*.open"))
        assert len(journals) == 1 and len(journals[0].read_text().split()) == G * PROMPTS   # left by the kill

        hold.unlink()
        restarted = Service("gen-restarted", args, tmp_path / "gen-restarted.log").start()
        try:
            wait_for(lambda: counters.accepted >= accepted_at_kill + 2, "two groups of the restarted generator",
                     restarted)
            assert f"{G * PROMPTS} episodes of 1 generator process(es) that ended while driving them (killed) " \
                   "are dropped" in restarted.tail(100_000)
            hold.touch()
            wait_for(lambda: markers.settled(restarted.proc.pid), "a batch held mid-flight", restarted)
            accepted_at_stop = counters.accepted
        finally:
            status = restarted.stop(grace_s=60)
        held_at_stop = markers.held_examples(restarted.proc.pid)
        log = restarted.tail(100_000)
        assert status == 0, log[-3000:]
        assert not list((tmp_path / "gw" / "agent-episodes").glob("*.open"))   # claimed, then closed cleanly

        # every group the hub accepted is handed out once; the killed process's open batch never reached it
        assert counters.duplicates == 0
        total = counters.accepted
        batch = HubClient(live.url).get_batch(total, wait_s=10)
        assert batch is not None and batch.num_groups == total and len(set(batch.group_ids)) == total
        assert HubClient(live.url).get_batch(1, wait_s=0) is None
    groups = generator_groups(batch)
    assert len(groups) == 2   # one id per process (host-pid)
    killed_groups, restarted_groups = (groups[g] for g in sorted(groups, key=batch.generator_ids.index))
    assert len(killed_groups) == accepted_at_kill and not held_at_kill & set(killed_groups)
    assert len(held_at_kill) >= 1 and counted(log, "episodes_dropped_at_restart") == G * PROMPTS

    # the stop: the held batch's finished groups were uploaded, each group with a held episode was dropped whole
    unfinished = len(held_at_stop)   # examples with a held episode (one group each)
    assert not held_at_stop & set(restarted_groups)
    assert len(killed_groups) + len(restarted_groups) == total
    assert len(restarted_groups) == accepted_at_stop - accepted_at_kill + PROMPTS - unfinished
    assert counted(log, "episodes_dropped") == G * unfinished >= G
    assert f"stopping: {unfinished} of {PROMPTS} groups of this batch have unfinished episodes" in log
    assert "Traceback" not in log
