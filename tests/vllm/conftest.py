"""What the vLLM tests share: the tiny model in a shape vLLM's CPU build serves.

These tests run in .venv-vllm (``make test-vllm``); elsewhere each module skips at its ``pytest.importorskip("vllm")``.
So this file imports only pytest when collected, and the model code inside its fixtures. A module that uses them
says which model it wants with ``MODEL_SEED``, and opens its engines with ``served_vllm``."""

import contextlib

import pytest

# vLLM's CPU attention supports head sizes of 32 and up; the default tiny model has 16-dim heads
VLLM_HEADS = {"num_attention_heads": 6, "num_key_value_heads": 6}
# how every engine of these tests is served: on the CPU, a 256-token context, seed 0
VLLM_SETTINGS = {"device": "cpu", "max_model_len": 256, "seed": 0}


@pytest.fixture(scope="module")
def vllm_spec(request):
    """The tiny model's spec with 32-dim heads, seeded by the test module's ``MODEL_SEED``."""
    from deploy.demo.tiny_model import TinyModelSpec

    return TinyModelSpec(seed=request.module.MODEL_SEED, **VLLM_HEADS)


@pytest.fixture(scope="module")
def model_dir(vllm_spec, tmp_path_factory):
    """The tiny character-level model of ``vllm_spec`` as a Hugging Face folder, for vLLM and transformers alike."""
    from deploy.demo.tiny_model import build_char_tokenizer, build_tiny_model, save_model_dir

    tokenizer = build_char_tokenizer()
    return save_model_dir(build_tiny_model(tokenizer, vllm_spec), tokenizer, tmp_path_factory.mktemp("vllm-model"))


@contextlib.contextmanager
def _served(model_dir, **extra):
    from generator.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, **VLLM_SETTINGS, **extra)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session")
def served_vllm():
    """``with served_vllm(model_dir, **extra) as engine``: a :class:`VLLMEngine` of ``model_dir`` with
    ``VLLM_SETTINGS`` (and ``extra``, e.g. ``lora=``), closed when the block ends."""
    return _served
