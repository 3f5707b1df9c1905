"""A relay version deleted while a generator downloads it (the learner published newer ones, or the hub prunes at
shutdown): a 404 the generator handles (it reads the current version again) or the whole file, never a 500. The chaos
run (test_chaos_run.py) counts every 5xx of the hub; this is the race it can hit, provoked on a real server: the
relay's own pruning runs between the route's lookup of the version and its answer."""

from __future__ import annotations

import io

import pytest
import requests
import torch
from safetensors.torch import save

from shared.protocol.client import HubClient, HubError, RetryPolicy
from tests.faults.services import _SERVER_ERRORS
from tests.live_server import LiveServer, make_config

pytestmark = pytest.mark.slow  # a live hub in every test


class Sized(io.BytesIO):
    def __len__(self) -> int:
        return len(self.getvalue())


def weights(version: int, numel: int) -> bytes:
    return save({"w": torch.full((numel,), float(version))})


def server_errors(live: LiveServer) -> float:
    return sum(float(n) for n in _SERVER_ERRORS.findall(live.get("/metrics").text))


def prune_after_lookup(store) -> list[int]:
    """The store's ``path_for`` finds the version, then the relay keeps only its newest version (its real pruning),
    once: the window between the route's lookup and its answer, made certain. Returns the versions looked up."""
    looked_up, original = [], store.path_for

    def path_for(version: int):
        path = original(version)
        looked_up.append(version)
        if len(looked_up) == 1:
            store.keep_newest()
        return path

    store.path_for = path_for
    return looked_up


def test_a_version_pruned_between_its_lookup_and_its_answer_is_a_404_not_a_500(tmp_path):
    with LiveServer(make_config(tmp_path, keep_weight_versions=2)) as live:
        client = HubClient(live.url, retry=RetryPolicy(max_retry_s=2, initial_backoff_s=0.05, max_backoff_s=0.2))
        for version in (1, 2):
            client.upload_weights_stream(version, Sized(weights(version, 1000)))
        looked_up = prune_after_lookup(live.state.weights)
        with pytest.raises(HubError) as refused:
            client.download_weights(1, tmp_path / "v1.safetensors")
        assert refused.value.status == 404 and "weights version 1 is not available (current: 2)" in str(
            refused.value.detail)
        assert looked_up == [1] and not (tmp_path / "v1.safetensors").exists()
        # the current version still downloads whole, and the hub counted no server error
        assert client.download_weights(2, tmp_path / "v2.safetensors").read_bytes() == weights(2, 1000)
        assert server_errors(live) == 0


def test_a_version_pruned_while_it_is_sent_is_sent_whole(tmp_path):
    data = weights(1, 2**19)  # 2 MiB: three chunks, most still unsent when the file is deleted
    with LiveServer(make_config(tmp_path, keep_weight_versions=2)) as live:
        client = HubClient(live.url, retry=RetryPolicy(max_retry_s=2, initial_backoff_s=0.05, max_backoff_s=0.2))
        for version in (1, 2):
            client.upload_weights_stream(version, Sized(weights(version, 2**19)))
        with requests.get(f"{live.url}/v1/weights/1", stream=True, timeout=30) as answer:
            assert answer.status_code == 200 and int(answer.headers["content-length"]) == len(data)
            first = answer.raw.read(4096)
            live.state.weights.keep_newest()
            assert not (tmp_path / "weights" / "v0000000001.safetensors").exists()
            assert first + answer.raw.read() == data
        assert live.get("/v1/weights/1").status_code == 404  # gone for whoever asks next
        assert server_errors(live) == 0
