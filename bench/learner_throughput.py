"""Benchmark: learner tokens/s and peak memory per GRPO step at DeepSpeed ZeRO stages 0, 2 and 3.

Drives the real learner code path on a synthetic batch: :func:`learner.engine.create_engine` (the DeepSpeed
config generated from :class:`shared.config.schema.LearnerConfig`), :func:`learner.step.split_micro_batches` and
:func:`learner.step.grpo_step` (forward + backward over the micro-batches, one optimizer step), with the loss
of :class:`shared.config.schema.LossConfig` (beta 0.04 and reference logprobs attached, so the KL path runs), and the
learner's defaults otherwise (``old_logprobs='behaviour'``, entropy logged, default logprob chunking).

Model: a Qwen2-shaped causal LM built from a config with random weights (``AutoModelForCausalLM.from_config``,
fixed seed; nothing is downloaded). Presets:

* ``cpu-small`` (default on CPU): hidden 256, 4 layers, 4 heads (2 KV heads), intermediate 688, vocab 8192,
  tied embeddings, 5.0 M parameters; default batch 4 groups x 4 completions, 64 prompt + 128 completion
  tokens, 2 micro-batches (gradient accumulation runs in every stage).
* ``qwen2.5-0.5b`` (default on CUDA): Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
  intermediate 4864, vocab 151936, tied embeddings, rope_theta 1e6), 494 M parameters; default batch 4 groups
  x 8 completions, 256 prompt + 1024 completion tokens, 1 micro-batch.

Batch: ``--groups`` :class:`shared.protocol.records.RolloutGroup` of ``--group-size`` completions, random prompt and
completion ids (every completion full length, so no padding, unless ``--completion-len-min`` makes each
completion's length uniform in [min, ``--completion-len``]: mixed lengths, as real rollouts have), uniform
random rewards, behaviour logprobs
``-U(log V - 0.5, log V + 0.5)`` (about what a random-weight model assigns, so importance ratios are ~1 rather
than all clipped), reference logprobs = behaviour + U(-0.1, 0.1); :meth:`TrainBatch.from_groups` and the learner compute the
GRPO advantages.

Every ZeRO stage runs in a fresh child process (``--_child``): DeepSpeed keeps global state, and peak-memory
counters are per process. The child describes a world of one (``ensure_single_process_env`` +
``init_distributed``), builds the model and the engine, runs one warm-up step (whose loss is the "first-step
loss": the same model, data and seed in every stage, so it must agree across stages), then times ``--steps``
steps (median reported, and the fastest step as "best"). tokens/s = (prompt + completion tokens of the batch)
/ step time. ``--rounds R`` runs the stage list R times interleaved (0 2 3 0 2 3 ...) and reports each stage's
median round, so that a change in the machine's load hits every stage alike.

Memory of the timed steps: on CPU, the child calls ``malloc_trim(0)``, reads ``VmRSS``, resets the kernel's
peak-RSS counter (``/proc/self/clear_refs`` <- ``5``), runs the steps, and reports peak extra = ``VmHWM`` -
``VmRSS`` before, plus ``VmHWM`` itself (peak total) and the RSS after model construction (so the steady
state the engine adds: weights' copies, gradient buffers, optimizer states). On CUDA: ``max_memory_allocated``
- ``memory_allocated`` before (after ``reset_peak_memory_stats``), plus the absolute ``max_memory_allocated``.
MFU (CUDA) = 6 x parameters x tokens/s / ``--peak-tflops`` (default 989: H100 SXM bf16 dense); the JSON also
holds the variant with the attention term (6N + 12 x layers x hidden x sequence length per token). tokens/s
counts real tokens (prompt + completion of every row), never padding.

Layouts: ``--layouts`` runs every stage with each ``PACKING[:TOKENS]``: ``learner.packing`` (``padded``,
``packed``, ``auto``; default the learner's default ``auto``) and optionally ``learner.micro_batch_tokens``
(without it, ``--micro-batches`` whole-group micro-batches: the learner before token budgets). Ratios are against
the first (stage, layout) row of the same run; the first-step losses of all rows must agree (the layout changes
how the work is cut, not the numbers).

With one process ZeRO-2/3 partition nothing across ranks (a world of one holds every partition), but their
code paths do run: ZeRO-2's flat fp32 gradient/optimizer partitions and bucketed reductions, ZeRO-3's
parameter partitioning with a gather/release per module in forward and backward. The numbers therefore show
the single-rank overhead of each stage, not the memory saved across ranks.

Run from the repository root::

    .venv/bin/python bench/learner_throughput.py                                  # CPU, cpu-small, ZeRO 0 2 3
    .venv/bin/python bench/learner_throughput.py --gradient-checkpointing
    .venv/bin/python bench/learner_throughput.py --zero-stages 0 --completion-len-min 16 \
        --layouts padded packed auto:544 packed:544
    .venv/bin/python bench/learner_throughput.py --device cuda                    # qwen2.5-0.5b preset, bf16
    .venv/bin/python bench/learner_throughput.py --preset qwen2.5-0.5b --device cuda --dry-run  # no GPU used

Exit status 0 unless ``--strict`` (then 1 if a stage fails, a loss is not finite, or the first-step or last
losses disagree across stages).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
ROOT = Path(__file__).resolve().parents[1]

PRESETS = {
    "cpu-small": {
        "model": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=688, vocab_size=8192, max_position_embeddings=2048,
                      tie_word_embeddings=True, rope_theta=10000.0),
        "batch": dict(groups=4, group_size=4, prompt_len=64, completion_len=128, micro_batches=2),
    },
    "qwen2.5-0.5b": {
        # Qwen/Qwen2.5-0.5B's config.json shape (random weights: nothing is downloaded).
        "model": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                      tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      hidden_act="silu", use_sliding_window=False),
        "batch": dict(groups=4, group_size=8, prompt_len=256, completion_len=1024, micro_batches=1),
    },
}


# ----------------------------------------------------------------------------------------------- both sides


def model_config(preset: str):
    from transformers import Qwen2Config

    return Qwen2Config(**PRESETS[preset]["model"])


def count_params(config) -> int:
    """Unique parameters (tied embeddings counted once), from a meta-device model: no memory, no time."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def flops_per_token(n_params: int, config, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token: 6N (the usual MFU numerator) and 6N + 12 * layers * q-width * seq_len."""
    q_width = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    return {"6N": 6.0 * n_params,
            "6N+attn": 6.0 * n_params + 12.0 * config.num_hidden_layers * q_width * seq_len}


# ----------------------------------------------------------------------------------------------- child side

from procmem import malloc_trim as _malloc_trim  # noqa: E402 - bench/ is on sys.path when run as a script
from procmem import proc_status_kib as _proc_status_kib  # noqa: E402
from procmem import reset_peak_rss as _reset_peak_rss  # noqa: E402


def synthetic_batch(args: argparse.Namespace, vocab: int):
    """A TrainBatch of ``args.groups`` random groups (fixed seed), with reference logprobs."""
    import torch

    from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch

    gen = torch.Generator().manual_seed(args.seed + 1)
    g, p, c = args.group_size, args.prompt_len, args.completion_len
    centre = math.log(vocab)
    groups, refs = [], []
    shortest = args.completion_len_min if args.completion_len_min is not None else c
    for i in range(args.groups):
        behaviour = -(centre - 0.5 + torch.rand(g, c, generator=gen))
        lengths = torch.randint(shortest, c + 1, (g,), generator=gen).tolist()
        prompt = torch.randint(0, vocab, (p,), generator=gen)
        completions = torch.randint(0, vocab, (g, c), generator=gen)
        group = RolloutGroup.from_samples(
            prompt_ids=prompt.tolist(),
            completion_ids=[completions[j, :n].tolist() for j, n in enumerate(lengths)],
            behaviour_logprobs=[behaviour[j, :n].tolist() for j, n in enumerate(lengths)],
            rewards=torch.rand(g, generator=gen).tolist(),
            finish_reasons=["stop"] * g, policy_version=0, generator_id="bench",
            sampling=SamplingParams(temperature=1.0, max_tokens=c), group_id=f"bench-{i}",
        ).validate(vocab)
        groups.append(group)
        refs.append(behaviour + (torch.rand(g, c, generator=gen) - 0.5) * 0.2)
    return TrainBatch.from_groups(groups, refs)


def _child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from learner.advantages import batch_advantages
    from learner.engine import (
        create_engine,
        ensure_single_process_env,
        init_distributed,
        uses_bf16,
    )
    from learner.step import grpo_step, split_micro_batches
    from shared.config.schema import AdvantageConfig, LearnerConfig, LossConfig
    from shared.devices import resolve_device

    ensure_single_process_env()
    device = resolve_device(args.device, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    init_distributed(device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    config = model_config(args.preset)
    cfg = LearnerConfig(model=f"random-init:{args.preset}", zero_stage=args.zero_stage,
                        groups_per_step=args.groups, micro_batches=args.micro_batches,
                        precision=args.precision, gradient_checkpointing=args.gradient_checkpointing,
                        lr=args.lr, device=args.device, packing=args.packing,
                        micro_batch_tokens=args.micro_batch_tokens)
    loss_cfg = LossConfig(beta=0.04)
    dtype = torch.bfloat16 if uses_bf16(cfg, device) else torch.float32

    _malloc_trim()
    rss_start = _proc_status_kib("VmRSS")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    _malloc_trim()
    rss_model = _proc_status_kib("VmRSS")

    batch = synthetic_batch(args, config.vocab_size)
    tokens = int((batch.prompt_lengths + batch.completion_lengths).sum())
    micro = split_micro_batches(batch, batch_advantages(batch, AdvantageConfig()), cfg.micro_batches,
                                cfg.mask_truncated, device, token_budget=cfg.micro_batch_tokens, packing=cfg.packing)
    padded_tokens = sum(mb.input_ids.numel() for mb in micro)

    t0 = time.perf_counter()
    engine = create_engine(cfg, model, device)
    engine_s = time.perf_counter() - t0
    del model

    def step():
        # the step alone: pi_old from the behaviour logprobs, no recompute forward (bypass)
        out = grpo_step(engine, micro, loss_cfg, temperature=batch.temperature, old_mode="behaviour",
                        world_size=1, log_entropy=cfg.log_entropy, chunk_tokens=cfg.logprob_chunk_tokens)
        sync()
        return out

    sync()
    t0 = time.perf_counter()
    first = step()
    first_step_s = time.perf_counter() - t0

    mem: dict = {}
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        mem["steady_mib"] = before / MIB
    else:
        _malloc_trim()
        rss_before = _proc_status_kib("VmRSS")
        hwm_reset = _reset_peak_rss()
        mem["rss_start_mib"] = rss_start / 1024
        mem["rss_model_mib"] = rss_model / 1024
        mem["steady_mib"] = rss_before / 1024

    times, losses, metrics = [], [], {}
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = step()
        times.append(time.perf_counter() - t0)
        losses.append(out.loss)
        metrics = out.metrics

    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        mem["peak_extra_mib"] = (peak - before) / MIB
        mem["peak_total_mib"] = peak / MIB
        mem["max_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
        mem["method"] = "torch.cuda.max_memory_allocated - memory_allocated before the timed steps"
    else:
        hwm = _proc_status_kib("VmHWM")
        mem["peak_total_mib"] = hwm / 1024
        mem["peak_extra_mib"] = (hwm - rss_before) / 1024
        mem["method"] = ("VmHWM (reset via /proc/self/clear_refs) - VmRSS before the timed steps" if hwm_reset
                         else "VmHWM (NOT reset: includes set-up peaks) - VmRSS before the timed steps")

    step_s = statistics.median(times) if times else first_step_s
    result = {
        "zero_stage": args.zero_stage,
        "layout": args.packing + (f":{args.micro_batch_tokens}" if args.micro_batch_tokens else ""),
        "micro_batches": len(micro),
        "padded_tokens_per_step": padded_tokens,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "n_params": n_params,
        "tokens_per_step": tokens,
        "step_s": step_s,
        "times_s": times,
        "tokens_per_s": tokens / step_s,
        "best_tokens_per_s": tokens / min(times) if times else tokens / first_step_s,
        "first_step_s": first_step_s,
        "engine_init_s": engine_s,
        "first_step_loss": first.loss,
        "first_step_grad_norm": first.metrics.get("grad_norm"),  # None: ZeRO-0 in fp32 (DeepSpeed keeps none)
        "first_step_finite": first.finite,
        "losses": losses,
        "all_finite": first.finite and all(math.isfinite(x) for x in losses),
        "last_metrics": metrics,
        "threads": torch.get_num_threads(),
        **mem,
    }
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
    print("CHILD_JSON " + json.dumps(result), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- parent side


def _loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def _fmt(value: float | None, spec: str) -> str:
    width = int(spec.split(".")[0])
    return format(value, spec) if value is not None else f"{'-':>{width}}"


def _combine(results: list[dict]) -> dict:
    """One row per stage: the first failure if any round failed, else the median over rounds of tokens/s."""
    failed = [r for r in results if not r["ok"]]
    if failed:
        return failed[0]
    row = dict(sorted(results, key=lambda r: r["tokens_per_s"])[len(results) // 2])  # median round (upper)
    row["best_tokens_per_s"] = max(r["best_tokens_per_s"] for r in results)  # fastest step of any round
    if len(results) > 1:
        row["tokens_per_s_rounds"] = [r["tokens_per_s"] for r in results]
        row["peak_extra_mib_rounds"] = [r["peak_extra_mib"] for r in results]
        row["first_step_loss_rounds"] = [r["first_step_loss"] for r in results]
    return row


def _run_child(args: argparse.Namespace, stage: int, layout: str, round_: int = 0) -> dict:
    packing, _, budget = layout.partition(":")
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", "--zero-stage", str(stage), "--packing", packing,
           "--preset", args.preset, "--device", args.device, "--precision", args.precision,
           "--groups", str(args.groups), "--group-size", str(args.group_size),
           "--prompt-len", str(args.prompt_len), "--completion-len", str(args.completion_len),
           "--micro-batches", str(args.micro_batches), "--steps", str(args.steps), "--lr", str(args.lr),
           "--seed", str(args.seed), "--rounds", "1"]
    if args.completion_len_min is not None:
        cmd += ["--completion-len-min", str(args.completion_len_min)]
    if budget:
        cmd += ["--micro-batch-tokens", budget]
    if args.gradient_checkpointing:
        cmd.append("--gradient-checkpointing")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    env.pop("RANK", None)  # a fresh world of one per child, whatever launched the parent
    env.pop("WORLD_SIZE", None)
    print(f"  running ZeRO-{stage} {layout}{f' (round {round_ + 1}/{args.rounds})' if args.rounds > 1 else ''} ...",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t0
    if args.verbose:
        sys.stderr.write(proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD_JSON ") and proc.returncode == 0:
            result = json.loads(line[len("CHILD_JSON "):])
            result.update(ok=True, child_wall_s=wall)
            return result
    tail = "\n".join((proc.stdout + "\n" + proc.stderr).strip().splitlines()[-60:])
    print(f"  ZeRO-{stage} FAILED (exit code {proc.returncode}); last lines:\n{tail}", file=sys.stderr,
          flush=True)
    return {"zero_stage": stage, "layout": layout, "ok": False, "returncode": proc.returncode, "error_tail": tail,
            "child_wall_s": wall}


def _layout(text: str) -> str:
    packing, _, budget = text.partition(":")
    if packing not in ("auto", "packed", "padded") or (budget and not (budget.isdigit() and int(budget) > 0)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto|packed|padded, optionally :TOKENS (a positive "
                                         "integer)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model shape (default: cpu-small on CPU, qwen2.5-0.5b on CUDA)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--zero-stages", type=int, nargs="+", default=[0, 2, 3], choices=[0, 1, 2, 3])
    parser.add_argument("--groups", type=int, default=None,
                        help="groups per step (LearnerConfig.groups_per_step)")
    parser.add_argument("--group-size", type=int, default=None, help="completions per group")
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--completion-len", type=int, default=None)
    parser.add_argument("--completion-len-min", type=int, default=None,
                        help="each completion's length uniform in [this, --completion-len] (default: all full)")
    parser.add_argument("--layouts", nargs="+", type=_layout, default=["auto"],
                        help="PACKING[:TOKENS] each: learner.packing (auto, packed, padded) and optionally "
                             "learner.micro_batch_tokens; every stage runs each (ratios against the first)")
    parser.add_argument("--micro-batches", type=int, default=None, help="LearnerConfig.micro_batches")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after 1 warm-up step (median "
                        "reported; default 5 on CPU, 10 on CUDA)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the stage list this many times, interleaved (0 2 3 0 2 3 ...); each stage "
                             "reports its median round (for shared, noisy machines)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                        help="LearnerConfig.precision ('auto': fp32 on CPU, bf16 on GPU)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-6, help="learning rate (the learner's default 1e-6)")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="accelerator peak for MFU (default 989 = H100 SXM bf16 dense; H200 is the same)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the model's parameter count, the batch and FLOPs per step, then exit "
                             "(no engine, no GPU needed)")
    parser.add_argument("--verbose", action="store_true",
                        help="pass the children's stderr (DeepSpeed logs) through")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a stage fails, a loss is not finite or the first-step or last losses "
                             "disagree")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--zero-stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--packing", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.preset is None:
        args.preset = "qwen2.5-0.5b" if args.device == "cuda" else "cpu-small"
    for key, value in PRESETS[args.preset]["batch"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps is None:
        args.steps = 10 if args.device == "cuda" else 5

    if args._child:
        _child(args)
        return 0

    import torch

    config = model_config(args.preset)
    n_params = count_params(config)
    shortest = args.completion_len_min if args.completion_len_min is not None else args.completion_len
    seq_len = args.prompt_len + (shortest + args.completion_len) / 2  # mean row length
    tokens = round(args.groups * args.group_size * seq_len)
    fpt = flops_per_token(n_params, config, seq_len)
    precision = args.precision if args.precision != "auto" else ("bf16" if args.device == "cuda" else
                                                                 "fp32" if args.device == "cpu" else "auto")
    print(f"learner throughput benchmark: preset {args.preset} (Qwen2-shaped, random weights: hidden "
          f"{config.hidden_size}, {config.num_hidden_layers} layers, {config.num_attention_heads} heads / "
          f"{config.num_key_value_heads} KV, intermediate {config.intermediate_size}, vocab "
          f"{config.vocab_size}, tied embeddings {config.tie_word_embeddings}), {n_params / 1e6:.2f} M "
          f"parameters", flush=True)
    lengths = f"{shortest}..{args.completion_len}" if shortest != args.completion_len else f"{args.completion_len}"
    print(f"  batch: {args.groups} groups x {args.group_size} completions x ({args.prompt_len} prompt + "
          f"{lengths} completion) tokens = ~{tokens} tokens/step, {args.micro_batches} "
          f"micro-batch(es) unless a token budget is given; layouts {' / '.join(args.layouts)}; beta 0.04 with reference logprobs; device {args.device}, precision "
          f"{precision}, gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}; 1 warm-up "
          f"+ {args.steps} timed steps per stage"
          f"{f', {args.rounds} interleaved rounds' if args.rounds > 1 else ''}", flush=True)
    print(f"  training FLOPs/step: 6N x tokens = {fpt['6N'] * tokens / 1e12:.3f} TFLOP "
          f"(with attention {fpt['6N+attn'] * tokens / 1e12:.3f})", flush=True)
    if args.dry_run:
        print("dry run: nothing executed")
        print("BENCH_JSON " + json.dumps({
            "benchmark": "learner_throughput", "dry_run": True, "preset": args.preset, "device": args.device,
            "n_params": n_params, "tokens_per_step": tokens, "flops_per_token": fpt,
            "model_config": PRESETS[args.preset]["model"]}))
        return 0

    print("  note: one process (world size 1), so ZeRO-2/3 partition nothing across ranks; their code paths "
          "run (ZeRO-2: flat fp32 gradient/optimizer partitions, bucketed reduction; ZeRO-3: parameters "
          "partitioned and gathered/released per module in forward and backward)", flush=True)
    if args.device == "cuda":
        print(f"  MFU = 6 x {n_params / 1e6:.1f} M params x tokens/s / {args.peak_tflops:g} TFLOPS (assumed "
              f"peak; --peak-tflops)", flush=True)

    # Rounds run the stages interleaved (0 2 3 0 2 3 ...): a change in the machine's load hits every stage.
    load_start = _loadavg()
    keys = [(stage, layout) for stage in args.zero_stages for layout in args.layouts]
    runs = {key: [] for key in keys}
    for round_ in range(args.rounds):
        for stage, layout in keys:
            runs[stage, layout].append(_run_child(args, stage, layout, round_))
    rows = [_combine(runs[key]) for key in keys]
    good = [r for r in rows if r["ok"]]
    base = next((r for r in good if (r["zero_stage"], r["layout"]) == keys[0]), None)
    for r in good:
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        r["best_tokens_per_s_ratio"] = r["best_tokens_per_s"] / base["best_tokens_per_s"] if base else None
        r["peak_extra_ratio"] = (r["peak_extra_mib"] / base["peak_extra_mib"]
                                 if base and base["peak_extra_mib"] > 0 else None)
        r["achieved_tflops"] = fpt["6N"] * r["tokens_per_s"] / 1e12
        if args.device == "cuda":
            r["mfu"] = r["achieved_tflops"] / args.peak_tflops
            r["mfu_with_attention"] = fpt["6N+attn"] * r["tokens_per_s"] / 1e12 / args.peak_tflops

    every = [r for key in keys for r in runs[key] if r["ok"]]  # all rounds: must all agree
    first_losses = [r["first_step_loss"] for r in every]
    last_losses = [r["losses"][-1] for r in every if r["losses"]]
    first_diff = max(first_losses) - min(first_losses) if len(first_losses) > 1 else 0.0
    last_diff = max(last_losses) - min(last_losses) if len(last_losses) > 1 else 0.0
    scale = max((abs(x) for x in first_losses), default=1.0) or 1.0
    tol = 1e-5 if precision == "fp32" else 2e-2
    agree = all(math.isfinite(x) for x in first_losses) and first_diff <= tol * max(scale, 1.0)
    # The loss after the timed steps depends on every update: the same gradients and AdamW in every stage
    # should give the same value (bf16 weights barely move at lr 1e-6, so on GPU this check is weak).
    updates_agree = last_diff <= tol * max(max((abs(x) for x in last_losses), default=1.0), 1.0)
    norms = [r["first_step_grad_norm"] for r in every if r.get("first_step_grad_norm") is not None]
    norm_diff = (max(norms) - min(norms)) / max(max(norms), 1e-12) if len(norms) > 1 else 0.0
    finite = all(r["all_finite"] for r in good)
    ok = len(good) == len(rows) and finite and agree and updates_agree

    ref = "vs first"
    header = (f"{'stage':<7} {'layout':<12} {'mb':>3} {'pad %':>6} {'tokens/s':>10} {ref:>9} {'step s':>8} "
              f"{'best tok/s':>10} {ref:>9} "
              f"{'peak extra MiB':>14} {ref:>9} "
              f"{'peak total MiB':>14} {'steady MiB':>10} {'first-step loss':>16} {'grad norm':>10} "
              f"{'last loss':>12}")
    if args.device == "cuda":
        header += f" {'MFU':>7}"
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        if not r["ok"]:
            print(f"ZeRO-{r['zero_stage']:<2} {r['layout']:<12} FAILED (exit code {r['returncode']}; see the error "
                  "above and "
                  f"in the JSON)")
            continue
        ratio = lambda v: f"{v:>9.3f}" if v is not None else f"{'-':>9}"  # noqa: E731
        padding = 100 * (1 - r["tokens_per_step"] / r["padded_tokens_per_step"])
        line = (f"ZeRO-{r['zero_stage']:<2} {r['layout']:<12} {r['micro_batches']:>3} {padding:>6.1f} "
                f"{r['tokens_per_s']:>10.1f} {ratio(r['tokens_per_s_ratio'])} "
                f"{r['step_s']:>8.3f} {r['best_tokens_per_s']:>10.1f} {ratio(r['best_tokens_per_s_ratio'])} "
                f"{r['peak_extra_mib']:>14.1f} {ratio(r['peak_extra_ratio'])} "
                f"{r['peak_total_mib']:>14.1f} {r['steady_mib']:>10.1f} {r['first_step_loss']:>16.8f} "
                f"{_fmt(r.get('first_step_grad_norm'), '10.6f')} "
                f"{_fmt(r['losses'][-1] if r['losses'] else None, '12.8f')}")
        if args.device == "cuda":
            line += f" {100 * r['mfu']:>6.2f}%"
        print(line)
    print()
    if good:
        print(f"first-step loss (same model, data, seed; before any update): max difference across rows "
              f"{first_diff:.3e} (tolerance {tol:g} x max(|loss|, 1)): {'AGREE' if agree else 'DISAGREE'}")
        print(f"last loss (after the warm-up + {args.steps} updates): max difference {last_diff:.3e}: "
              f"{'AGREE' if updates_agree else 'DISAGREE: the stages applied different updates'}; first-step "
              f"grad norm (pre-clip, where DeepSpeed reports one) max relative difference {norm_diff:.3e}; "
              f"all losses finite: {finite}")
        print("layout: learner.packing[:micro_batch_tokens]; mb: micro-batches; pad %: padding in the padded [rows, width] micro-batches (what packing removes)")
        print("tokens/s: real tokens (no padding), median step of the median round; best tok/s: the fastest timed step of any round "
              "(less sensitive to other work on a shared machine)")
        print(f"memory method: {good[0]['method']}; 'steady' = "
              f"{'memory_allocated' if args.device == 'cuda' else 'VmRSS'} after the warm-up step (weights, "
              f"gradient buffers, optimizer states)")
        print(f"threads per child: {good[0]['threads']}; achieved "
              + ", ".join(f"ZeRO-{r['zero_stage']} {r['achieved_tflops'] * 1e3:.1f}" for r in good)
              + " GFLOPS (6N x tokens/s)")
    if len(good) < len(rows):
        print("FAILED: " + ", ".join(f"ZeRO-{r['zero_stage']} {r['layout']}" for r in rows if not r["ok"]))

    summary = {
        "benchmark": "learner_throughput",
        "preset": args.preset,
        "model_config": PRESETS[args.preset]["model"],
        "n_params": n_params,
        "device": args.device,
        "precision": precision,
        "groups": args.groups, "group_size": args.group_size, "prompt_len": args.prompt_len,
        "completion_len": args.completion_len, "completion_len_min": shortest, "micro_batches": args.micro_batches,
        "layouts": args.layouts,
        "tokens_per_step": tokens,
        "gradient_checkpointing": args.gradient_checkpointing,
        "steps": args.steps,
        "lr": args.lr,
        "flops_per_token": fpt,
        "peak_tflops": args.peak_tflops if args.device == "cuda" else None,
        "first_step_loss_max_diff": first_diff,
        "last_loss_max_diff": last_diff,
        "losses_agree": agree,
        "updates_agree": updates_agree,
        "first_step_grad_norm_max_rel_diff": norm_diff,
        "all_finite": finite,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg_at_start": load_start,
        "loadavg_at_end": _loadavg(),
        "rows": rows,
        "all_ok": ok,
    }
    for package in ("deepspeed", "transformers"):
        try:
            summary[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    print("BENCH_JSON " + json.dumps(summary))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    raise SystemExit(main())
