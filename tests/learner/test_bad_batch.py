"""A batch the learner cannot train (here a token id outside its vocabulary, which a hub without the model cannot
check) is set aside, not trained and not acknowledged, instead of crashing the learner on every restart: its lease
expires as a failed delivery (the hub quarantines the group after ref_server.max_deliveries) and the rest trains."""

import time

import pytest

from shared.protocol.client import HubClient
from tests.live_server import LiveServer, make_config

from .batches import sampled_groups
from .test_publish_resume import learner_config, run_learner


@pytest.mark.slow
def test_a_batch_the_learner_cannot_train_is_set_aside_and_the_others_train(tiny_model_dir, tmp_path):
    # no model on the hub: it does not know the vocabulary
    with LiveServer(make_config(tmp_path, None, lease_timeout_s=3.0)) as live:
        client = HubClient(live.url)
        good = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=0)
        bad = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.5]], seed=1)[0]
        bad.completion_ids[0, 0] = 10_000            # the tiny model has 86 tokens: an embedding lookup would raise
        for group in (good[0], bad, good[1]):
            assert client.upload_group(group)["accepted"]
        config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, groups_per_step=1, max_steps=2)
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "cannot be trained (input_ids: token ids must be in [0, 86), got 10000)" in result.stderr
        stats = live.get("/v1/hub/stats").json()
        # the bad one is left to expire: still leased, or (on a loaded machine, the learner's exit took more than
        # the 3 s lease) already expired and queued again — never consumed
        assert stats["consumed"] == 2 and stats["leased_groups"] + stats["queue_depth"] == 1, stats
        time.sleep(3.5)                              # past the lease: the next lease request finds it expired
        again = client.get_batch(1)
        assert again.group_ids == [bad.group_id]
        assert live.state.hub.queue.counters.lease_expired == 1
