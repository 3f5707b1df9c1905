"""The tiny local Llama + char tokenizer: exact round trips, stable ids, and save/load parity."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy.demo.tiny_model import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_model_dir,
    count_parameters,
    default_alphabet,
    save_model_dir,
)
from generator.tasks.arithmetic import ArithmeticTask
from shared.config.schema import DemoConfig

ROUND_TRIP = [
    "12 + 3 = <answer>15</answer>",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n",
    "<think>7*6 is 42</think>\n<answer>42</answer>",
    "(a/b): what? yes! no, maybe. <>//",
    "<answer><answer></answer>",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    model = build_tiny_model(tok, TinyModelSpec())
    out = save_model_dir(model, tok, tmp_path_factory.mktemp("tiny"))
    return model, out


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip_is_exact(tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text  # tags are not special


def test_vocab_layout_is_fixed(tok) -> None:
    vocab = tok.get_vocab()
    chars = sorted(set(default_alphabet()))
    expected = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    expected.update({c: 4 + i for i, c in enumerate(chars)})
    expected.update(
        {t: 4 + len(chars) + i for i, t in enumerate(["<answer>", "</answer>", "<think>", "</think>"])}
    )
    assert vocab == expected
    assert len(tok) == len(expected) == 86
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert set(string.digits + " \n+-*=") <= set(vocab)


def test_ids_do_not_depend_on_alphabet_order_or_rebuild(tok) -> None:
    assert build_char_tokenizer().get_vocab() == tok.get_vocab()
    assert build_char_tokenizer("cab").get_vocab() == build_char_tokenizer("abcba").get_vocab()


def test_encode_adds_nothing_and_tags_are_single_tokens(tok) -> None:
    assert tok.encode("1") == [tok.convert_tokens_to_ids("1")]
    assert tok("1 2")["input_ids"] == tok.convert_tokens_to_ids(["1", " ", "2"])
    ids = tok.encode("<answer>-8</answer>")
    assert tok.convert_ids_to_tokens(ids) == ["<answer>", "-", "8", "</answer>"]
    assert tok.encode("<think>") == [tok.convert_tokens_to_ids("<think>")]


def test_skip_special_drops_only_pad_bos_eos_unk(tok) -> None:
    ids = (
        [tok.bos_token_id]
        + tok.encode("<answer>5</answer>")
        + [tok.eos_token_id, tok.pad_token_id, tok.unk_token_id]
    )
    assert tok.decode(ids, skip_special_tokens=True) == "<answer>5</answer>"
    assert tok.decode(ids) == "<s><answer>5</answer></s><pad><unk>"
    assert tok.encode("é\t") == [tok.unk_token_id, tok.unk_token_id]


def test_model_shape_and_size(tok) -> None:
    model = build_tiny_model(tok, TinyModelSpec())
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, 0)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    v, h, i, n_layers = len(tok), cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    # Tied embedding + per layer (q,k,v,o + gate,up,down + 2 norms) + final norm; no biases.
    assert count_parameters(model) == v * h + n_layers * (4 * h * h + 3 * h * i + 2 * h) + h == 902_208
    assert 500_000 <= count_parameters(model) <= 2_000_000  # "about 1M parameters"


def test_init_is_deterministic_and_leaves_global_rng_alone(tok) -> None:
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(tok, TinyModelSpec(seed=5))
    assert torch.equal(torch.rand(3), expected_draw)  # fork_rng: caller's stream untouched
    b = build_tiny_model(tok, TinyModelSpec(seed=5))
    c = build_tiny_model(tok, TinyModelSpec(seed=6))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_saved_folder_contents(saved) -> None:
    _, out = saved
    names = {p.name for p in Path(out).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )


def test_save_load_parity(tok, saved) -> None:
    model, out = saved
    loaded_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert (loaded_tok.pad_token_id, loaded_tok.bos_token_id, loaded_tok.eos_token_id) == (0, 1, 2)
    for text in ROUND_TRIP:
        assert loaded_tok.encode(text) == tok.encode(text)
        assert loaded_tok.decode(loaded_tok.encode(text)) == text
    ids = torch.tensor([tok.encode("12 + 3 = <answer>15</answer>\nok")])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight


def test_build_tiny_model_dir_writes_stats_and_a_loadable_model(tmp_path) -> None:
    """Mechanics only (a few steps); the default warm-up's accuracy is checked in test_warmup.py."""
    warmup = DemoConfig(warmup_steps=8, batch_size=8, heldout_examples=8, warmup_target_accuracy=None,
                        flawed_steps=0)
    stats = build_tiny_model_dir(tmp_path, task=ArithmeticTask(), warmup=warmup, spec=TinyModelSpec())
    on_disk = json.loads((tmp_path / "grpo_tiny_model.json").read_text())
    assert on_disk == stats
    assert stats["warmup_steps"] == 8 and stats["heldout_n"] == 8
    assert stats["params"] == count_parameters(AutoModelForCausalLM.from_pretrained(tmp_path))
    assert stats["warmup_loss_last"] < stats["warmup_loss_first"]
    assert 0.0 <= stats["heldout_accuracy"] <= 1.0 and stats["warmup_seconds"] > 0
    assert stats["warmup"]["warmup_steps"] == 8 and stats["warmup"]["seed"] == 0 and stats["task"]["max_value"] == 99
