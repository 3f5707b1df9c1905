"""A tiny (0.9M-parameter) Llama with a character-level tokenizer, built locally with no network access.

Why it exists: tests and CPU demos need a real ``transformers`` causal LM folder (config, safetensors,
tokenizer) that every component loads exactly the way it would load a hub model, but nothing may be
downloaded. A character-level vocabulary keeps the embedding tiny and makes tokenization trivially exact.

Why Llama and not Qwen2: transformers 5 rebuilds a Qwen2 tokenizer from vocab/merges and ignores the saved
``tokenizer.json``, which drops spaces; for Llama the saved tokenizer class wins and round trips are exact.

Tokenizer contract: no BOS/EOS is added on encode (``add_special_tokens`` is a no-op), so prompt ids are
exactly the characters; whoever builds a training sequence appends ``eos_token_id`` explicitly.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from deploy.demo.greedy import evaluate_greedy
from deploy.demo.sft_data import validation_problems
from deploy.demo.warmup import flawed_teacher_finetune, needs_validation, supervised_warmup, warmup_record
from generator.tasks.arithmetic import ArithmeticTask
from generator.tasks.chain import ChainTask
from shared.config.schema import DemoConfig


def default_alphabet() -> str:
    """Digits, arithmetic symbols, space, letters, punctuation, newline and the tag characters ``< > /``."""
    return string.digits + "+-*=() " + string.ascii_letters + ".,:?!\n<>/"


def build_char_tokenizer(
    corpus_chars: str | None = None,
    special_tokens: tuple[str, ...] = ("<pad>", "<s>", "</s>", "<unk>"),
    tag_tokens: tuple[str, ...] = ("<answer>", "</answer>", "<think>", "</think>"),
) -> PreTrainedTokenizerFast:
    """One token per character, ``<pad>`` = 0, plus the tags as single *non-special* tokens.

    The tags are added tokens but not special ones, so ``skip_special_tokens=True`` keeps them (a reward
    function must still see ``<answer>``) and drops only pad/bos/eos/unk. The characters are deduplicated and
    sorted before training so every one has count 1 and ids depend only on the alphabet, not its order.
    """
    chars = "".join(sorted(set(default_alphabet() if corpus_chars is None else corpus_chars)))
    tok = Tokenizer(models.WordLevel(unk_token=special_tokens[3]))
    # "[\s\S]" rather than ".": Oniguruma's "." does not match "\n", and newlines must survive.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # decode = plain concatenation, so spaces are never inserted or eaten
    trainer = trainers.WordLevelTrainer(
        vocab_size=len(chars) + len(special_tokens) + 1,
        min_frequency=1,
        special_tokens=list(special_tokens),
        show_progress=False,
    )
    tok.train_from_iterator([chars], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=special_tokens[0],
        bos_token=special_tokens[1],
        eos_token=special_tokens[2],
        unk_token=special_tokens[3],
        clean_up_tokenization_spaces=False,
    )
    fast.add_tokens(list(tag_tokens))
    return fast


@dataclass
class TinyModelSpec:
    """Shape of the tiny Llama: 2 layers x 192 wide, 12 heads of 16 dims, MLP 512, 902,208 parameters.

    Chosen by measurement on the arithmetic warm-up (batch 128, held-out accuracy, 1 thread): depth slows the
    "last digit" jump most (6 x 128 layers reached 11% after 600 steps, ~50% after 1500), so the model is 2 wide
    layers: 2 x 192 with 12 heads of 16 dims and a 512 MLP, 0.9M parameters, reaches 15-28% after 400 steps
    (~45 s on one thread). A 2 x 128 variant (0.34M) learns about as fast at a third of the cost per step.
    """

    hidden_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    intermediate_size: int = 512
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    seed: int = 0


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, spec: TinyModelSpec) -> LlamaForCausalLM:
    """A freshly initialised Llama sized for ``tokenizer``; same spec + tokenizer -> same weights.

    The seed is applied inside ``fork_rng`` so building a model does not disturb the caller's torch RNG.
    """
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model.eval()


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embedding/lm_head counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_model_dir(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: str | Path,
    tokenizer_class: str = "PreTrainedTokenizerFast",
) -> Path:
    """Write a folder that ``AutoModelForCausalLM``/``AutoTokenizer.from_pretrained`` load offline.

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, a name transformers 4 (which vLLM may pin in
    a GPU environment) does not know. Both versions map ``PreTrainedTokenizerFast`` to a tokenizer backed by
    our ``tokenizer.json``, so the config is rewritten to that name.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = tokenizer_class
    config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")
    return out


def build_tiny_model_dir(
    out_dir: str | Path,
    *,
    task: ArithmeticTask | ChainTask | None = None,
    warmup: DemoConfig | None = None,
    seed: int = 0,
    spec: TinyModelSpec | None = None,
) -> dict:
    """Build tokenizer + model, warm it up on ``task`` as ``warmup`` (the config's ``demo`` section, default its
    defaults) says with the data drawn from ``seed``, save it, and return/write stats.

    The stats (also in ``out_dir/grpo_tiny_model.json``) record where RL starts from: a demo that claims
    "RL raised accuracy by N points" needs the warm-up accuracy measured on the same held-out split. With
    accuracy targets they also say how many steps each phase took and what its validation checks measured.
    """
    task = task or ArithmeticTask()
    warmup = warmup or DemoConfig()
    spec = spec or TinyModelSpec()
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, spec)
    heldout = task.sample(warmup.heldout_examples, "test", random.Random(warmup.heldout_seed))
    validation = validation_problems(task, warmup) if needs_validation(warmup) else []

    def heldout_eval():
        return evaluate_greedy(model, tokenizer, task, heldout, max_new_tokens=warmup.greedy_max_new_tokens)

    before = heldout_eval()
    started = time.perf_counter()
    clean_phase = supervised_warmup(model, tokenizer, task, warmup, seed, validation)
    clean = heldout_eval()
    flawed_phase = flawed_teacher_finetune(model, tokenizer, task, warmup, seed, validation)
    seconds = time.perf_counter() - started
    after = heldout_eval() if flawed_phase.losses else clean

    out = save_model_dir(model, tokenizer, out_dir)
    stats = {
        "params": count_parameters(model),
        "vocab_size": len(tokenizer),
        **_loss_stats(clean_phase.losses),
        "warmup_seconds": round(seconds, 3),
        "torch_threads": torch.get_num_threads(),  # seconds mean little without it
        "heldout_n": len(heldout),
        "heldout_accuracy_before": before.accuracy,
        "heldout_accuracy": after.accuracy,
        "heldout_accuracy_clean_phase": clean.accuracy,
        "flawed_steps": len(flawed_phase.losses),
        "heldout_format_rate": after.format_rate,
        "validation_n": len(validation),
        "validation_accuracy_clean_phase": clean_phase.validation_accuracy,
        "validation_accuracy": flawed_phase.validation_accuracy if flawed_phase.losses
        else clean_phase.validation_accuracy,
        "validation_checks": {"clean_phase": clean_phase.checks, "flawed_phase": flawed_phase.checks},
        "spec": asdict(spec),
        "warmup": warmup_record(warmup, seed),
        "task": asdict(task),
    }
    text = json.dumps(stats, indent=2, sort_keys=True) + "\n"
    (out / "grpo_tiny_model.json").write_text(text)
    return json.loads(text)  # tuples become lists: the returned dict equals what a reader of the file sees


def _loss_stats(losses: list[float]) -> dict:
    """Steps taken and mean loss over the first/last 10 steps (never overlapping)."""
    window = max(1, min(10, len(losses) // 2))
    head, tail = losses[:window], losses[-window:]
    return {
        "warmup_steps": len(losses),
        "warmup_loss_first": sum(head) / max(len(head), 1),
        "warmup_loss_last": sum(tail) / max(len(tail), 1),
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m deploy.demo.tiny_model OUT_DIR [--steps N] [--seed S]``: build a warmed-up tiny model folder
    (the demo section's defaults; ``--steps``: its ``warmup_steps``)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=DemoConfig().warmup_steps)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    stats = build_tiny_model_dir(args.out_dir, warmup=DemoConfig(warmup_steps=args.steps), seed=args.seed)
    print(json.dumps({k: v for k, v in stats.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
    main()
