"""The measured side of bench/learner_throughput.py: the model presets, the synthetic batch, and one ZeRO stage
measured in a fresh process (:func:`measure_stage`, run by ``learner_throughput.py --_child``); the parent runs
the stages, compares them and reports (see its docstring for what is measured and how).

Both sides need the presets and the model's size: :data:`PRESETS`, :func:`model_config`, :func:`count_params`,
:func:`flops_per_token`."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

from procmem import malloc_trim as _malloc_trim  # bench/ is on sys.path when run as a script
from procmem import proc_status_kib as _proc_status_kib
from procmem import reset_peak_rss as _reset_peak_rss

MIB = 2**20

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


def measure_stage(args: argparse.Namespace) -> None:
    """One ZeRO stage: build the model and the engine, one warm-up step, ``args.steps`` timed steps; prints
    ``CHILD_JSON {...}`` for the parent."""
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
