"""Generators that share one ``generator.weights_dir`` (every generator of a run does: ``<run_dir>/generator/weights``)
download the relay's versions side by side without touching each other's files: found by the chaos run, where two
generators syncing at once renamed each other's partial download and read a file the other was still writing."""

import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import HubClient, RetryPolicy
from shared.weight_sync.download_dir import DownloadDir
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config

VERSIONS = 12


def dead_pid() -> int:
    """A pid no process has now (counting down from the kernel's largest)."""
    pid = int(open("/proc/sys/kernel/pid_max").read()) - 1
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid -= 1


def test_a_receiver_clears_its_own_files_and_those_of_dead_processes_only(tmp_path):
    mine, other = DownloadDir(tmp_path), DownloadDir(tmp_path)
    assert mine.path_for(3) != other.path_for(3)
    for path in (mine.path_for(3), mine.path_for(4), other.path_for(3)):
        path.write_bytes(b"x")
    host = mine.host
    dead = tmp_path / f"v{5:010d}.{host}-{dead_pid()}-0.safetensors"
    dead_partial = tmp_path / f"v{5:010d}.{host}-{dead_pid()}-0.safetensors.k2j4.partial"
    remote = tmp_path / f"v{5:010d}.another-host-1-0.safetensors"   # a process on another node sharing the folder
    unrelated = tmp_path / "notes.txt"
    for path in (dead, dead_partial, remote, unrelated):
        path.write_bytes(b"x")
    mine.clear()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([other.path_for(3).name, remote.name, "notes.txt"])


def publish_versions(url: str, model_dir, tmp_path, stop: threading.Event) -> None:
    """Versions 1..VERSIONS on the relay, one every ~30 ms: every weight of version v is v / 100."""
    state = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
             if k != "lm_head.weight"}
    hub = HubClient(url)
    for version in range(1, VERSIONS + 1):
        if stop.is_set():
            return
        path = tmp_path / f"publish-{version}.safetensors"
        save_file({k: torch.full_like(v, version / 100) for k, v in state.items()}, str(path))
        hub.upload_weights(version, path)
        time.sleep(0.03)


@pytest.mark.slow
def test_generators_sharing_a_weights_dir_each_load_every_version_they_download(tiny_model_dir, tmp_path):
    shared_dir = tmp_path / "generator-weights"
    with LiveServer(make_config(tmp_path)) as live:
        retry = RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2)
        receivers = [WeightReceiver(TransformersEngine(tiny_model_dir), HubClient(live.url, retry=retry),
                                    WeightSyncConfig(transport="http"), f"gen-{i}", shared_dir) for i in range(3)]
        errors: list[BaseException] = []
        stop = threading.Event()

        def follow(receiver: WeightReceiver) -> None:
            version, deadline = 0, time.monotonic() + 60
            try:
                while version < VERSIONS and time.monotonic() < deadline:
                    latest = receiver.sync(version)   # what the rollout loop calls between engine steps
                    version = latest if latest is not None else version
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the test's thread
                errors.append(exc)
                stop.set()

        threads = [threading.Thread(target=follow, args=(r,)) for r in receivers]
        for thread in threads:
            thread.start()
        publish_versions(live.url, tiny_model_dir, tmp_path, stop)
        for thread in threads:
            thread.join(timeout=90)
    assert errors == []
    for receiver in receivers:   # each one ended on the last version, whole: every weight is its value
        weight = receiver.engine.model.state_dict()["model.norm.weight"]
        assert torch.equal(weight, torch.full_like(weight, VERSIONS / 100)), receiver.generator_id
    assert list(shared_dir.iterdir()) == []   # nothing kept: each cleared its own files
