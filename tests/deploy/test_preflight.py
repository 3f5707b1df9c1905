"""deploy/preflight.py: every mistake a config can hold is one line, found before anything starts, each check in
under 5 s; `grpo check-config` reports them all together with exit status 2."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import yaml

from deploy.cli import main
from deploy.preflight import (
    CONFIG_CHECKS,
    RUN_CHECKS,
    PreflightError,
    looks_like_hub_id,
    model_problem,
    require,
    require_models,
    run_checks,
)
from shared.config.schema import GRPOConfig

REWARD_FILE = "def score(prompt, completion, example, bonus=0.0):\n    return float(completion == example['answer']) + bonus\n"


def good_config(tmp_path, model_dir) -> dict:
    """A config whose every check passes: the tiny model, a JSONL file, a reward file."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "2+3=", "answer": "5"}) + "\n")
    (tmp_path / "my_reward.py").write_text(REWARD_FILE)
    return {
        "algorithm": {"loss": {"beta": 0.0}},
        "ref_server": {"port": free_port()},
        "generator": {"model": str(model_dir), "dataset": {"kind": "jsonl", "path": str(tmp_path / "data.jsonl")},
                      "rewards": [{"name": "python", "args": {"function": f"{tmp_path}/my_reward.py:score",
                                                               "bonus": 0.5}}]},
        "learner": {"model": str(model_dir)},
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write(tmp_path, data: dict, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_good_config_passes_every_check_each_within_5_s(tmp_path, tiny_model_dir, capsys):
    data = good_config(tmp_path, tiny_model_dir)
    report = require(GRPOConfig.model_validate(data), RUN_CHECKS)
    assert set(report.seconds) == {"models", "reference", "dataset", "rewards", "environment", "port", "cpu_cores"}
    assert max(report.seconds.values()) < 5.0, report.seconds
    assert main(["check-config", str(write(tmp_path, data))]) == 0
    assert "my_reward.py:score" in capsys.readouterr().out


def test_every_mistake_is_one_line_reported_together_with_exit_2(tmp_path, tiny_model_dir, capsys):
    data = good_config(tmp_path, tiny_model_dir)
    (tmp_path / "wrong_sig.py").write_text("def score(text):\n    return 1.0\n")
    data["algorithm"]["loss"]["beta"] = 0.04                                      # no ref_server.model
    data["generator"]["model"] = str(tmp_path / "no-such-model")                    # a missing folder
    data["generator"]["dataset"]["path"] = str(tmp_path / "missing.jsonl")          # a missing dataset
    data["generator"]["rewards"] = [
        {"name": "python", "args": {"function": "not_a_module_anywhere:score"}},    # not importable
        {"name": "python", "label": "sig", "args": {"function": f"{tmp_path}/wrong_sig.py:score"}},  # wrong signature
    ]
    started = time.perf_counter()
    assert main(["check-config", str(write(tmp_path, data))]) == 2
    elapsed = time.perf_counter() - started
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert lines[0] == "grpo check-config: error: 5 problems, found before starting anything:"
    problems = [line.removeprefix("  - ") for line in lines[1:]]
    assert len(problems) == 5 and all(line.startswith("  - ") for line in lines[1:])
    assert problems[0].startswith(f"generator.model: no model folder {tmp_path / 'no-such-model'}")
    assert problems[1].startswith("ref_server.model is not set, but algorithm.loss.beta is 0.04 (> 0)")
    assert problems[2].startswith("generator.dataset: cannot read dataset file") and "missing.jsonl" in problems[2]
    assert problems[3].startswith("generator.rewards[0] (python): function 'not_a_module_anywhere:score': "
                                  "cannot import module 'not_a_module_anywhere'")
    assert problems[4].startswith("generator.rewards[1] (python): function ")
    assert "cannot be called as fn(prompt: str, completion: str, example: dict, **args) -> float" in problems[4]
    assert elapsed < 5.0


def test_each_check_finds_its_mistake_within_5_s(tmp_path, tiny_model_dir):
    data = good_config(tmp_path, tiny_model_dir)
    data["learner"]["model"] = str(tmp_path)       # a folder, but no config.json
    data["algorithm"]["kl"] = {"in_reward": True}
    data["algorithm"]["loss"] = {}
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    data["generator"]["rewards"].append({"name": "code"})   # reads the example's 'tests' field
    report = run_checks(GRPOConfig.model_validate(data), CONFIG_CHECKS)
    assert report.problems == [
        f"learner.model: {tmp_path} has no config.json, so it is not a Hugging Face model folder",
        "ref_server.model is not set, but algorithm.kl.in_reward is true: the KL penalty needs a reference model; "
        "set ref_server.model (usually the learner's starting model) or algorithm.loss.beta: 0",
        "generator.dataset: data.jsonl:1: no 'tests' field, which generator.rewards[1] (code, args.tests_field) "
        "needs (fields: ['answer', 'question'])",
    ]
    assert max(report.seconds.values()) < 5.0, report.seconds


def test_a_jsonl_line_without_the_question_field_names_file_and_line(tmp_path, tiny_model_dir):
    data = good_config(tmp_path, tiny_model_dir)
    (tmp_path / "data.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n{"text": "x", "answer": "3"}\n')
    with pytest.raises(PreflightError) as info:
        require(GRPOConfig.model_validate(data), ["dataset"])
    assert str(info.value) == (f"generator.dataset: {tmp_path / 'data.jsonl'}:2: no 'question' field "
                               "(fields: ['answer', 'text'])")


def test_model_problems_name_the_key_and_never_touch_the_hub_offline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "weights.bin").write_text("x")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{}")
    assert "learner.model is not set" in model_problem(None, "learner.model")
    # 'runs/' exists here: runs/tiny-model is a missing local folder, not a Hub id
    assert model_problem("runs/tiny-model", "generator.model").startswith(
        "generator.model: no model folder runs/tiny-model (from ")
    assert "grpo tiny-model --out runs/tiny-model" in model_problem("runs/tiny-model", "k")
    assert model_problem("weights.bin", "k") == "k: weights.bin is a file, not a model folder"
    assert model_problem("bad", "k") == "k: bad/config.json names no model_type, so transformers cannot load it"
    started = time.perf_counter()
    problem = model_problem("SomeOrg/surely-not-cached-model", "generator.model")
    assert time.perf_counter() - started < 5.0
    assert problem == ("generator.model: no model folder 'SomeOrg/surely-not-cached-model', and "
                       "'SomeOrg/surely-not-cached-model' is not in the local Hugging Face cache "
                       "(HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set, so nothing is downloaded)")


def test_an_unreachable_hub_is_one_request_and_one_line(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    started = time.perf_counter()
    problem = model_problem("SomeOrg/surely-not-cached-model", "learner.model")
    assert time.perf_counter() - started < 5.0
    assert problem.startswith("learner.model: no model folder 'SomeOrg/surely-not-cached-model', and the Hugging "
                              "Face Hub could not be reached to download it")


@pytest.mark.parametrize("name, hub", [("Qwen/Qwen2.5-0.5B-Instruct", True), ("org/name", True),
                                       ("./x/y", False), ("/abs/model", False), ("a/b/c", False),
                                       ("model", False), ("../up/x", False)])
def test_what_looks_like_a_hub_id(name, hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert looks_like_hub_id(name) is hub


def test_a_port_in_use_names_the_process_holding_it(tmp_path, tiny_model_dir):
    data = good_config(tmp_path, tiny_model_dir)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        data["ref_server"]["port"] = held.getsockname()[1]
        config = GRPOConfig.model_validate(data)
        require(config, CONFIG_CHECKS)   # check-config does not look at the port
        with pytest.raises(PreflightError) as info:
            require(config, RUN_CHECKS)
    port = data["ref_server"]["port"]
    assert str(info.value).startswith(f"ref_server.port: port {port} on 127.0.0.1 is held by pid {os.getpid()} (")
    assert str(info.value).endswith("stop it or choose another port (--set ref_server.port=N)")
    require(config, RUN_CHECKS)   # free again once the socket is closed


def test_require_models_lists_every_missing_model(tmp_path, tiny_model_dir):
    require_models({"--model": str(tiny_model_dir)})
    with pytest.raises(PreflightError) as info:
        require_models({"--model": str(tmp_path / "a"), "learner.model": str(tmp_path / "b")})
    assert len(info.value.problems) == 2 and info.value.exit_code == 2


def test_schema_only_skips_the_checks_of_what_the_config_names(tmp_path, capsys):
    path = write(tmp_path, {"generator": {"model": "nowhere/at-all"}})
    assert main(["check-config", str(path), "--schema-only"]) == 0
    assert "model: nowhere/at-all" in capsys.readouterr().out
    assert main(["check-config", str(path)]) == 2
    assert "generator.model: no model folder 'nowhere/at-all'" in capsys.readouterr().err


def test_a_lora_run_scoring_its_reference_in_the_learner_needs_no_reference_model(tmp_path, tiny_model_dir):
    """``learner.lora.reference: learner``: the learner scores the base with its adapters off, so beta > 0 without
    ``ref_server.model`` is a valid run (the same rule the ref server and the launcher follow:
    ``GRPOConfig.hub_scores_reference``); with the hub scoring it, the same config is refused."""
    data = good_config(tmp_path, tiny_model_dir)
    data["algorithm"]["loss"] = {"beta": 0.04}
    data["ref_server"] = {**data.get("ref_server", {}), "model": None}
    data["learner"]["lora"] = {"r": 4, "target_modules": ["q_proj"], "reference": "learner"}
    config = GRPOConfig.model_validate(data)
    assert not config.hub_scores_reference
    assert run_checks(config, {"reference": CONFIG_CHECKS["reference"]}).problems == []
    data["learner"]["lora"]["reference"] = "hub"
    refused = run_checks(GRPOConfig.model_validate(data), {"reference": CONFIG_CHECKS["reference"]})
    assert refused.problems and refused.problems[0].startswith("ref_server.model is not set")
