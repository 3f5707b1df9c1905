"""The run folder: state paths derive from run.run_dir, a second run is refused without --resume/--fresh, --fresh
deletes the run's state and nothing else, --resume needs a checkpoint, and the last lines say where things are."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from deploy import cli
from deploy.run_state import (
    drop_unneeded_weights,
    existing_state,
    prepare_run_dir,
    state_paths,
    summary_lines,
)
from shared.config.loader import load_config
from shared.config.schema import GRPOConfig
from shared.config.schema.learner import LoraConfig
from shared.config.schema.paths import under_run_dir
from shared.errors import UsageError
from tests.e2e.test_run import free_port


def config_for(run_dir, *overrides: str) -> GRPOConfig:
    return load_config(None, [f"run.run_dir={run_dir}", "learner.model=some/model", *overrides])


def test_every_state_path_derives_from_the_run_dir(tmp_path):
    config = config_for(tmp_path / "r")
    assert config.ref_server.spool_dir == str(tmp_path / "r/ref_server/spool")
    assert config.ref_server.weights_dir == str(tmp_path / "r/ref_server/relay")
    assert config.generator.weights_dir == str(tmp_path / "r/generator/weights")
    assert config.learner.checkpoint_dir == str(tmp_path / "r/checkpoints")
    assert config.learner.output_dir == str(tmp_path / "r/model")
    assert config.learner.metrics_jsonl == str(tmp_path / "r/metrics.jsonl")
    assert config.learner.tensorboard_dir == str(tmp_path / "r/tensorboard")
    # the resolved config (what `grpo run` writes for its services) reads back the same
    assert GRPOConfig.model_validate(config.model_dump(mode="json")) == config


def test_explicit_paths_stay_null_means_off_and_a_template_is_allowed_in_yaml(tmp_path):
    config = config_for(tmp_path / "r", "ref_server.spool_dir=/elsewhere/spool", "learner.tensorboard_dir=null",
                        "learner.metrics_jsonl=<run_dir>/m/steps.jsonl")
    assert config.ref_server.spool_dir == "/elsewhere/spool"
    assert config.learner.tensorboard_dir is None
    assert config.learner.metrics_jsonl == str(tmp_path / "r/m/steps.jsonl")


def test_without_a_run_dir_a_service_keeps_no_run_state():
    """A ref server started on its own (e.g. to score) has no spool and a temporary relay: it can never touch the
    spool of a run."""
    config = load_config(None, [])
    assert config.run.run_dir is None
    assert config.ref_server.spool_dir is None and config.ref_server.weights_dir is None
    assert config.generator.weights_dir is None and config.learner.output_dir is None


@given(st.text(alphabet=st.characters(blacklist_characters="{}\x00", blacklist_categories=("Cs",)), min_size=1,
               max_size=30).filter(lambda s: s.strip("/")))
def test_under_run_dir_puts_the_path_under_any_run_dir(run_dir):
    resolved = under_run_dir("<run_dir>/ref_server/spool", run_dir)
    assert resolved == run_dir.rstrip("/") + "/ref_server/spool"
    assert under_run_dir("/abs/spool", run_dir) == "/abs/spool" and under_run_dir(None, run_dir) is None


def test_a_run_dir_with_state_is_refused_without_a_flag(tmp_path):
    config = config_for(tmp_path / "r")
    assert prepare_run_dir(config, resume=False, fresh=False) is None  # nothing there yet
    (tmp_path / "r/ref_server/spool/quarantine").mkdir(parents=True)  # empty folders are no state
    assert existing_state(config) == [] and prepare_run_dir(config, resume=False, fresh=False) is None
    (tmp_path / "r/ref_server/relay").mkdir(parents=True)
    (tmp_path / "r/ref_server/relay/learner.json").write_text("{}")
    with pytest.raises(UsageError) as err:
        prepare_run_dir(config, resume=False, fresh=False)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'r'} holds an earlier run's state ({tmp_path / 'r/ref_server/relay'})")
    assert "--resume" in message and "--fresh" in message and "\n" not in message


def test_fresh_deletes_the_runs_state_and_logs_and_nothing_else(tmp_path):
    run = tmp_path / "r"
    config = config_for(run, f"learner.model={run / 'tiny-model'}")
    for path in ("ref_server/spool/g1.json", "ref_server/relay/v0000000003.safetensors", "checkpoints/x",
                 "model/config.json", "metrics.jsonl", "logs/learner.log", "tiny-model/config.json", "summary.json"):
        (run / path).parent.mkdir(parents=True, exist_ok=True)
        (run / path).write_text("x")
    note = prepare_run_dir(config, resume=False, fresh=True)
    assert note.startswith("--fresh: deleted the earlier run's ")
    assert sorted(p.name for p in run.iterdir()) == ["summary.json", "tiny-model"]
    assert (run / "tiny-model/config.json").read_text() == "x"
    assert prepare_run_dir(config, resume=False, fresh=False) is None  # now it starts


def test_fresh_never_deletes_a_folder_holding_the_model(tmp_path):
    config = config_for(tmp_path / "r", f"learner.model={tmp_path / 'r/model/base'}")
    (tmp_path / "r/model/base").mkdir(parents=True)
    (tmp_path / "r/model/base/config.json").write_text("{}")
    with pytest.raises(UsageError, match=r"--fresh would delete .*/r/model \(learner.output_dir\), which holds"):
        prepare_run_dir(config, resume=False, fresh=True)
    assert (tmp_path / "r/model/base/config.json").exists()


def test_resume_needs_a_complete_checkpoint_and_says_what_it_continues(tmp_path):
    config = config_for(tmp_path / "r")
    with pytest.raises(UsageError, match="nothing to resume in .*: it holds no run state; start it without --resume"):
        prepare_run_dir(config, resume=True, fresh=False)
    (tmp_path / "r/checkpoints/step00000004").mkdir(parents=True)  # written half-way: not complete
    (tmp_path / "r/checkpoints/step00000004/mp_rank_00_model_states.pt").write_text("x")
    with pytest.raises(UsageError, match="holds no complete checkpoint"):
        prepare_run_dir(config, resume=True, fresh=False)
    (tmp_path / "r/checkpoints/step00000003").mkdir()
    (tmp_path / "r/checkpoints/step00000003/COMPLETE").write_text(json.dumps({"step": 3, "version": 5}))
    note = prepare_run_dir(config, resume=True, fresh=False)
    assert note.startswith(f"resuming {tmp_path / 'r'}: the learner from checkpoint step00000003 (step 3, weights "
                           "version 5)")
    with pytest.raises(UsageError, match="exclude each other"):
        prepare_run_dir(config, resume=True, fresh=True)


def test_resume_lists_changed_settings_and_refuses_those_a_checkpoint_cannot_follow(tmp_path):
    config = config_for(tmp_path / "r")
    (tmp_path / "r/checkpoints/step00000003").mkdir(parents=True)
    (tmp_path / "r/checkpoints/step00000003/COMPLETE").write_text(json.dumps({"step": 3, "version": 3}))
    note = prepare_run_dir(config, resume=True, fresh=False)
    assert "settings changed" not in note  # no earlier config.yaml: nothing to compare
    (tmp_path / "r/config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert "settings changed" not in prepare_run_dir(config, resume=True, fresh=False)
    changed = config.model_copy(deep=True)
    changed.learner.lr, changed.generator.group_size = 2e-5, config.generator.group_size + 1
    note = prepare_run_dir(changed, resume=True, fresh=False)
    assert note.endswith(f"; settings changed since the earlier run: generator.group_size {config.generator.group_size}"
                         f" -> {config.generator.group_size + 1}, learner.lr {config.learner.lr!r} -> 2e-05")
    for key, value in (("model", str(tmp_path / "other")), ("zero_stage", 3)):
        other = config.model_copy(deep=True)
        setattr(other.learner, key, value)
        with pytest.raises(UsageError, match=rf"--resume: learner.{key} was .* in the earlier run and is "
                                             rf".*; its checkpoint continues only under the same learner.{key}"):
            prepare_run_dir(other, resume=True, fresh=False)
    lora = config.model_copy(deep=True)
    lora.learner.lora = LoraConfig(r=8)
    with pytest.raises(UsageError, match=r"--resume: learner.lora.alpha was None in the earlier run and is 32.0"):
        prepare_run_dir(lora, resume=True, fresh=False)
    (tmp_path / "r/config.yaml").write_text("a: [")
    with pytest.raises(UsageError, match=r"config.yaml \(the earlier run's config\) is not YAML"):
        prepare_run_dir(config, resume=True, fresh=False)


def test_summary_says_where_the_model_logs_metrics_and_checkpoint_are(tmp_path):
    run = tmp_path / "r"
    config = config_for(run)
    assert summary_lines(config, 1) == ["model: none written", f"logs: {run / 'logs'}", "checkpoint: none",
                                        "disk: 0 B; exit status 1"]
    (run / "model").mkdir(parents=True)
    (run / "model/config.json").write_text("{}")
    (run / "model/model.safetensors").write_bytes(b"\0" * 3000)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "checkpoints/step00000002").mkdir(parents=True)
    (run / "checkpoints/step00000002/COMPLETE").write_text(json.dumps({"step": 2, "version": 2}))
    (run / "checkpoints/step00000002/mp_rank_00_model_states.pt").write_bytes(b"\0" * 2000)
    lines = summary_lines(config, 130, "my.yaml")
    checkpoint_bytes = 2000 + len(json.dumps({"step": 2, "version": 2}))
    assert lines == [
        f"model: {run / 'model'} (Hugging Face folder, 2.9 KB)",
        f"logs: {run / 'logs'}",
        f"metrics: {run / 'metrics.jsonl'}",
        f"checkpoint: {run / 'checkpoints/step00000002'} (step 2, {checkpoint_bytes / 1024:.1f} KB); continue with: "
        "grpo run my.yaml --resume",
        f"disk: 4.9 KB in {run}; exit status 130",
    ]
    (run / "checkpoints/step00000004").mkdir(parents=True)  # two kept: their sum, and the key that says how many
    (run / "checkpoints/step00000004/COMPLETE").write_text(json.dumps({"step": 4, "version": 4}))
    (run / "checkpoints/step00000004/mp_rank_00_model_states.pt").write_bytes(b"\0" * 2000)
    (run / "ref_server/relay").mkdir(parents=True)
    (run / "ref_server/relay/v0000000004.safetensors").write_bytes(b"\0" * 1024)
    lines = summary_lines(config, 0)
    assert lines[3:5] == [
        f"checkpoint: {run / 'checkpoints/step00000004'} (step 4, 2.0 KB; 2 kept (learner.keep_checkpoints), "
        f"4.0 KB in {run / 'checkpoints'}); continue with: grpo run CONFIG --resume",
        f"relay: {run / 'ref_server/relay'} (1 weights version, 1.0 KB)"]


def valid_config(model_dir) -> str:
    """A config that passes `grpo run`'s checks (deploy/preflight.py), so that the run folder is what is refused."""
    return (f"algorithm: {{loss: {{beta: 0.0}}}}\nref_server: {{port: {free_port()}}}\n"
            f"generator: {{model: {model_dir}}}\n"
            f"learner: {{model: {model_dir}}}\n")


def test_grpo_run_refuses_a_used_run_dir_in_one_line_before_starting(tmp_path, capsys, tiny_model_dir):
    config = tmp_path / "train.yaml"
    config.write_text(valid_config(tiny_model_dir) + f"run: {{run_dir: {tmp_path / 'r'}}}\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r/metrics.jsonl").write_text("{}\n")
    assert cli.main(["run", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"grpo run: error: {tmp_path / 'r'} holds an earlier run's state")
    assert not (tmp_path / "r/logs").exists() and not (tmp_path / "r/config.yaml").exists()


def test_grpo_run_defaults_the_run_dir_to_the_configs_name(tmp_path, capsys, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    Path("arith.yaml").write_text(valid_config(tiny_model_dir))
    Path("runs/arith").mkdir(parents=True)
    Path("runs/arith/metrics.jsonl").write_text("{}\n")
    assert cli.main(["run", "arith.yaml"]) == 2
    assert capsys.readouterr().err.startswith("grpo run: error: runs/arith holds an earlier run's state "
                                              "(runs/arith/metrics.jsonl)")


def test_every_shipped_config_keeps_its_state_in_a_run_dir_of_its_own():
    configs = sorted((Path(__file__).resolve().parents[2] / "deploy" / "configs").glob("*.yaml"))
    run_dirs = set()
    for path in configs:
        config = load_config(path)
        run_dir = Path(config.run.run_dir)
        run_dirs.add(run_dir)
        for state in state_paths(config):
            assert run_dir in state.path.parents, (path.name, state)
    assert len(run_dirs) == len(configs)


def test_a_finished_run_keeps_no_weight_copy_beside_the_model_and_a_stopped_one_keeps_them_all(tmp_path):
    run = tmp_path / "r"
    config = config_for(run)
    relay, gen = run / "ref_server/relay", run / "generator/weights"
    for folder in (relay, gen):
        folder.mkdir(parents=True)
        (folder / "v0000000003.safetensors").write_bytes(b"\0" * 2048)
    (relay / "learner.json").write_text("{}")
    (relay / "v0000000002.safetensors").write_bytes(b"\0" * 1024)  # the relay keeps the two newest
    assert drop_unneeded_weights(config, 130) is None  # stopped: a checkpoint is written, a resume needs them
    assert len(list(run.rglob("v*.safetensors"))) == 3
    (run / "checkpoints/step00000003").mkdir(parents=True)
    (run / "checkpoints/step00000003/COMPLETE").write_text(json.dumps({"step": 3, "version": 3}))
    # finished with a checkpoint: the model folder holds the final weights, a resume publishes the checkpoint's
    assert drop_unneeded_weights(config, 0) == (
        f"the relay's and generators' weight copies are deleted (5.0 KB): {run / 'model'} holds the final weights, "
        "and a --resume publishes them again from the checkpoint")
    assert list(run.rglob("v*.safetensors")) == [] and (relay / "learner.json").exists()  # the hub's session stays
    (gen / "v0000000003.safetensors").write_bytes(b"\0" * 2048)
    shutil.rmtree(run / "checkpoints")
    assert drop_unneeded_weights(config, 0) == ("the relay's and generators' weight copies are deleted (2.0 KB): "
                                                f"{run / 'model'} holds the final weights")
    assert list(run.rglob("v*.safetensors")) == [] and drop_unneeded_weights(config, 0) is None


def test_resume_of_a_finished_run_is_refused_with_how_to_train_further(tmp_path):
    config = config_for(tmp_path / "r", "learner.max_steps=5")
    (tmp_path / "r/checkpoints/step00000005").mkdir(parents=True)
    (tmp_path / "r/checkpoints/step00000005/COMPLETE").write_text(json.dumps({"step": 5, "version": 5}))
    with pytest.raises(UsageError) as err:
        prepare_run_dir(config, resume=True, fresh=False, source="my.yaml")
    assert str(err.value) == (
        f"{tmp_path / 'r'} is finished: its learner reached step 5 of learner.max_steps 5, nothing is left to "
        "resume; train further with `grpo run my.yaml --resume --set learner.max_steps=10` (any value above 5), "
        "or start over with `grpo run my.yaml --fresh`")
    raised = config_for(tmp_path / "r", "learner.max_steps=6")  # one step left: resumed
    assert prepare_run_dir(raised, resume=True, fresh=False).startswith("resuming")
    unbounded = config_for(tmp_path / "r", "learner.max_steps=null")  # until stopped: never finished
    assert prepare_run_dir(unbounded, resume=True, fresh=False).startswith("resuming")


@pytest.mark.slow  # a subprocess: the command as typed
def test_grpo_run_resume_of_a_finished_run_says_so_at_once_and_starts_nothing(tmp_path, tiny_model_dir):
    """The real command, as a user types it: one line, exit 2, in seconds, no service started (no logs folder)."""
    config = tmp_path / "train.yaml"
    config.write_text(valid_config(tiny_model_dir) + f"run: {{run_dir: {tmp_path / 'r'}}}\n")
    (tmp_path / "r/checkpoints/step00000003").mkdir(parents=True)
    (tmp_path / "r/checkpoints/step00000003/COMPLETE").write_text(json.dumps({"step": 3, "version": 3}))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(config), "--resume", "--set",
                           "learner.max_steps=3"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    elapsed = time.monotonic() - started
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"grpo run: error: {tmp_path / 'r'} is finished: its learner reached step 3 of "
                                  "learner.max_steps 3")
    assert f"grpo run {config} --resume --set learner.max_steps=6" in done.stderr
    assert not (tmp_path / "r/logs").exists() and not (tmp_path / "r/config.yaml").exists()
    assert elapsed < 60  # was ~63 s of services starting and stopping on the 2-core machine


def test_resume_keeps_the_curriculums_table_and_fresh_deletes_it(tmp_path):
    """The hub's curriculum table lives in the spool folder (ref_server/hub/curriculum.py): run state."""
    from ref_server.hub.curriculum import SharedCurriculum
    from shared.protocol.curriculum_messages import CurriculumReport

    config = config_for(tmp_path / "r")
    table = SharedCurriculum(config.ref_server.spool_dir)
    table.report(CurriculumReport(window=2, min_appearances=2, shares=[("p", 1.0), ("p", 1.0)]))
    table.close()
    (tmp_path / "r/checkpoints/step00000003").mkdir(parents=True)
    (tmp_path / "r/checkpoints/step00000003/COMPLETE").write_text(json.dumps({"step": 3, "version": 3}))
    prepare_run_dir(config, resume=True, fresh=False)
    assert SharedCurriculum(config.ref_server.spool_dir).rates.settled() == {"p"}
    prepare_run_dir(config, resume=False, fresh=True)
    assert SharedCurriculum(config.ref_server.spool_dir).tracked() == 0
