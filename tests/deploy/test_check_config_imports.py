"""`grpo check-config` imports no torch: the registries a config names are checked from their source
(shared/registry.py declared_names), so a config is checked in about a second, not after torch's ~3 s import."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the command as the console script runs it, then whether torch was imported on the way
PROBE = ("import sys\nfrom deploy.cli import main\ncode = main(sys.argv[1:])\n"
         "print('exit', code, 'torch imported:', 'torch' in sys.modules, file=sys.stderr)\nsys.exit(code)\n")


def check_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, "check-config", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow  # a fresh interpreter: what the user's `grpo check-config` imports
def test_check_config_schema_only_imports_no_torch():
    done = check_config("deploy/configs/tiny-cpu.yaml", "--schema-only")
    assert done.stderr.strip().endswith("exit 0 torch imported: False"), done.stderr
    assert "kl_estimator: k3" in done.stdout and "aggregation: token-mean" in done.stdout


@pytest.mark.slow
def test_check_config_with_every_check_imports_no_torch(tiny_model_dir):
    """Model folders, the dataset and the fields its rewards read, the rewards built: still no torch."""
    done = check_config("deploy/configs/tiny-cpu.yaml", "--set", f"learner.model={tiny_model_dir}",
                        "--set", f"generator.model={tiny_model_dir}")
    assert done.stderr.strip().endswith("exit 0 torch imported: False"), done.stderr
    assert f"model: {tiny_model_dir}" in done.stdout


@pytest.mark.slow
def test_a_misspelt_name_is_still_refused_with_the_known_names():
    done = check_config("deploy/configs/tiny-cpu.yaml", "--schema-only", "--set", "algorithm.loss.kl_estimator=k4")
    assert "unknown KL estimator 'k4'; known: k1, k2, k3, kl, low_var_kl, mse" in done.stderr, done.stderr
    assert done.returncode == 2  # (an unknown name imports the registry's module: its message is the registry's)
