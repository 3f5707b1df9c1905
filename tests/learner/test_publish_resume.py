import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from learner.checkpoint import complete_tags
from shared.protocol.client import HubClient
from shared.protocol.records import SamplingParams
from shared.weight_sync.export import header_for, write_safetensors
from tests import service_forks as forks
from tests.live_server import LiveServer, make_config

from .batches import sampled_groups

GRPO = str(Path(sys.executable).parent / "grpo")


def test_streamed_file_is_a_valid_safetensors_of_every_parameter(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    path = tmp_path / "w.safetensors"
    size = write_safetensors(model, path, is_writer=True, metadata={"grpo_version": "3"})
    header, data = header_for(model, metadata={"grpo_version": "3"})
    assert size == path.stat().st_size == len(header) + data
    loaded = load_file(str(path))
    params = dict(model.named_parameters())
    assert set(loaded) == set(params) and "lm_head.weight" not in loaded  # tied head written once
    for name, value in loaded.items():
        assert torch.equal(value, params[name].detach())
    bf16 = tmp_path / "b.safetensors"
    write_safetensors(model, bf16, is_writer=True, dtype=torch.bfloat16)
    assert load_file(str(bf16))["model.norm.weight"].dtype == torch.bfloat16


def learner_config(tmp_path, url, model_dir, beta=None, **learner):
    """A learner config file; ``beta=0.0`` for a hub without a reference model (the learner refuses beta > 0 there)."""
    fields = {"model": str(model_dir), "hub_url": url, "groups_per_step": 2, "lr": 1e-3,
              "checkpoint_dir": str(tmp_path / "ckpt"), "output_dir": str(tmp_path / "final"),
              "metrics_jsonl": str(tmp_path / "metrics.jsonl"), "tensorboard_dir": None, "batch_wait_s": 1.0,
              **learner}
    path = tmp_path / "learner.yaml"
    config = {"learner": fields} if beta is None else {"learner": fields, "algorithm": {"loss": {"beta": beta}}}
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def fill_hub(url, model_dir, groups, seed=0):
    client = HubClient(url)
    rewards = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]] * (groups // 2)
    for group in sampled_groups(model_dir, rewards, seed=seed):
        client.upload_group(group)


def run_learner(config, *extra, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return forks.run([GRPO, "learner", "--config", str(config), *extra], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow
def test_published_version_gives_the_learners_greedy_outputs(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        fill_hub(live.url, tiny_model_dir, 4)
        config = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=2, lr=1e-2)
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
        client = HubClient(live.url)
        assert client.weights_version() == 2 and live.state.hub.learner_version == 2
        path = client.download_weights(2, tmp_path / "v2.safetensors")
    engine = TransformersEngine(tiny_model_dir)
    prompts = [[5, 6, 7], [10, 11], [20, 21, 22, 23]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy, n=1)]
    engine.load_weights(path)
    after = [g[0].token_ids for g in engine.generate(prompts, greedy, n=1)]
    learner_model = TransformersEngine(tmp_path / "final")  # the HF folder the learner exported at the end
    assert after == [g[0].token_ids for g in learner_model.generate(prompts, greedy, n=1)]
    assert after != before or not torch.equal(
        engine.model.model.norm.weight, AutoModelForCausalLM.from_pretrained(tiny_model_dir).model.norm.weight)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["lr"] == 1e-2 for m in metrics)
    for key in ("loss", "kl_mean", "entropy", "clip_frac_low", "clip_frac_high", "ratio_mean", "is_weight_max",
                "reward_mean", "completion_len_mean", "truncated_frac", "zero_variance_group_frac",
                "staleness_mean", "time_wait_s", "time_compute_s", "time_publish_s", "tokens_per_s"):
        assert key in metrics[0], key


@pytest.mark.slow
def test_resume_after_kill_continues_with_the_same_step_parameters_and_lr(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        fill_hub(live.url, tiny_model_dir, 12)
        config = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=4, checkpoint_every=1,
                                lr_schedule="cosine", warmup_steps=1, batch_wait_s=30.0)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = forks.popen([GRPO, "learner", "--config", str(config)], stderr=subprocess.PIPE, text=True,
                                env=env)
        deadline = time.monotonic() + 300
        hub = HubClient(live.url)

        def relay_holds_the_newest_checkpoint() -> bool:
            # the relay gets a version in the background and skips one published while the previous is still
            # being sent, so wait until it holds the newest complete checkpoint's version: the test compares them
            tags = complete_tags(tmp_path / "ckpt")
            # (at least step 2: older checkpoints are deleted as newer ones complete, so not "step 2 is there")
            return bool(tags) and tags[-1] >= "step00000002" and hub.weights_version() == int(tags[-1][4:])

        while not relay_holds_the_newest_checkpoint():
            # a learner that finished all its steps between two looks has published its last version: look again
            assert proc.poll() is None or relay_holds_the_newest_checkpoint(), proc.stderr.read()[-3000:]
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        newest = complete_tags(tmp_path / "ckpt")[-1]
        step = int(newest.removeprefix("step"))
        # a checkpoint killed half-way: a newer tag folder without the COMPLETE marker is never picked up
        half = tmp_path / "ckpt" / f"step{step + 1:08d}"
        half.mkdir(exist_ok=True)  # the kill may have come while the learner was writing exactly this one
        (half / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
        published = HubClient(live.url).download_weights(step, tmp_path / "at_checkpoint.safetensors")
        # resume with max_steps = the checkpoint's step: no training, only the export of what was restored
        same = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=step, checkpoint_every=1,
                              lr_schedule="cosine", warmup_steps=1, output_dir=str(tmp_path / "restored"))
        result = run_learner(same, "--resume")
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resumed from step{step:08d} (step {step}, version {step})" in result.stderr
        restored = load_file(str(tmp_path / "restored" / "model.safetensors"))
        for name, value in load_file(str(published)).items():
            assert torch.equal(restored[name], value), name
        # and continuing gives the next step with the schedule's learning rate for it
        more = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=4, checkpoint_every=1,
                              lr_schedule="cosine", warmup_steps=1)
        result = run_learner(more, "--resume")
        assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    resumed = [m for m in metrics if m["step"] > step]
    assert [m["step"] for m in resumed][-(4 - step):] == list(range(step + 1, 5))
    from learner.engine import lr_multiplier
    from shared.config.schema import LearnerConfig

    cfg = LearnerConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1, max_steps=4)
    for m in resumed[-(4 - step):]:
        assert m["lr"] == pytest.approx(1e-3 * lr_multiplier(cfg, m["step"] - 1), rel=1e-6)
    assert complete_tags(tmp_path / "ckpt")[-1] == "step00000004"


@pytest.mark.slow
def test_sigterm_before_the_first_step_exits_cleanly_and_writes_no_checkpoint(tiny_model_dir, tmp_path):
    """Stopped before it trained (say a generator stopped by a failing reward): nothing to resume from or export,
    so no checkpoint and no model folder (it was a 1 GB copy of the base model and a --resume hint)."""
    with LiveServer(make_config(tmp_path)) as live:  # an empty hub: the learner waits
        config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, tensorboard_dir=str(tmp_path / "tb"))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = forks.popen([GRPO, "learner", "--config", str(config)], stderr=subprocess.PIPE, text=True,
                                env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until the learner has reported its version 0 and polls for batches
            if live.get("/metrics").text.count('endpoint="/v1/batch"') and proc.poll() is None:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "SIGTERM received" in stderr and "waiting for 2 groups" in stderr
    assert complete_tags(tmp_path / "ckpt") == []
    assert not (tmp_path / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_unreachable_hub_fails_with_the_reason(tiny_model_dir, tmp_path):
    config = learner_config(tmp_path, "http://127.0.0.1:9", tiny_model_dir, retry_max_s=1.0)
    result = run_learner(config)
    assert result.returncode == 1
    assert "grpo learner: error: cannot reach http://127.0.0.1:9" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_tensorboard_and_jsonl_metrics(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path, tiny_model_dir)) as live:
        fill_hub(live.url, tiny_model_dir, 2)
        config = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=1, tensorboard_dir=str(tmp_path / "tb"))
        result = run_learner(config)
        assert result.returncode == 0, result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "kl_mean", "reward_mean", "entropy"} <= set(events.Tags()["scalars"])
    jsonl = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert events.Scalars("loss")[0].value == pytest.approx(jsonl["loss"], rel=1e-5)


@pytest.mark.slow
def test_learner_with_beta_refuses_a_hub_without_a_reference_model(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        result = run_learner(learner_config(tmp_path, live.url, tiny_model_dir, max_steps=1))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "algorithm.loss.beta is 0.04 but the ref server" in result.stderr


@pytest.mark.slow
def test_fresh_learner_refuses_a_hub_holding_an_earlier_runs_weights(tiny_model_dir, tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        path = tmp_path / "old.safetensors"
        write_safetensors(AutoModelForCausalLM.from_pretrained(tiny_model_dir), path, is_writer=True)
        HubClient(live.url).upload_weights(60, path)
        result = run_learner(learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, max_steps=1))
    assert result.returncode == 2
    assert "the hub already holds weights version 60 from an earlier run" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_sigterm_after_the_hub_died_exits_promptly(tiny_model_dir, tmp_path):
    live = LiveServer(make_config(tmp_path)).__enter__()
    config = learner_config(tmp_path, live.url, tiny_model_dir, beta=0.0, retry_max_s=300.0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = forks.popen([GRPO, "learner", "--config", str(config)], stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 120
    while 'endpoint="/v1/batch"' not in live.get("/metrics").text:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    live.__exit__(None, None, None)  # the hub dies while the learner waits for batches
    time.sleep(2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_learner_resumed_ahead_of_the_relay_publishes_its_restored_weights_at_once(tiny_model_dir, tmp_path):
    """Killed before its newest version reached the relay (or resumed beside a hub whose relay is empty), a learner
    must hand its restored weights to the relay before it waits for groups: generators that join load the relay's
    version, and from an older one every group they sample is already too stale to train (the hub's pacing gives
    them no budget), so the run would wait forever (seen in the chaos run)."""
    with LiveServer(make_config(tmp_path / "first", tiny_model_dir)) as live:
        fill_hub(live.url, tiny_model_dir, 4)
        result = run_learner(learner_config(tmp_path, live.url, tiny_model_dir, max_steps=2, checkpoint_every=1))
        assert result.returncode == 0, result.stderr[-3000:]
    with LiveServer(make_config(tmp_path / "second", tiny_model_dir)) as live:  # its relay holds nothing
        hub = HubClient(live.url)
        assert hub.weights_version() is None
        config = learner_config(tmp_path, live.url, tiny_model_dir, max_steps=3, checkpoint_every=1,
                                batch_wait_s=60.0)
        proc = forks.popen([GRPO, "learner", "--config", str(config), "--resume"], stderr=subprocess.PIPE,
                           text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        try:
            deadline = time.monotonic() + 120
            while hub.weights_version() != 2:  # before any group arrives: the hub is empty
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()  # its stderr can be read only once it has ended
                    pytest.fail(f"the relay holds {hub.weights_version()}: {proc.communicate(timeout=60)[1][-3000:]}")
                time.sleep(0.2)
            assert hub.hub_stats()["queue_depth"] == 0 and proc.poll() is None
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=120)
