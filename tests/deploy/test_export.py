"""`grpo export --merge` checks its paths before loading anything: a missing checkpoint is named as missing (not as
"holds no LoRA adapter"), and an OUT that holds files is refused unless --force, which replaces its weights."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from deploy.cli import main as grpo


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_missing_checkpoint_is_named_as_missing(tmp_path, capsys):
    assert grpo(["export", "--merge", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert f"no checkpoint folder {tmp_path / 'nope'}" in one_line(capsys)
    (tmp_path / "file").write_text("x")
    assert grpo(["export", "--merge", str(tmp_path / "file"), str(tmp_path / "out")]) == 2
    assert "is a file, not a checkpoint folder" in one_line(capsys)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def adapter(tmp_path, tiny_model_dir):
    """A peft adapter folder of the tiny model, its B matrices non-zero (so the merge changes the weights)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.fill_(0.01)
    folder = tmp_path / "adapter"
    peft.save_pretrained(str(folder))
    return folder


def test_an_out_folder_with_files_is_refused_unless_force(tmp_path, adapter, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "model-00002-of-00002.safetensors").write_bytes(b"an earlier model's shard")
    assert grpo(["export", "--merge", str(adapter), str(out)]) == 2
    assert f"OUT {out} already exists and is not empty; pass --force" in one_line(capsys)
    assert (out / "model-00002-of-00002.safetensors").read_bytes() == b"an earlier model's shard"   # untouched
    assert grpo(["export", "--merge", str(adapter), str(adapter)]) == 2
    assert "is the checkpoint folder itself" in one_line(capsys)

    assert grpo(["export", "--merge", "--force", str(adapter), str(out)]) == 0
    assert (out / "notes.txt").read_text() == "mine"                            # not a weight file: kept
    assert not (out / "model-00002-of-00002.safetensors").exists()             # no stale shard beside the new one
    weights = load_file(str(out / "model.safetensors"))
    assert not any("lora" in name for name in weights)
    # an empty folder, or a new one, needs no --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert grpo(["export", "--merge", str(adapter), str(empty)]) == 0
