import subprocess
import sys
from pathlib import Path

import pytest

from deploy.cli import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_console_script_help():
    grpo = Path(sys.executable).parent / "grpo"
    assert grpo.exists(), "the grpo console script is not installed in this environment"
    result = subprocess.run([str(grpo), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "usage: grpo" in result.stdout and "tiny-model" in result.stdout


def test_check_config_reports_unknown_key_without_traceback(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  los: {}\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "algorithm.los: unknown key" in err and "Traceback" not in err


def test_check_config_prints_resolved_values(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 5\n")
    # --schema-only: this config names no model folders; tests/deploy/test_preflight.py checks what configs name
    assert main(["check-config", str(path), "--schema-only", "--set", "algorithm.loss.beta=0"]) == 0
    out = capsys.readouterr().out
    assert "seed: 5" in out and "beta: 0" in out and "kl_estimator: k3" in out


def test_config_reference_lists_every_field(capsys):
    assert main(["config-reference"]) == 0
    out = capsys.readouterr().out
    assert "| `algorithm.off_policy.mode` | `\"token_tis\"` |" in out and "| `algorithm.off_policy.high` | `2.0` |" in out


def test_config_reference_doc_is_current(capsys):
    assert main(["config-reference"]) == 0
    generated = capsys.readouterr().out
    document = (ROOT / "docs" / "config.md").read_text()
    assert generated in document, "docs/config.md is stale: regenerate it with `grpo config-reference`"


@pytest.mark.slow
def test_shipped_configs_work_from_any_directory(tmp_path):
    """`grpo check-config deploy/configs/tiny-cpu.yaml` (what `grpo run`/`grpo demo` read) outside the repository;
    --schema-only, as the model folders they name are built by `make demo` / `grpo fetch-model`."""
    grpo = Path(sys.executable).parent / "grpo"
    for name in ("deploy/configs/tiny-cpu.yaml", "tiny-cpu", "qwen2.5-0.5b-gsm8k.yaml"):
        result = subprocess.run([str(grpo), "check-config", "--schema-only", name], capture_output=True, text=True, timeout=60,
                                cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "learner:" in result.stdout
    missing = subprocess.run([str(grpo), "check-config", "no-such.yaml"], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path)
    assert missing.returncode == 2 and "no-such.yaml does not exist" in missing.stderr
    assert "tiny-cpu" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize(("argv", "module", "read"), [
    (["run", "CONFIG"], "deploy.launcher.run", lambda c: c.run.console),
    (["run", "CONFIG", "--verbose"], "deploy.launcher.run", lambda c: c.run.console),
    (["ref-server", "--config", "CONFIG"], "ref_server.server.serve", lambda c: c.ref_server.access_log),
    (["ref-server", "--config", "CONFIG", "--access-log"], "ref_server.server.serve",
     lambda c: c.ref_server.access_log),
])
def test_console_flags_reach_the_config(argv, module, read, tmp_path, monkeypatch):
    """`grpo run --verbose` is run.console=full, `grpo ref-server --access-log` is ref_server.access_log=true; both
    off by default. (The command's work is replaced by a recorder: what matters here is the config it gets.)"""
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\n")
    seen = []
    monkeypatch.setattr(module, lambda config, **flags: seen.append(read(config)) or 0)
    # the checks before start (deploy/preflight.py) would refuse this model-less config; they have tests of their own
    monkeypatch.setattr("deploy.preflight.require", lambda config, checks: None)
    assert main([str(path) if a == "CONFIG" else a for a in argv]) == 0
    flagged = "--verbose" in argv or "--access-log" in argv
    assert seen == [("full" if flagged else "progress") if argv[0] == "run" else flagged]
