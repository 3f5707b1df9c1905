"""The probe's case (issue 22): a learner waits for groups longer than the hub's lease timeout (the generators are
down), then dies before its next checkpoint. Its trained, not yet checkpointed batch must survive: the lease is
renewed while it waits, and once the learner is gone the groups come back to the resumed learner. A real hub
process (uvicorn on 127.0.0.1, 2 s leases) and real ``grpo learner`` processes; bounded in time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests import service_forks as forks
from tests.faults.test_delivery_faults import ENV, GRPO, _learner_config, client, hub  # noqa: F401 - fixture
from tests.ref_server.helpers import make_group

LEASE_S = 2.0


@pytest.mark.slow
def test_a_learner_starved_past_the_lease_timeout_then_killed_loses_and_repeats_nothing(hub, tmp_path,  # noqa: F811
                                                                                         tiny_model_dir):
    h = hub(lease_timeout_s=LEASE_S, max_staleness=1000)  # all groups are version 0: never stale here
    groups = [make_group(seed=i) for i in range(10)]
    uploader = client(h.url)
    for group in groups[:6]:  # three steps of 2 groups; checkpoints every 2 steps: step 3 is trained, not saved
        uploader.upload_group(group)
    log = open(tmp_path / "learner.log", "w")
    config = str(_learner_config(tmp_path, h.url, tiny_model_dir, 5))
    first = forks.popen([GRPO, "learner", "--config", config], env=ENV, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) == 3):
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "learner.log").read_text()[-3000:]
        time.sleep(0.1)
    time.sleep(4 * LEASE_S)  # the generators are down: the learner waits for groups, four lease timeouts long
    stats = h.stats()
    assert first.poll() is None
    # the step-3 batch is still leased to the waiting learner (renewed, marked trained), nothing expired
    assert stats["lease_expired"] == 0 and stats["leased_groups"] == 2 and stats["consumed"] == 4, stats
    os.killpg(first.pid, signal.SIGKILL)  # it dies before the checkpoint that would have held step 3
    first.wait(timeout=30)
    assert int(sorted((tmp_path / "ckpt").glob("step*/COMPLETE"))[-1].parent.name[4:]) == 2
    time.sleep(1.5)  # its last long-poll (batch_wait_s 1) ends on the hub: a take outlives a killed client
    for group in groups[6:]:  # the generators come back
        uploader.upload_group(group)
    resumed = forks.run([GRPO, "learner", "--resume", "--config", config], env=ENV, stdout=log,
                             stderr=subprocess.STDOUT, timeout=300)
    log.close()
    assert resumed.returncode == 0, (tmp_path / "learner.log").read_text()[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records[3:]] == [3, 4, 5]  # from the step-2 checkpoint
    assert all(r["duplicate_groups"] == 0 for r in records)
    final = sorted((tmp_path / "ckpt").glob("step*/COMPLETE"))[-1].parent
    trained = [g for p in final.glob("consumed-rank*.json") for g in json.loads(p.read_text())]
    assert len(trained) == len(set(trained)) == 10 and set(trained) == {g.group_id for g in groups}
    stats = h.stats()
    assert stats["consumed"] == 10 and stats["queue_depth"] == 0 and stats["leased_groups"] == 0
    assert stats["lease_expired"] == 2  # only the killed learner's step-3 batch came back
