"""The evaluator of ``eval.every_steps`` (generator/evaluator.py) against a real hub and relay, with versions of the
tiny model uploaded as the learner would: which versions it evaluates, the best checkpoint and its resume, and
evaluations that fail without stopping it."""

import json
import math
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from generator.eval_files import last_evaluated
from generator.evaluate import EvalResult, evaluate_engine, plan_eval
from generator.evaluator import Evaluator, dataset_name
from learner.metrics import MetricsLogger
from shared.config.schema import GRPOConfig
from shared.errors import UsageError
from shared.metrics_file import read_records
from shared.protocol.client import HubClient, RetryPolicy
from shared.weight_sync.params import iter_parameters
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_lora_publish import lora_model, write_adapter

FAIL = {"on": False}   # flaky_reward raises while this is on


def flaky_reward(prompt, completion, example):
    if FAIL["on"]:
        raise RuntimeError("the reward's service is broken")
    return 1.0 if len(completion) % 2 == 0 else 0.0


def eval_config(model_dir, tmp_path, **eval_keys) -> GRPOConfig:
    return GRPOConfig.model_validate({
        "generator": {"model": str(model_dir), "weights_dir": str(tmp_path / "downloads"),
                      "rewards": [{"name": "python", "args": {"function": "tests.generator.test_evaluator:flaky_reward"}}],
                      "sampling": {"max_tokens": 4}},
        "run": {"run_dir": str(tmp_path / "run")},
        "eval": {"num_examples": 4, "k": 2, "engine": "transformers", "every_steps": 2, "poll_s": 0.05, **eval_keys}})


class Relay:
    """Uploads versions of the tiny model whose every weight is one value (the learner's relay files, tied head
    left out as the learner writes it)."""

    def __init__(self, url: str, model_dir, tmp_path) -> None:
        self.state = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()
                      if k != "lm_head.weight"}
        self.hub, self.tmp = HubClient(url, retry=RetryPolicy(max_retry_s=10)), tmp_path

    def upload(self, version: int, value: float | None = None) -> None:
        """``value`` None: the initial weights (what the real evaluation's reward sees as the same model)."""
        tensors = {k: (v if value is None else torch.full_like(v, value)) for k, v in self.state.items()}
        path = self.tmp / f"upload-{version}.safetensors"
        save_file(tensors, str(path))
        self.hub.upload_weights(version, path)


def weight_as_accuracy(config, engine, plan, label) -> EvalResult:
    """An evaluation whose accuracy is a weight of the loaded engine: which version it holds, read from the model."""
    value = float(next(engine.model.parameters()).detach().flatten()[0])
    return EvalResult(value, value, config.eval.k, 4, value, {"python": value}, "python", "the loaded weights")


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_best_metric_of_environments_is_refused_without_one(tiny_model_dir, tmp_path):
    config = eval_config(tiny_model_dir, tmp_path, best_metric="tool_call_rate")
    with pytest.raises(UsageError, match="eval.best_metric tool_call_rate is measured with generator.environment"):
        Evaluator(config, HubClient("http://127.0.0.1:9"), None, plan_eval(config))


def test_dataset_names_in_metric_keys(tmp_path):
    assert dataset_name(GRPOConfig()) == "arithmetic"
    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    config = GRPOConfig.model_validate({"generator": {"dataset": {"kind": "jsonl", "path": str(data)}},
                                        "eval": {"path": str(data)}})
    assert dataset_name(config) == "math"


@pytest.mark.slow
def test_the_evaluator_takes_every_nth_version_skipping_those_published_meanwhile(tiny_model_dir, tmp_path):
    """Real evaluations (the tiny model, a python reward) on the versions due: 2, then 5 (4 came with 5 already
    there), then 7; the metrics are those evaluate_engine gives for the same weights."""
    config = eval_config(tiny_model_dir, tmp_path)
    said: list[str] = []
    with LiveServer(make_config(tmp_path)) as live:
        relay = Relay(live.url, tiny_model_dir, tmp_path)
        engine = TransformersEngine(tiny_model_dir)
        plan = plan_eval(config)
        evaluator = Evaluator(config, HubClient(live.url), engine, plan, say=said.append)
        assert not evaluator.poll()                          # nothing published yet
        evaluated = []
        for version, publish in ((1, [1]), (2, [2]), (3, [3]), (5, [4, 5]), (6, [6]), (7, [7])):
            for v in publish:
                relay.upload(v)
            if evaluator.poll():
                evaluated.append(version)
        assert evaluated == [2, 5, 7]
        relay.upload(8)
        assert not evaluator.poll()                          # not due (7 + 2)
        final = threading.Event()
        final.set()                                          # the learner finished: its final version, then return
        evaluator.run(threading.Event(), final)
        expected = evaluate_engine(config, TransformersEngine(tiny_model_dir), plan, "the initial model")
    records = lines(tmp_path / "run" / "eval.jsonl")
    assert [(r["version"], r["step"]) for r in records] == [(2, 2), (5, 5), (7, 7), (8, 8)]
    for record in records:
        assert record["eval/arithmetic/accuracy"] == pytest.approx(expected.greedy_accuracy)
        assert record["eval/arithmetic/pass@2"] == pytest.approx(expected.pass_at_k)
        assert record["eval/arithmetic/mean_reward"] == pytest.approx(expected.greedy_mean_reward)
    assert said[0].startswith("version 2: accuracy ") and "pass@2" in said[0]
    # the same metrics as kind: eval lines of the learner's metrics.jsonl, at step = version
    beside = read_records(tmp_path / "run" / "metrics.jsonl", "eval")
    assert [{k: v for k, v in r.items() if k not in ("kind", "time")} for r in beside] == \
        [{k: v for k, v in r.items() if k != "time"} for r in records]
    assert read_records(tmp_path / "run" / "metrics.jsonl", "step") == []
    assert evaluator.evaluated == 4 and evaluator.failed == 0
    assert not list((tmp_path / "downloads").iterdir())     # no download kept
    assert last_evaluated(tmp_path / "run" / "eval.jsonl") == 8


@pytest.mark.slow
def test_the_best_version_is_kept_as_a_model_folder_and_survives_a_restart(tiny_model_dir, tmp_path):
    config = eval_config(tiny_model_dir, tmp_path, best_metric="accuracy")
    run_dir = tmp_path / "run"
    with LiveServer(make_config(tmp_path)) as live:
        relay = Relay(live.url, tiny_model_dir, tmp_path)
        engine = TransformersEngine(tiny_model_dir)
        evaluator = Evaluator(config, HubClient(live.url), engine, plan_eval(config),
                              evaluate=weight_as_accuracy, say=lambda text: None)
        for version, value in ((2, 0.25), (4, 0.75), (6, 0.5)):
            relay.upload(version, value)
            assert evaluator.poll()
        best = json.loads((run_dir / "best" / "best.json").read_text())
        assert best == {"version": 4, "step": 4, "metric": "accuracy", "value": 0.75}
        model = AutoModelForCausalLM.from_pretrained(run_dir / "best")   # a Hugging Face folder of version 4
        assert all(torch.all(p == 0.75) for p in model.parameters())
        assert (run_dir / "best" / "tokenizer_config.json").is_file()

        # a restarted evaluator keeps version 4 until a version beats it, and goes on after version 6
        again = Evaluator(config, HubClient(live.url), engine, plan_eval(config),
                          evaluate=weight_as_accuracy, say=lambda text: None)
        assert again.last == 6 and again.best.best.version == 4
        relay.upload(7, 0.625)
        assert not again.poll()                              # 7 < 6 + 2: not due
        relay.upload(8, 0.625)
        assert again.poll()
        assert json.loads((run_dir / "best" / "best.json").read_text())["version"] == 4
        relay.upload(10, 0.875)
        assert again.poll()
        assert json.loads((run_dir / "best" / "best.json").read_text())["version"] == 10
        assert all(torch.all(p == 0.875) for p in AutoModelForCausalLM.from_pretrained(run_dir / "best").parameters())
    assert [r["version"] for r in lines(run_dir / "eval.jsonl")] == [2, 4, 6, 8, 10]


@pytest.mark.slow
def test_best_mode_min_keeps_the_lowest_and_tensorboard_gets_each_evaluation(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = eval_config(tiny_model_dir, tmp_path, best_metric="mean_reward", best_mode="min", every_steps=1)
    tensorboard = MetricsLogger(jsonl=None, tensorboard_dir=str(tmp_path / "tb"), wandb_project=None, enabled=True,
                                total_steps=None)   # what grpo evaluator gives it with learner.tensorboard_dir
    with LiveServer(make_config(tmp_path)) as live:
        relay = Relay(live.url, tiny_model_dir, tmp_path)
        evaluator = Evaluator(config, HubClient(live.url), TransformersEngine(tiny_model_dir), plan_eval(config),
                              evaluate=weight_as_accuracy, say=lambda text: None, scalars=tensorboard)
        for version, value in ((1, 0.5), (2, 0.25), (3, 0.375)):
            relay.upload(version, value)
            assert evaluator.poll()
        evaluator.close()
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["version"] == 2
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/arithmetic/mean_reward")] == [(1, 0.5), (2, 0.25),
                                                                                          (3, 0.375)]


@pytest.mark.slow
def test_every_minutes_evaluates_the_newest_version_once_that_time_passed(tiny_model_dir, tmp_path):
    """eval.every_minutes alone (a clock the test moves): a version is taken once 60 s passed since the start or
    the last evaluation, and only a version newer than the last evaluated."""
    config = eval_config(tiny_model_dir, tmp_path, every_steps=None, every_minutes=1.0)
    now = [0.0]
    with LiveServer(make_config(tmp_path)) as live:
        relay = Relay(live.url, tiny_model_dir, tmp_path)
        evaluator = Evaluator(config, HubClient(live.url), TransformersEngine(tiny_model_dir), plan_eval(config),
                              evaluate=weight_as_accuracy, say=lambda text: None, clock=lambda: now[0])
        relay.upload(1, 0.5)
        now[0] = 59.0
        assert not evaluator.poll()
        now[0] = 60.0
        assert evaluator.poll() and evaluator.last == 1
        now[0] = 200.0
        assert not evaluator.poll()                          # time passed, but no new version
        relay.upload(2, 0.5)
        relay.upload(3, 0.5)
        assert evaluator.poll() and evaluator.last == 3       # the newest
        relay.upload(4, 0.5)
        now[0] = 259.0
        assert not evaluator.poll()
        now[0] = 260.0
        assert evaluator.poll() and evaluator.last == 4
    assert [r["version"] for r in lines(tmp_path / "run" / "eval.jsonl")] == [1, 3, 4]


@pytest.mark.slow
def test_failing_evaluations_are_written_and_counted_and_the_evaluator_goes_on(tiny_model_dir, tmp_path):
    """A reward that raises on every completion (the failure rule stops that evaluation), a version holding NaN and
    a version that does not fit the model: each is an error line, and the next version is evaluated."""
    config = eval_config(tiny_model_dir, tmp_path, every_steps=1, best_metric="accuracy")
    said: list[str] = []
    with LiveServer(make_config(tmp_path)) as live:
        relay = Relay(live.url, tiny_model_dir, tmp_path)
        evaluator = Evaluator(config, HubClient(live.url), TransformersEngine(tiny_model_dir), plan_eval(config),
                              say=said.append)
        FAIL["on"] = True
        try:
            relay.upload(1)
            assert evaluator.poll()
        finally:
            FAIL["on"] = False
        relay.upload(2, math.nan)
        assert evaluator.poll()
        wrong = tmp_path / "wrong.safetensors"
        save_file({name: torch.zeros(3, 3) for name in relay.state}, str(wrong))
        relay.hub.upload_weights(3, wrong)
        assert evaluator.poll()
        relay.upload(4)
        assert evaluator.poll()
    records = lines(tmp_path / "run" / "eval.jsonl")
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert all("error" in r for r in records[:3]) and "NaN" in records[1]["error"]
    assert "error" not in records[3] and "eval/arithmetic/accuracy" in records[3]
    assert evaluator.failed == 3 and evaluator.evaluated == 1
    assert "failed" in said[0] and said[3].startswith("version 4: accuracy")
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["version"] == 4


class FilesClient:
    """The hub's download as a folder of version files (the relay's adapter path is tested with the receiver)."""

    def __init__(self, files: dict[int, object]) -> None:
        self.files = files

    def weights_version(self) -> int:
        return max(self.files)

    def download_weights(self, version: int, dest) -> object:
        shutil.copy2(self.files[version], dest)
        return dest


def adapter_mean_as_accuracy(config, engine, plan, label) -> EvalResult:
    """The first adapted layer's mean weight, read from the engine: which adapter version it holds."""
    value = float(engine.model.model.layers[0].self_attn.q_proj.weight.mean())
    return EvalResult(value, value, config.eval.k, 4, value, {"python": value}, "python", "the loaded weights")


@pytest.mark.slow
def test_a_lora_adapter_version_is_kept_as_best_merged_into_its_base(tiny_model_dir, tmp_path):
    """learner.lora.publish: adapter: the best version's folder holds base + scaling * B @ A, which
    from_pretrained loads as the learner's merged policy; an engine that keeps adapters apart keeps none."""
    learners = {v: lora_model(tiny_model_dir, seed=v) for v in (2, 4, 6)}
    files = {}
    for version, model in learners.items():
        files[version] = tmp_path / f"adapter-{version}.safetensors"
        write_adapter(model, files[version])
    config = eval_config(tiny_model_dir, tmp_path, best_metric="accuracy")
    engine = TransformersEngine(tiny_model_dir)
    evaluator = Evaluator(config, FilesClient(files), engine, plan_eval(config), evaluate=adapter_mean_as_accuracy,
                          say=lambda text: None)
    scores = {v: evaluator.evaluate_version(v)["eval/arithmetic/accuracy"] for v in files}
    best_version = max(scores, key=scores.get)
    best = json.loads((tmp_path / "run" / "best" / "best.json").read_text())
    assert (best["version"], best["value"]) == (best_version, scores[best_version])
    kept = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "best").named_parameters())
    merged = dict(iter_parameters(learners[best_version]))
    assert merged and all(torch.equal(kept[name], merged[name]) for name in merged)
    shutil.rmtree(tmp_path / "run" / "best")

    class AdaptersApart:   # what the vLLM engine does: applies adapters, holds no torch module
        name = "vllm"

        def apply_adapter(self, path) -> None:
            self.applied = path

    apart = Evaluator(config, FilesClient(files), AdaptersApart(), plan_eval(config),
                      evaluate=lambda *a: EvalResult(0.9, 0.9, 2, 4, 0.9, {}, "python", "x"), say=lambda text: None)
    assert apart.evaluate_version(2)["eval/arithmetic/accuracy"] == 0.9
    assert not (tmp_path / "run" / "best").exists() and apart.said_no_merge
