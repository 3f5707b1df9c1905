"""When the teacher goes down, and comes back (on-policy distillation, issue 42): the teacher's scorer pool follows
the reference's one rule (ref_server/scorer_pool/pool.py). Groups wait unready, never leased without the teacher's
logprobs; /healthz, /v1/hub/stats and /metrics say nobody scores the teacher and how many groups wait; the log warns
every ref_server.scorer_wait_s; a teacher scorer that joins again takes the waiting work, each group scored once and
trained once. A local teacher that fails on a group (an error, NaN logprobs) drops it like the reference does."""

import logging
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from ref_server.scorer_pool.pool import NoScorer, ScorerPool
from ref_server.scoring.scorer import Row
from shared.forward.logprobs import sequence_logprobs
from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config
from tests.ref_server.helpers import make_group
from tests.ref_server.test_scorer_pool import Clock
from tests.ref_server.test_scorer_processes import start_scorer, stop, wait_for
from tests.ref_server.test_teacher import PINNED, teacher_dir  # noqa: F401 - the teacher model, a fixture

POOL_LOG = "grpo.ref_server.pool"


def test_a_pool_with_nobody_to_score_waits_warns_every_wait_s_and_says_when_a_scorer_is_back(caplog):
    clock = Clock()
    pool = ScorerPool(local=None, vocab_size=50, lease_s=10.0, wait_s=30.0, clock=clock, reaper=False, role="teacher")
    try:
        pool.expire()
        assert pool.health() == {"scoring": "no scorer", "jobs_waiting": 0, "oldest_job_wait_s": 0.0, "down_s": 0.0}
        futures = [pool.submit([Row([1, 2, 3, 4], 2)]) for _ in range(3)]
        clock.now += 5
        with caplog.at_level(logging.WARNING, logger=POOL_LOG):
            pool.expire()          # down from here: no warning before scorer_wait_s of it
            assert pool.counters.down_warnings == 0 and not caplog.records
            clock.now += 29.9
            pool.expire()
            assert pool.counters.down_warnings == 0
            clock.now += 0.1
            pool.expire()
            assert pool.counters.down_warnings == 1
            message = caplog.records[-1].getMessage()
            assert ("no teacher scorer for 30s: 3 scoring jobs wait, the oldest for 35s" in message
                    and "grpo scorer --teacher --hub URL" in message)
            assert pool.health() == {"scoring": "no scorer", "jobs_waiting": 3, "oldest_job_wait_s": 35.0,
                                     "down_s": 30.0}
            clock.now += 30
            pool.expire()
            assert pool.counters.down_warnings == 2 and not any(f.done() for f in futures)  # waiting, not dropped
            pool.register("t-back")
            pool.expire()
            assert "a teacher scorer is back after 60s without one; it takes the 3 jobs waiting" in caplog.text
        assert pool.health()["down_s"] == 0.0 and pool.health()["scoring"] == "1 joined"
        clock.now += 100
        pool.expire()
        assert pool.counters.down_warnings == 2   # a scorer holds the pool up: no more warnings
    finally:
        pool.close()


def test_a_route_waiting_on_the_teacher_names_the_teacher():
    import asyncio

    pool = ScorerPool(local=None, vocab_size=50, wait_s=0.05, reaper=False, role="teacher")
    try:
        with pytest.raises(NoScorer, match="no teacher scorer answered within 0s .scoring: no scorer"):
            asyncio.run(pool.result(pool.submit([Row([1, 2, 3], 1)])))
    finally:
        pool.close()


@pytest.mark.parametrize("role", ["reference", "teacher"])
@pytest.mark.parametrize("failure", ["error", "nan"])
def test_a_local_model_failing_on_a_group_drops_it_by_the_same_rule(tmp_path, tiny_model_dir, teacher_dir,  # noqa: F811
                                                                    role, failure):
    from ref_server.server import build_state

    state = build_state(make_config(tmp_path, tiny_model_dir, teacher_model=str(teacher_dir), **PINNED))
    try:  # the hub's state without its HTTP front (the same intake and pools; no uvicorn in the quick tests)
        hub, local = state.hub, state.pools()[role].local
        hub.report_version(0)
        forward = local._forward

        def failing(*args):
            if failure == "error":  # what running out of memory on a single row ends as
                raise RuntimeError("CUDA out of memory (simulated)")
            return forward(*args) * float("nan")

        local._forward = failing
        hub.put(make_group(seed=1).to_bytes())
        wait_for(lambda: hub.counters.dropped_ref_failure == 1, 30, "the group to be dropped")
        assert hub.take(1, timeout=0.5) is None and hub.depth() == 0  # never leased with zeros or NaN
        assert hub.unscored() == {"reference": 0, "teacher": 0}
        local._forward = forward
        hub.put(make_group(seed=2).to_bytes())  # the model answers again: the next group trains
        batch = hub.take(1, timeout=30)
        assert batch is not None and bool(torch.isfinite(batch.teacher_logprobs).all())
        assert hub.counters.dropped_ref_failure == 1
    finally:
        state.hub.close()
        for pool in state.pools().values():
            pool.close()


def teacher_logprobs(model, group) -> list[torch.Tensor]:
    prompt = group.prompt_ids.tolist()
    out = []
    for i, n in enumerate(group.completion_lengths.tolist()):
        ids = prompt + group.completion_ids[i, :n].tolist()
        with torch.no_grad():
            out.append(sequence_logprobs(model, torch.tensor([ids]), [len(prompt)], [n]).logprobs[0, :n])
    return out


def kill_holding(scorer, process) -> set[str]:
    """SIGKILL a scorer process once the hub has leased it a job (no leave, no result); the jobs it still holds
    once a result it sent just before dying has settled: those must go back to the queue."""
    wait_for(lambda: bool(scorer.jobs), 30, f"{scorer.name} to hold a job")
    process.kill()
    process.wait(timeout=30)
    time.sleep(0.5)
    held = set(scorer.jobs)
    assert held, f"{scorer.name} held no job when killed"
    return held


def lease_all(client: HubClient, seen: dict, count: int, timeout: float, size: int = 4) -> None:
    """Lease and acknowledge batches of up to ``size`` groups until ``seen`` holds ``count`` groups (group id -> its
    rows' teacher logprobs) or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        batch = client.get_batch(min(size, count - len(seen)), wait_s=1.0)
        if batch is None:
            continue
        assert batch.teacher_logprobs is not None and bool(torch.isfinite(batch.teacher_logprobs).all())
        for g, group_id in enumerate(batch.group_ids):
            assert group_id not in seen, f"group {group_id} delivered twice"
            rows = (batch.group_index == g).nonzero().flatten().tolist()
            seen[group_id] = [batch.teacher_logprobs[r, :int(batch.completion_lengths[r])] for r in rows]
        client.ack_batches([batch.batch_id])


@pytest.mark.slow
def test_every_teacher_scorer_killed_mid_run_then_one_back(tmp_path, tiny_model_dir, teacher_dir, caplog):  # noqa: F811
    """Real `grpo scorer --teacher` processes, killed with SIGKILL while they hold jobs; ~40 s on an idle 2-core VM."""
    config = make_config(tmp_path, tiny_model_dir, teacher_model=str(teacher_dir), local_scoring=False, beta=0.0,
                         scorer_lease_s=2.0, scorer_wait_s=3.0, queue_capacity=64, max_staleness=1, **PINNED)
    caplog.set_level(logging.WARNING, logger=POOL_LOG)
    groups = [make_group(seed=i, group_size=8, prompt=tuple(range(1, 33)),
                         lengths=(200, 180, 160, 200, 190, 150, 120, 200)) for i in range(20)]
    with LiveServer(config) as live:
        pool, hub, client = live.state.teacher, live.state.hub, HubClient(live.url)
        scorers = [start_scorer(live.url, teacher_dir, name, tmp_path, "--teacher") for name in ("t-a", "t-b")]
        seen: dict[str, list[torch.Tensor]] = {}
        try:
            wait_for(lambda: pool.scorers() == 2, 300, "two teacher scorers to join")
            hub.report_version(0, groups_per_step=4)
            by_name = {s.name: s for s in pool._scorers.values()}
            # one teacher scorer killed mid-request: its jobs go to the other after its lease, none lost
            for group in groups[:8]:
                client.upload_group(group)
            held_a = kill_holding(by_name["t-a"], scorers[0])
            for group in groups[8:12]:
                client.upload_group(group)
            wait_for(lambda: not held_a & set(pool._jobs), 30, "t-b to score the jobs t-a held")
            # then the last one, mid-request too: nobody scores the teacher now
            for group in groups[12:18]:
                client.upload_group(group)
            held_b = kill_holding(by_name["t-b"], scorers[1])
            for group in groups[18:]:
                client.upload_group(group)
            wait_for(lambda: pool.scorers() == 0, 20, "the killed scorers' leases to expire")
            lease_all(client, seen, len(groups), 3, size=1)   # what was scored before the kills
            waiting = len(groups) - len(seen)
            assert waiting >= 2 and pool.counters.jobs_requeued >= len(held_a) + len(held_b)
            assert client.get_batch(1, wait_s=1.0) is None  # nothing leased without the teacher's logprobs
            health = live.get("/healthz").json()
            assert (health["teacher_scoring"], health["teacher_scoring_jobs_waiting"]) == ("no scorer", waiting)
            stats = client.hub_stats()
            assert stats["scoring_pools"]["teacher"]["groups"] == waiting == stats["queue_depth"]
            assert stats["ready"] == 0 and "reference" not in stats["scoring_pools"]
            # backpressure: the unready groups count against the generators' budget (no spinning generation)
            assert hub.budget(0)["wanted"] == max(0, 2 * 4 - waiting)
            metrics = live.get("/metrics").text
            assert "grpo_teacher_no_scorer 1.0" in metrics and f"grpo_teacher_hub_unscored_groups {waiting}.0" in metrics
            # a route asking the teacher gives up after scorer_wait_s with the reason, like the reference's
            answer = live.post("/v1/logprobs", json={"input_ids": [[1, 2, 3]], "prompt_lengths": [1], "model": "teacher"})
            assert answer.status_code == 503 and "no teacher scorer answered within 3s" in answer.json()["detail"]
            wait_for(lambda: pool.counters.down_warnings >= 1, 10, "the hub to warn that the teacher is down")
            assert "no teacher scorer for" in caplog.text and stats["dropped_ref_failure"] == 0
            scorers.append(start_scorer(live.url, teacher_dir, "t-back", tmp_path, "--teacher"))
            lease_all(client, seen, len(groups), 300)
            assert set(seen) == {g.group_id for g in groups}
            assert "a teacher scorer is back after" in caplog.text
            assert not (held_a | held_b) & set(pool._jobs)
            stats = client.hub_stats()
            assert (stats["accepted"], stats["consumed"], stats["dropped_ref_failure"]) == (20, 20, 0)
            assert stats["scoring_pools"]["teacher"] == {"scoring": "1 joined", "jobs_waiting": 0,
                                                         "oldest_job_wait_s": 0.0, "down_s": 0.0, "groups": 0}
            assert pool.counters.jobs_scored == 20 and pool.counters.jobs_given_up == 0
            model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
            for group in groups:
                for got, want in zip(seen[group.group_id], teacher_logprobs(model, group)):
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
            assert stop(scorers[-1]) == 0
        finally:
            client.close()
            for process in scorers:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=30)


def test_the_learner_says_what_the_hub_s_groups_wait_for():
    from learner.prefetch import scoring_waits

    stats = {"scoring_pools": {"reference": {"groups": 0, "scoring": "1 joined", "down_s": 0.0},
                               "teacher": {"groups": 12, "scoring": "no scorer", "down_s": 41.4}}}
    assert scoring_waits(stats) == "; 12 wait for the teacher's logprobs (no scorer for 41s)"
    stats["scoring_pools"]["teacher"].update(scoring="1 joined", down_s=0.0)
    assert scoring_waits(stats) == "; 12 wait for the teacher's logprobs (scoring: 1 joined)"
    assert scoring_waits({}) == ""   # an older hub
