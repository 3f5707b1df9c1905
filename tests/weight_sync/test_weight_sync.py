"""Weight sync on CPU for real: a real hub (uvicorn), the learner's publisher + sender threads, transformers
generators receiving through gloo groups, a subprocess receiver killed mid-transfer."""

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import HubClient, RetryPolicy
from shared.protocol.weight_sync_messages import SenderWork
from shared.weight_sync.publisher import WeightPublisher
from shared.weight_sync.receiver import WeightReceiver, WeightSyncError
from tests.live_server import LiveServer, make_config

pytestmark = pytest.mark.slow  # every test runs a live hub (LiveServer); one a subprocess receiver

# ~50 KiB buckets: the tiny model's 192 x 192 projections (144 KiB) span several buckets
CFG = dict(transport="collective", bucket_mb=0.05, timeout_s=5.0, join_timeout_s=30.0, poll_s=0.2)


def client(url: str) -> HubClient:
    return HubClient(url, retry=RetryPolicy(max_retry_s=10, initial_backoff_s=0.05, max_backoff_s=0.2))


def make_publisher(model, url, **overrides) -> WeightPublisher:
    cfg = WeightSyncConfig(**{**CFG, **overrides})
    return WeightPublisher(model, lambda: client(url), cfg, rank=0, world=1, device=torch.device("cpu"),
                           relay_version=None)


class Generator:
    """A transformers engine and its receiver, synced the way the rollout loop does it between engine calls."""

    def __init__(self, model_dir, url, name, tmp_path, **overrides) -> None:
        self.engine = TransformersEngine(model_dir)
        self.receiver = WeightReceiver(self.engine, client(url), WeightSyncConfig(**{**CFG, **overrides}), name,
                                       tmp_path / f"w-{name}")
        self.version = 0

    def sync_until(self, version: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.version < version:
            assert time.monotonic() < deadline, f"{self.receiver.generator_id} stuck at version {self.version}"
            latest = self.receiver.sync(self.version)
            if latest is not None:
                self.version = latest
            else:
                time.sleep(0.02)

    def connect(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.receiver.connected:
            assert time.monotonic() < deadline, "never connected"
            latest = self.receiver.sync(self.version)
            self.version = latest if latest is not None else self.version
            time.sleep(0.02)


def sync_all(generators, version):
    """Every generator syncs at once (the sender serves ready members in parallel); errors re-raised here."""
    with ThreadPoolExecutor(len(generators)) as pool:
        for future in [pool.submit(g.sync_until, version) for g in generators]:
            future.result(timeout=60)


def publish(publisher, version):
    """The learner's next publish, after the sender let go of the previous version. A one-worker generator
    returns from the receive before the learner's side of the completion step ends. A publish at that moment is
    skipped as busy (counted). In a run the learner's next step comes much later; here the test thread shares the
    interpreter lock with the sender's threads and would often publish within that moment."""
    assert publisher.sender.wait_idle(20), "the sender is still busy with the previous version"
    publisher.publish(version)


def perturb(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.01)


def assert_same_weights(learner, engine):
    state = dict(engine.model.named_parameters())
    for name, param in learner.named_parameters():
        assert torch.equal(param, state[name]), name


def wait_for(condition, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture
def learner_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_two_generators_hold_the_learners_weights_bit_for_bit_after_each_version(
        tiny_model_dir, learner_model, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url)
        try:
            gens = [Generator(tiny_model_dir, live.url, n, tmp_path) for n in ("gen-a", "gen-b")]
            for g in gens:
                g.connect()
            assert [g.receiver.transport for g in gens] == ["collective", "collective"]
            for version in (1, 2, 3):
                perturb(learner_model, version)
                publish(publisher, version)
                sync_all(gens, version)
                for g in gens:
                    assert g.version == version
                    assert_same_weights(learner_model, g.engine)
            counters = publisher.sender.counters
            wait_for(lambda: counters.served == 6)  # the learner's side of the last completion step
            assert counters.served == 6 and counters.dropped == 0 and counters.members == 2
            # every version went through the groups: the relay was never needed (members held groups)
            assert HubClient(live.url).weights_version() is None and counters.relay_uploads == 0
            assert counters.last_transfer_s > 0
        finally:
            publisher.close()


def test_relay_every_versions_puts_every_nth_version_on_the_relay_beside_the_group(
        tiny_model_dir, learner_model, tmp_path):
    """The evaluator reads the relay: with a generator in a group, weight_sync.relay_every_versions 2 puts versions
    2 and 4 of 1..5 there too (each a whole, downloadable file equal to the learner's), and the group still
    delivers every version."""
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url, relay_every_versions=2)
        try:
            gen = Generator(tiny_model_dir, live.url, "gen-a", tmp_path)
            gen.connect()
            assert gen.receiver.transport == "collective"
            hub, on_relay = HubClient(live.url), {}
            for version in (1, 2, 3, 4, 5):
                perturb(learner_model, version)
                publish(publisher, version)
                sync_all([gen], version)
                assert_same_weights(learner_model, gen.engine)
                assert publisher.sender.wait_idle(20)
                on_relay[version] = hub.weights_version()
                if version in (2, 4):   # the relay's file is this version's weights
                    path = hub.download_weights(version, tmp_path / f"relay-{version}.safetensors")
                    relay_state = load_file(str(path))
                    for name, param in learner_model.named_parameters():
                        if name in relay_state:
                            assert torch.equal(relay_state[name], param.detach()), name
            assert on_relay == {1: None, 2: 2, 3: 2, 4: 4, 5: 4}
            assert publisher.sender.counters.relay_uploads == 2
        finally:
            publisher.close()


def test_evaluation_while_training_sets_the_relay_cadence_unless_the_config_does():
    from shared.config.schema import GRPOConfig

    assert GRPOConfig().weight_sync.relay_every_versions is None
    derived = GRPOConfig.model_validate({"eval": {"every_steps": 5, "every_minutes": 2}})
    assert (derived.weight_sync.relay_every_versions, derived.weight_sync.relay_every_s) == (5, 120.0)
    own = GRPOConfig.model_validate({"eval": {"every_steps": 5}, "weight_sync": {"relay_every_versions": 3}})
    assert (own.weight_sync.relay_every_versions, own.weight_sync.relay_every_s) == (3, None)


def test_a_late_joiner_loads_the_current_version_over_http_then_receives_through_the_group(
        tiny_model_dir, learner_model, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url)
        try:
            early = Generator(tiny_model_dir, live.url, "early", tmp_path)
            early.connect()
            for version in (1, 2):
                perturb(learner_model, version)
                publish(publisher, version)
                sync_all([early], version)
            assert HubClient(live.url).weights_version() is None  # nobody needed the relay so far
            late = Generator(tiny_model_dir, live.url, "late", tmp_path)
            late.connect()
            # it joined at version 2, which the sender put on the relay for it and it loaded over HTTP
            assert late.version == 2 and HubClient(live.url).weights_version() == 2
            assert_same_weights(learner_model, late.engine)
            perturb(learner_model, 3)
            publish(publisher, 3)
            sync_all([early, late], 3)
            assert_same_weights(learner_model, late.engine)
            assert HubClient(live.url).weights_version() == 2  # version 3 came through the group, not the relay
            wait_for(lambda: publisher.sender.counters.served == 4)
        finally:
            publisher.close()


def test_superseded_versions_are_skipped_and_nonfinite_weights_are_never_published(
        tiny_model_dir, learner_model, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url)
        try:
            gen = Generator(tiny_model_dir, live.url, "gen", tmp_path)
            gen.connect()
            for version in (1, 2, 3):  # the generator is busy generating: it takes none of them meanwhile
                perturb(learner_model, version)
                publisher.publish(version)
                wait_for(lambda v=version: live.state.sync.announced == v)  # checked and announced, then replaced
            # versions 1 and 2 were checked, then overwritten before anyone took them
            assert publisher.sender.counters.superseded == 2 and publisher.sender.counters.published == 3
            gen.sync_until(3)
            assert_same_weights(learner_model, gen.engine)
            with torch.no_grad():
                next(learner_model.parameters())[0, 0] = float("nan")
            publish(publisher, 4)
            counters = publisher.sender.counters
            wait_for(lambda: counters.refused_nonfinite == 1)  # checked by the sender, after the learner's copy
            assert counters.published == 3
            time.sleep(0.5)
            assert live.state.sync.announced == 3 and gen.receiver.sync(3) is None  # nothing new to take
            assert publisher.metrics()["weight_sync_refused_nonfinite"] == 1.0
        finally:
            publisher.close()


def test_a_generator_given_nonfinite_weights_over_http_keeps_serving_its_version(tiny_model_dir, tmp_path, caplog):
    with LiveServer(make_config(tmp_path)) as live:
        gen = Generator(tiny_model_dir, live.url, "gen", tmp_path, transport="http")
        before = {k: v.clone() for k, v in gen.engine.model.state_dict().items()}
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        state["model.norm.weight"][3] = float("inf")
        save_file(state, str(tmp_path / "bad.safetensors"))
        HubClient(live.url).upload_weights(1, tmp_path / "bad.safetensors")
        with caplog.at_level("WARNING", logger="grpo.generator.weights"):
            assert gen.receiver.sync(0) is None and gen.receiver.sync(0) is None  # refused once, not re-fetched
        assert gen.receiver.refused_nonfinite == 1
        assert "weights version 1 holds NaN/inf (tensor model.norm.weight)" in caplog.text
        for name, value in gen.engine.model.state_dict().items():
            assert torch.equal(value, before[name]), name


def test_a_generator_killed_mid_transfer_is_dropped_within_the_timeout(tiny_model_dir, learner_model, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url, timeout_s=20.0)
        peer = subprocess.Popen([sys.executable, "-m", "tests.weight_sync.peer", live.url], stdout=subprocess.PIPE,
                                text=True)
        try:
            healthy = Generator(tiny_model_dir, live.url, "healthy", tmp_path)
            healthy.connect()
            assert peer.stdout.readline().strip() == "CONNECTED"
            wait_for(lambda: publisher.sender.counters.members == 2)
            perturb(learner_model, 1)
            publisher.publish(1)
            assert peer.stdout.readline().split() == ["RECEIVING", "1"]
            sync_all([healthy], 1)
            # the peer still holds version 1's transfer open: the next publish is skipped, not waited for
            started = time.perf_counter()
            publisher.publish(2)
            assert time.perf_counter() - started < 1.0 and publisher.sender.counters.skipped_busy == 1
            killed_at = time.monotonic()
            peer.kill()
            wait_for(lambda: publisher.sender.counters.dropped == 1, timeout_s=25)
            assert time.monotonic() - killed_at < 20.0  # a dead peer: at most the timeout (here: its socket closed)
            wait_for(lambda: live.state.sync.dropped_total == 1)  # the sender tells the hub after counting
            assert publisher.sender.counters.members == 1
            perturb(learner_model, 3)
            publisher.publish(3)  # the sender goes on with the members left
            sync_all([healthy], 3)
            assert_same_weights(learner_model, healthy.engine)
        finally:
            peer.kill()
            peer.wait(10)
            publisher.close()


def test_a_generator_that_stops_polling_is_dropped_and_the_relay_takes_over(tiny_model_dir, learner_model, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url, member_idle_s=1.0)
        try:
            gen = Generator(tiny_model_dir, live.url, "gen", tmp_path, member_idle_s=1.0)
            gen.connect()
            wait_for(lambda: publisher.sender.counters.members == 1)
            # it died between two engine calls: no poll, no transfer in flight, its sockets idle
            wait_for(lambda: publisher.sender.counters.dropped == 1, timeout_s=10)
            assert publisher.sender.counters.members == 0
            wait_for(lambda: live.state.sync.summary()["members"] == {"dropped": 1})
            publisher.publish(1)  # nobody holds a group now: the version goes to the relay
            wait_for(lambda: HubClient(live.url).weights_version() == 1)
            # back, it is told to rejoin and meanwhile takes the relay's version
            assert gen.receiver.sync(0) == 1 and gen.receiver.member_id is None and not gen.receiver.connected
            assert_same_weights(learner_model, gen.engine)
        finally:
            publisher.close()


def test_a_generator_in_an_engine_call_longer_than_the_timeout_is_not_sent_a_version_it_did_not_ask_for(
        tiny_model_dir, learner_model, tmp_path):
    """The hub hears "served" after the transfer ended; a version published in between must wait for the
    generator's next poll, not go to the "ready" left over from the poll before (the generator is generating)."""
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url, timeout_s=2.0)
        sender = publisher.sender
        report = sender.member_state

        def slow_served_report(member_id, state, **kwargs):
            if state == "served":  # a loaded hub / learner: the report arrives late
                time.sleep(1.5)
            report(member_id, state, **kwargs)

        sender.member_state = slow_served_report
        try:
            gen = Generator(tiny_model_dir, live.url, "gen", tmp_path, timeout_s=2.0)
            gen.connect()
            perturb(learner_model, 1)
            publisher.publish(1)
            sync_all([gen], 1)
            wait_for(lambda: not sender.transfers)  # the transfer ended; the hub has not heard "served" yet
            perturb(learner_model, 2)
            publisher.publish(2)
            assert sender.counters.skipped_busy == 0
            wait_for(lambda: live.state.sync.announced == 2)
            time.sleep(2.0 * 2 + 1.5)  # the generator's engine call: longer than timeout_s, no poll meanwhile
            assert sender.counters.dropped == 0 and sender.counters.served == 1
            gen.sync_until(2)  # its next poll: version 2 through the group
            assert gen.receiver.connected and gen.receiver.failed_receives == 0
            assert_same_weights(learner_model, gen.engine)
            wait_for(lambda: sender.counters.served == 2)  # the learner's side of the completion step
            assert sender.counters.served == 2 and sender.counters.dropped == 0 and sender.counters.members == 1
        finally:
            publisher.close()


def test_a_generator_that_asks_is_served_without_the_sender_hearing_from_the_hub(
        tiny_model_dir, learner_model, tmp_path):
    """The ask goes through the group's store to the sender's link: a sender whose long poll of the hub is stuck
    (a busy hub, a learner whose threads wait for the interpreter lock) still serves each version at once."""
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner_model, live.url)
        sender = publisher.sender
        try:
            gen = Generator(tiny_model_dir, live.url, "gen", tmp_path)
            gen.connect()
            wait_for(lambda: sender.counters.members == 1)
            stuck = threading.Event()

            def stalled_work(sender_id, wait_s):
                stuck.set()
                sender.stopping.wait(60)  # the hub never answers the long poll again (until close)
                return SenderWork(joins=[], silent=[], http_members=0)

            for client_ in list(sender._clients):
                client_.sync_work = stalled_work
            wait_for(lambda: stuck.is_set())
            for version in (1, 2, 3):
                perturb(learner_model, version)
                publish(publisher, version)
                wait_for(lambda v=version: live.state.sync.announced == v)
                started = time.monotonic()
                gen.sync_until(version, timeout_s=10)
                assert time.monotonic() - started < 5.0
                assert_same_weights(learner_model, gen.engine)
            wait_for(lambda: sender.counters.served == 3)
            assert sender.counters.dropped == 0 and gen.receiver.failed_receives == 0
        finally:
            publisher.close()


class BrokenMidTransfer(TransformersEngine):
    """A group receive that fails half-way (the learner killed mid-transfer): half the parameters already changed."""

    def receive_weight_version(self) -> int:
        params = list(self.model.parameters())
        with torch.no_grad():
            for p in params[:len(params) // 2]:
                p.add_(1.0)
        raise ConnectionError("Connection reset by peer")


def test_a_receive_broken_half_way_waits_for_a_whole_version_on_an_empty_relay(tiny_model_dir, learner_model,
                                                                             tmp_path):
    """The chaos run's case: a learner sending through a group is killed mid-transfer while the relay holds no
    version. The generator must neither sample with its half-updated weights nor exit: it waits until the learner,
    back, publishes a whole version there, and loads it; with no version within its retry budget it stops, saying
    so."""
    with LiveServer(make_config(tmp_path)) as live:
        engine = BrokenMidTransfer(tiny_model_dir)
        receiver = WeightReceiver(engine, client(live.url), WeightSyncConfig(**CFG), "gen", tmp_path / "w")
        perturb(learner_model, seed=5)
        path = tmp_path / "v5.safetensors"
        save_file({k: v.contiguous() for k, v in learner_model.state_dict().items() if k != "lm_head.weight"},
                  str(path))
        threading.Timer(1.5, lambda: HubClient(live.url).upload_weights(5, path)).start()
        started = time.monotonic()
        assert receiver._receive(3) == 5
        assert time.monotonic() - started >= 1.0 and not receiver.inconsistent and receiver.failed_receives == 1
        assert_same_weights(learner_model, engine)

        empty = LiveServer(make_config(tmp_path / "second"))
        with empty:
            impatient = HubClient(empty.url, retry=RetryPolicy(max_retry_s=2, initial_backoff_s=0.05,
                                                               max_backoff_s=0.2))
            receiver = WeightReceiver(engine, impatient, WeightSyncConfig(**CFG), "gen", tmp_path / "w2")
            started = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"held no version to reload for \d+s \(generator.retry_max_s\)"):
                receiver._receive(5)
            assert 2.0 <= time.monotonic() - started < 10.0
