"""Adapter-only versions (``learner.lora.publish: adapter``) over a process group and CUDA IPC: the header says the
kind, the buffers are the adapter's size, the transformers engine applies the adapter onto its base, and a member
never copies one kind of version as the other."""

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from generator.engines.hf import TransformersEngine, WeightLoadError
from learner.lora import adapter_parameters
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.weight_sync_messages import JoinRequest, MemberPoll
from shared.weight_sync import groups
from shared.weight_sync.group_receiver import GroupReceiver, TransferRefused, check_layout_fits
from shared.weight_sync.layout import KIND_ADAPTER, KIND_FULL, Layout, bucket_ranges
from shared.weight_sync.params import (
    adapted_base_weights,
    adapter_metadata,
    adapter_tensors,
    iter_parameters,
    policy_tensors,
)
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_lora_publish import logprobs, lora_model, randomize

TIMEOUT_S = 10.0


# -- the header ------------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(version=st.integers(0, 2**62), kind=st.sampled_from([KIND_FULL, KIND_ADAPTER]),
       scaling=st.floats(allow_nan=False), ipc=st.booleans())
def test_the_version_header_carries_the_kind_and_the_exact_scaling(version, kind, scaling, ipc):
    header = groups.VersionHeader(version, 12345, 4096, 77, ipc, kind, scaling)
    back = groups.VersionHeader.from_tensor(header.to_tensor())
    assert back == header and back.scaling.hex() == float(scaling).hex()  # bit for bit (-0.0, 1/3, inf)


def test_a_header_of_an_unknown_kind_is_a_clear_error():
    tensor = groups.VersionHeader(1, 8, 8, 0, False).to_tensor()
    tensor[6] = 7
    with pytest.raises(ConnectionError, match=r"weight-sync header has kind 7, expected one of \[0, 1\]"):
        groups.VersionHeader.from_tensor(tensor)


# -- a real gloo group in this process: the learner's side in a thread, the engine's the real one -----------------
def flat(tensors) -> tuple[Layout, torch.Tensor]:
    """The publisher's layout and send buffer of ``tensors`` (:class:`shared.weight_sync.params.PolicyTensor`)."""
    layout = Layout.build([(t.name, t.shape) for t in tensors], torch.float32)
    buffer = torch.cat([t.compute().detach().float().reshape(-1) for t in tensors]).view(torch.uint8).clone()
    assert buffer.numel() == layout.total_bytes
    return layout, buffer


class LearnerEnd:
    """Rank 0 of a group with one engine, serving versions as the sender's member link does (members.py)."""

    def __init__(self, layout: Layout, bucket_bytes: int, metadata: dict | None = None) -> None:
        self.store = groups.host_store("127.0.0.1", 2, TIMEOUT_S)
        self.address = groups.store_address("127.0.0.1", self.store.port)
        self.offer = {"member_id": "m", "group_id": self.address, "host": "127.0.0.1", "port": self.store.port,
                      "world_size": 2, "first_rank": 1, "backend": "gloo", "transport": "collective",
                      "relay_version": None, "bucket_bytes": bucket_bytes, "timeout_s": TIMEOUT_S,
                      "ipc_handle": None, "layout": layout.to_json(), "metadata": metadata}
        self.pool = ThreadPoolExecutor(1)
        self.group = None

    def connect(self, join) -> None:
        """``join()`` is the engine's side (it blocks until the group formed)."""
        future = self.pool.submit(groups.build_group, self.store, self.address, 0, 2, "gloo", TIMEOUT_S)
        join(self.offer)
        self.group = future.result(TIMEOUT_S * 2)

    def serve(self, buffer: torch.Tensor, header: groups.VersionHeader):
        def run() -> bool:
            works = [groups.start_broadcast(self.group, header.to_tensor())]
            works += [groups.start_broadcast(self.group, buffer[b:e])
                      for b, e in bucket_ranges(header.total_bytes, header.bucket_bytes)]
            flag, agreement = groups.start_agreement(self.group, True, torch.device("cpu"))
            for work in works + [agreement]:
                groups.finish(work, TIMEOUT_S)
            return bool(flag.item() == 1)
        return self.pool.submit(run)

    def close(self) -> None:
        groups.close_group(self.group)
        self.group = None
        self.pool.shutdown()


def adapter_header(layout, version, bucket_bytes, scaling, kind=KIND_ADAPTER) -> groups.VersionHeader:
    return groups.VersionHeader(version, layout.total_bytes, bucket_bytes, layout.fingerprint(), False, kind, scaling)


def test_an_adapter_version_over_a_group_is_applied_onto_the_base_in_adapter_sized_buffers(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    first = lora_model(tiny_model_dir, seed=1)
    tensors, scaling = adapter_tensors(first)
    layout, buffer = flat(tensors)
    full_bytes = sum(p.numel() * 4 for p in engine.model.parameters())
    assert layout.kind == KIND_ADAPTER and layout.total_bytes == sum(p.numel() * 4 for _, p in adapter_parameters(first))
    learner = LearnerEnd(layout, 256 * 2**20, adapter_metadata(scaling, adapted_base_weights(first)))
    try:
        learner.connect(engine.connect_weight_group)
        served = learner.serve(buffer, adapter_header(layout, 1, 256 * 2**20, scaling))
        assert engine.receive_weight_version() == 1 and served.result(TIMEOUT_S)
        receiver = engine._weight_group
        # buffers sized for the adapter (one bucket: the whole adapter), not the model's 256 MiB bucket or weights
        assert [b.numel() for b in receiver.buffers] == [layout.total_bytes] * 2
        assert receiver.bytes_received == layout.total_bytes < 0.2 * full_bytes
        merged = dict(iter_parameters(first))
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, merged.get(name, base[name])), name
        # the next version in small buckets (tensors spanning buckets), another adapter: onto the base, not onto
        # version 1's merged weights
        second = lora_model(tiny_model_dir, seed=2)
        layout2, buffer2 = flat(adapter_tensors(second)[0])
        assert layout2 == layout
        served = learner.serve(buffer2, adapter_header(layout, 2, 4096, scaling))
        assert engine.receive_weight_version() == 2 and served.result(TIMEOUT_S)
        merged = dict(iter_parameters(second))
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, merged.get(name, base[name])), name
        assert receiver.bytes_received == 2 * layout.total_bytes
    finally:
        engine.disconnect_weight_group()
        learner.close()


def test_a_member_refuses_a_version_of_the_other_kind_and_stays_in_step(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    lora = lora_model(tiny_model_dir, seed=3)
    adapter_layout, adapter_buffer = flat(adapter_tensors(lora)[0])
    full_layout, full_buffer = flat(policy_tensors(lora))  # the merged policy
    # a member that joined on the full layout, sent an adapter version
    learner = LearnerEnd(full_layout, 8192)
    try:
        learner.connect(engine.connect_weight_group)
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        served = learner.serve(adapter_buffer, adapter_header(adapter_layout, 1, 8192, 3.0))
        with pytest.raises(TransferRefused, match=r"version 1 refused: it holds lora_adapter weights and this member "
                           r"joined on a full layout"):
            engine.receive_weight_version()
        assert served.result(TIMEOUT_S) is False  # the learner hears "refused"
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, before[name]), name
        # every byte was drained: the next (full) version goes through the same group
        served = learner.serve(full_buffer, groups.VersionHeader(2, full_layout.total_bytes, 8192,
                                                                 full_layout.fingerprint(), False))
        assert engine.receive_weight_version() == 2 and served.result(TIMEOUT_S)
        merged = dict(iter_parameters(lora))
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, merged[name]), name
    finally:
        engine.disconnect_weight_group()
        learner.close()
    # a member that joined on the adapter layout, sent full weights
    engine = TransformersEngine(tiny_model_dir)
    learner = LearnerEnd(adapter_layout, 8192, adapter_metadata(3.0))
    try:
        learner.connect(engine.connect_weight_group)
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        served = learner.serve(full_buffer, groups.VersionHeader(1, full_layout.total_bytes, 8192,
                                                                 full_layout.fingerprint(), False))
        with pytest.raises(TransferRefused, match=r"it holds full weights and this member joined on a lora_adapter "
                           r"layout"):
            engine.receive_weight_version()
        assert served.result(TIMEOUT_S) is False
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, before[name]), name
        assert engine._weight_group.buffers[0].numel() == 8192  # the sender's bucket, drained
    finally:
        engine.disconnect_weight_group()
        learner.close()


def test_an_engine_that_cannot_apply_adapters_refuses_them_with_the_reason(tiny_model_dir):
    """The hook for engines without adapters over a group (the vLLM worker extension passes no apply_adapter)."""
    lora = lora_model(tiny_model_dir, seed=4)
    tensors, scaling = adapter_tensors(lora)
    layout, buffer = flat(tensors)
    learner = LearnerEnd(layout, 4096, adapter_metadata(scaling))
    holder = {}
    try:
        learner.connect(lambda offer: holder.update(receiver=GroupReceiver(offer, 1, torch.device("cpu"))))
        served = learner.serve(buffer, adapter_header(layout, 1, 4096, scaling))
        with pytest.raises(TransferRefused, match=r"it is a LoRA adapter \(learner.lora.publish: adapter\) and this "
                           r"engine cannot apply adapters"):
            holder["receiver"].receive(lambda stream: pytest.fail("an adapter handed to the full-weights path"))
        assert served.result(TIMEOUT_S) is False
    finally:
        holder["receiver"].close()
        learner.close()


def test_an_adapter_layout_is_checked_against_the_model_when_joining(tiny_model_dir):
    engine = TransformersEngine(tiny_model_dir)
    layout = Layout.build([(t.name, t.shape) for t in adapter_tensors(lora_model(tiny_model_dir, seed=5))[0]],
                          torch.float32)
    assert check_layout_fits(engine.model, layout, engine._adapters) is None
    assert "the learner publishes LoRA adapters (learner.lora.publish: adapter) and this engine cannot apply them" \
        == check_layout_fits(engine.model, layout)
    rows = layout.to_json()
    rows[1][2] = [rows[1][2][0] + 1, rows[1][2][1]]  # lora_B of the first layer: one row too many
    wrong = Layout.from_json(rows)
    with pytest.raises(WeightLoadError, match=r"the learner's weights do not fit this model: layer "
                       r"'model\.layers\.0\.[a-z_.]+': lora_A \[8, \d+\] / lora_B \[\d+, 8\] do not fit"):
        engine.connect_weight_group({"layout": wrong.to_json(), "first_rank": 1})
    unknown = Layout.from_json([["model.layers.9.self_attn.q_proj.lora_A.weight", "F32", [8, 4]],
                                ["model.layers.9.self_attn.q_proj.lora_B.weight", "F32", [4, 8]]])
    assert "layer 'model.layers.9.self_attn.q_proj' is not in the model" in check_layout_fits(
        engine.model, unknown, engine._adapters)


# -- end to end: a live hub, the learner's publisher, generators joining through the hub ------------------------
CFG = dict(transport="collective", bucket_mb=0.01, timeout_s=5.0, join_timeout_s=30.0, poll_s=0.2)


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2))


class RelayOnlyEngine(TransformersEngine):
    """An engine that joins groups but takes adapters from the relay only (as the vLLM engine does)."""

    weight_group_adapters = False


def sync_until(receiver, have, version, timeout_s=30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while have < version:
        assert time.monotonic() < deadline, f"{receiver.generator_id} stuck at version {have}"
        have = receiver.sync(have) or have
        time.sleep(0.02)
    return have


def wait_for(condition, timeout_s=20.0) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - started


class StuckMember:
    """A generator that joins, connects, asks for a version, takes its header and then takes nothing more (a
    process hung mid-version)."""

    def __init__(self, url: str) -> None:
        self.client = client(url)
        self.member = self.client.sync_join(JoinRequest(generator_id="stuck", transport="collective", workers=1))
        self.receiver = None
        deadline = time.monotonic() + 30
        while self.receiver is None:
            assert time.monotonic() < deadline, "the stuck member never got an offer"
            answer = self.client.sync_poll(self.member, MemberPoll(version=0, wait_s=0.5))
            if answer.action == "connect":
                self.receiver = GroupReceiver(answer.offer.model_dump(mode="json"), 1, torch.device("cpu"))

    def take_header_and_hang(self, have: int) -> int:
        deadline = time.monotonic() + 30
        while self.client.sync_poll(self.member, MemberPoll(version=have, wait_s=0.5)).action != "receive":
            assert time.monotonic() < deadline, "never told to receive"
        self.receiver._ask()
        header = torch.zeros(groups.HEADER_LEN, dtype=torch.int64)
        groups.broadcast(self.receiver.group, header, 10)
        return groups.VersionHeader.from_tensor(header).version


@pytest.mark.slow
def test_a_learner_publishing_adapters_serves_a_generator_through_its_group(tiny_model_dir, tmp_path):
    learner = lora_model(tiny_model_dir, seed=11)
    with LiveServer(make_config(tmp_path)) as live:
        publisher = WeightPublisher(learner, lambda: client(live.url), WeightSyncConfig(**CFG), rank=0, world=1,
                                    device=torch.device("cpu"), relay_version=None, adapter_only=True)
        stuck = None
        try:
            assert publisher.sender.groups_enabled and publisher.layout.kind == KIND_ADAPTER
            adapter_bytes = sum(p.numel() * 4 for _, p in adapter_parameters(learner))
            assert publisher.layout.total_bytes == adapter_bytes
            assert publisher.sender.buffer.numel() == adapter_bytes  # the learner's send buffer, too
            gen = TransformersEngine(tiny_model_dir)
            receiver = WeightReceiver(gen, client(live.url), WeightSyncConfig(**CFG), "gen", tmp_path / "gen")
            relay_gen = RelayOnlyEngine(tiny_model_dir)
            relay_receiver = WeightReceiver(relay_gen, client(live.url), WeightSyncConfig(**{**CFG, "transport": "auto"}),
                                            "relay-gen", tmp_path / "relay-gen")
            have = relay_have = 0
            wait_for(lambda: (receiver.sync(have), receiver.connected)[1])
            full_bytes = sum(p.numel() * 4 for p in gen.model.parameters())
            for version in (1, 2, 3):
                if version > 1:
                    randomize(learner, seed=100 + version)  # the learner trained on
                assert publisher.sender.wait_idle(20)
                publisher.publish(version)
                have = sync_until(receiver, have, version)
                relay_have = sync_until(relay_receiver, relay_have, version)
                assert (logprobs(gen.model) - logprobs(learner)).abs().max() <= 1e-5
                assert (logprobs(relay_gen.model) - logprobs(learner)).abs().max() <= 1e-5
                wait_for(lambda v=version: publisher.sender.counters.served == v)
                # bytes through the group per version: the adapter's, not the model's
                assert publisher.sender.counters.group_bytes_sent == version * adapter_bytes < 0.2 * full_bytes * version
                assert gen._weight_group.bytes_received == version * adapter_bytes
            assert receiver.transport == "collective" and receiver.failed_receives == 0
            assert relay_receiver.transport == "http"  # the hook: no adapters over its group, so the relay
            # a member that hangs mid-version costs the sender one timeout, then it is dropped
            stuck = StuckMember(live.url)
            wait_for(lambda: publisher.sender.counters.members == 2)
            randomize(learner, seed=104)
            assert publisher.sender.wait_idle(20)
            publisher.publish(4)
            assert stuck.take_header_and_hang(0) == 4
            have = sync_until(receiver, have, 4)
            dropped_after = wait_for(lambda: publisher.sender.counters.dropped == 1, timeout_s=CFG["timeout_s"] + 10)
            assert dropped_after <= CFG["timeout_s"] + 5
            assert publisher.sender.counters.members == 1
            randomize(learner, seed=105)
            assert publisher.sender.wait_idle(20)
            publisher.publish(5)
            have = sync_until(receiver, have, 5)
            assert (logprobs(gen.model) - logprobs(learner)).abs().max() <= 1e-5
        finally:
            if stuck is not None:
                stuck.receiver.close()
            publisher.close()


# -- CUDA IPC (skipped without CUDA): the adapter buffer's handle, read by an engine in another process ----------
def ipc_generator(url: str, model_dir: str, out: str, versions: int) -> None:
    """The generator process of the CUDA IPC test: joins over IPC, syncs ``versions`` versions, saves its weights."""
    engine = TransformersEngine(model_dir, device="cuda:0")
    receiver = WeightReceiver(engine, client(url), WeightSyncConfig(**{**CFG, "transport": "ipc", "timeout_s": 30}),
                              "ipc-gen", Path(out).parent / "ipc-gen")
    have = sync_until(receiver, 0, versions, timeout_s=120)
    assert receiver.transport == "ipc", receiver.transport
    save_file({n: p.detach().cpu().contiguous() for n, p in engine.model.named_parameters()}, out)
    print("DONE", have, engine._weight_group.bytes_received, flush=True)
    receiver.close()


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_an_adapter_version_reaches_an_engine_on_the_learners_gpu_through_cuda_ipc(tiny_model_dir, tmp_path):
    learner = lora_model(tiny_model_dir, seed=21).to("cuda:0")
    with LiveServer(make_config(tmp_path)) as live:
        publisher = WeightPublisher(learner, lambda: client(live.url), WeightSyncConfig(**{**CFG, "transport": "ipc",
                                                                                          "timeout_s": 30}),
                                    rank=0, world=1, device=torch.device("cuda:0"), relay_version=None,
                                    adapter_only=True)
        out = tmp_path / "served.safetensors"
        root = str(Path(__file__).resolve().parents[2])
        proc = subprocess.Popen([sys.executable, __file__, live.url, str(tiny_model_dir), str(out), "1"],
                                stdout=subprocess.PIPE, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
        try:
            assert publisher.sender.buffer.is_cuda
            assert publisher.sender.buffer.numel() == sum(p.numel() * 4 for _, p in adapter_parameters(learner))
            wait_for(lambda: publisher.sender.counters.members == 1, timeout_s=60)
            publisher.publish(1)
            done = next((line.split() for line in proc.stdout if line.startswith("DONE")), None)
            assert done == ["DONE", "1", "0"]  # version 1, no broadcast bytes: it read the learner's buffer
            assert proc.wait(60) == 0
            served = load_file(str(out))
            merged = {n: v for n, v in iter_parameters(learner)}
            for name, value in served.items():
                if name in merged:
                    assert torch.allclose(value, merged[name], atol=1e-6, rtol=0), name
            assert publisher.sender.counters.group_bytes_sent == 0 and publisher.sender.counters.served == 1
        finally:
            proc.kill()
            publisher.close()


if __name__ == "__main__":  # the generator process of the CUDA IPC test
    ipc_generator(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
