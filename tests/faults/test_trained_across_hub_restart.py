"""Found by the chaos run (tests/faults/test_chaos_run.py): a hub restart forgot its leases, so groups the learner
had trained and would acknowledge at its next checkpoint came back from the spool as untrained queued groups; when
the learner's version then made them stale they were dropped and counted in ``dropped_stale``, and the learner's
acknowledgement of the old batch id was ``unknown``. Leases are now kept beside the spool files and held again at
reload (ref_server/hub/leases.py), so the acknowledgement after the restart is ``acked`` and the groups consumed."""

from __future__ import annotations

import pytest

from tests.faults.test_delivery_faults import client, hub  # noqa: F401 - fixture
from tests.ref_server.helpers import make_group


@pytest.mark.slow
def test_groups_trained_before_a_hub_restart_are_counted_consumed_when_acknowledged_after_it(hub):  # noqa: F811
    h = hub(lease_timeout_s=30.0, max_staleness=1)
    hub_client = client(h.url)
    for i in range(2):
        hub_client.upload_group(make_group(seed=i, version=0))
    batch = hub_client.get_batch(2, wait_s=5)
    assert hub_client.renew_batches([batch.batch_id], trained=True) == {batch.batch_id: "renewed"}
    h.kill()  # the learner trained the batch; its checkpoint (and acknowledgement) comes after the restart
    h.start()
    assert hub_client.get_batch(2, wait_s=0, min_version=2) is None  # the learner is two versions on now
    answer = hub_client.ack_batches([batch.batch_id])  # its checkpoint holds the batch: acknowledged
    stats = h.stats()
    assert (answer[batch.batch_id], stats["consumed"], stats["dropped_stale"]) == ("acked", 2, 0), (answer, stats)
