"""A generator told about a weights version that is gone when it asks for it (issue 22): it re-reads the hub's
current version and syncs to that, never exits, and counts it. On a live hub (uvicorn on 127.0.0.1) with the tiny
model: a version pruned between the generator's two requests, a group offer naming a version the relay never held
(a restarted learner that took its reported version for the relay's), and a hub whose versions moved back below
the generator's (restarted without its relay)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from generator.engines.hf import TransformersEngine
from generator.stats import LoopStats
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import HubClient, RetryPolicy
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_weight_sync import CFG, learner_model  # noqa: F401

pytestmark = pytest.mark.slow  # a live hub in every test
HTTP = WeightSyncConfig(transport="http", timeout_s=5.0, poll_s=0.2)


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05, max_backoff_s=0.2))


def weights_of(model, shift: float) -> bytes:
    return save({n: (p.detach() + shift).contiguous() for n, p in model.named_parameters()})


def first_weight(engine) -> torch.Tensor:
    return next(iter(engine.model.parameters())).detach().clone()


class RacingClient(HubClient):
    """A real client whose first answer to "which version is current" is overtaken by the learner: two newer
    versions land (the relay keeps one) before the generator downloads the version it was told about."""

    def __init__(self, url: str, publish) -> None:
        super().__init__(url, retry=RetryPolicy(max_retry_s=5, initial_backoff_s=0.05, max_backoff_s=0.2))
        self.publish = publish

    def weights_version(self) -> int | None:
        answer = super().weights_version()
        if self.publish is not None:
            publish, self.publish = self.publish, None
            publish()
        return answer


def test_a_version_pruned_before_its_download_sends_the_generator_to_the_current_one(tmp_path, tiny_model,
                                                                                     tiny_model_dir):
    with LiveServer(make_config(tmp_path, keep_weight_versions=1)) as live:
        learner = client(live.url)
        learner.upload_weights_stream(1, _stream(weights_of(tiny_model, 1.0)))
        racing = RacingClient(live.url, lambda: [learner.upload_weights_stream(v, _stream(weights_of(tiny_model, v)))
                                                 for v in (2, 3)])
        stats = LoopStats()
        engine = TransformersEngine(tiny_model_dir)
        receiver = WeightReceiver(engine, racing, HTTP, "gen", tmp_path / "gen", stats=stats)
        assert receiver.sync(0) == 3   # told 1, which was pruned: re-read, loaded 3
        assert receiver.vanished_versions == 1 and stats.weight_versions_vanished == 1
        expected = next(iter(tiny_model.parameters())).detach() + 3.0
        assert torch.equal(first_weight(engine), expected)


def test_an_offer_naming_a_version_the_relay_never_held_loads_the_relays_current_and_joins(
        tmp_path, tiny_model_dir, learner_model):  # noqa: F811
    with LiveServer(make_config(tmp_path)) as live:
        hub = client(live.url)
        hub.upload_weights_stream(1, _stream(weights_of(learner_model, 0.0)))
        hub.report_version(5)   # the learner's reports ran ahead of the relay (versions went through groups)
        # a resumed learner's sender that took the hub's reported version for the relay's
        publisher = WeightPublisher(learner_model, lambda: client(live.url), WeightSyncConfig(**CFG), rank=0,
                                    world=1, device=torch.device("cpu"), relay_version=5)
        try:
            engine = TransformersEngine(tiny_model_dir)
            receiver = WeightReceiver(engine, client(live.url), WeightSyncConfig(**CFG), "gen", tmp_path / "gen")
            version = 0
            for _ in range(200):
                version = receiver.sync(version) or version
                if receiver.connected:
                    break
            assert receiver.connected and version == 1 and receiver.vanished_versions == 1
        finally:
            publisher.close()


def test_a_generator_follows_a_hub_that_moved_back_below_its_version(tmp_path, tiny_model, tiny_model_dir):
    first = LiveServer(make_config(tmp_path / "a"))
    with first as live:
        port = int(live.url.rsplit(":", 1)[1])
        for version in (1, 2, 3):
            client(live.url).upload_weights_stream(version, _stream(weights_of(tiny_model, float(version))))
        engine = TransformersEngine(tiny_model_dir)
        receiver = WeightReceiver(engine, client(live.url), HTTP, "gen", tmp_path / "gen")
        assert receiver.sync(0) == 3
    # the hub comes back without its relay (another weights_dir): its newest version is 1, the learner's 0
    with LiveServer(make_config(tmp_path / "b"), port=port) as live:
        client(live.url).upload_weights_stream(1, _stream(weights_of(tiny_model, 1.0)))
        assert receiver.sync(3) == 1 and receiver.moved_back == 1
        assert torch.equal(first_weight(engine), next(iter(tiny_model.parameters())).detach() + 1.0)
        assert receiver.sync(1) is None   # in step with the hub again: nothing to do


def _stream(data: bytes):
    import io

    return _Sized(io.BytesIO(data), len(data))


class _Sized:
    def __init__(self, fh, size: int) -> None:
        self.fh, self.size = fh, size

    def __len__(self) -> int:
        return self.size

    def read(self, n=-1):
        return self.fh.read(n)

    def seek(self, pos, whence=0):
        return self.fh.seek(pos, whence)

    def tell(self):
        return self.fh.tell()
