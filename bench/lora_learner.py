"""Learner peak memory and step time, LoRA vs full fine-tuning, the same model and batch, side by side.

For each arm a fresh process (so each has its own peak RSS): the model folder loaded in fp32, the learner's
DeepSpeed engine (``learner.engine.create_engine``, real DeepSpeed, gloo, CPU) from the ``learner`` section of
that arm's config (full: deploy/configs/smollm2-arithmetic-cpu.yaml; LoRA: deploy/configs/
smollm2-arithmetic-lora-cpu.yaml, rank 32 on the seven projections), ZeRO stage ``--zero-stage``, then
``--steps`` GRPO steps (``learner.step.grpo_step``, as ``grpo learner`` runs them) on one batch of that config's
shape: ``groups_per_step`` groups of ``group_size`` completions of ``max_tokens`` tokens (random ids) after the
task's real prompts (the chat template's tokens), alternating rewards so every group has a signal.

Per arm: trainable parameters, RSS after loading the model, RSS after ``deepspeed.initialize``, the process's
peak RSS (VmHWM, Linux) over the whole run and the median step time over steps 2.. (step 1 allocates the
optimizer state). Then LoRA / full ratios. The last line is JSON.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_learner.py --model runs/models/smollm2-135m-instruct --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "full": "deploy/configs/smollm2-arithmetic-cpu.yaml",
    "lora": "deploy/configs/smollm2-arithmetic-lora-cpu.yaml",
}


def rss_mib(field: str) -> float:
    from bench.procmem import proc_status_kib

    value = proc_status_kib(field)
    if value is None:
        raise SystemExit(f"/proc/self/status has no {field} (Linux only)")
    return value / 1024


def batch_for(config, model_dir: str):
    """One train batch of the config's shape: real task prompts, random completions of max_tokens tokens."""
    import torch
    from transformers import AutoTokenizer

    from generator.datasets import load_examples, render_prompt, system_prompt_for
    from shared.protocol.records import RolloutGroup, SamplingParams, TrainBatch

    gen = config.generator
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_examples(gen.dataset, config.seed)[:config.learner.groups_per_step]
    sampling = SamplingParams(temperature=gen.sampling.temperature, max_tokens=gen.sampling.max_tokens)
    rng = torch.Generator().manual_seed(0)
    groups = []
    for example in examples:
        # as the generator encodes it (generator/loop.py: encode_prompt): through the chat template
        text = render_prompt(tokenizer, example.question, system_prompt_for(gen.dataset), gen.dataset.template)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        tokens = torch.randint(0, len(tokenizer), (gen.group_size, gen.sampling.max_tokens), generator=rng)
        groups.append(RolloutGroup.from_samples(
            prompt_ids=prompt, completion_ids=tokens.tolist(),
            behaviour_logprobs=[[-1.0] * gen.sampling.max_tokens] * gen.group_size,
            rewards=[float(i % 2) for i in range(gen.group_size)], finish_reasons=["length"] * gen.group_size,
            policy_version=0, generator_id="bench", sampling=sampling))
    return TrainBatch.from_groups(groups, None), [len(g.prompt_ids) for g in groups]


def child(arm: str, model_dir: str, steps: int, zero_stage: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from learner.advantages import batch_advantages
    from learner.engine import create_engine, ensure_single_process_env, init_distributed
    from learner.step import apply_off_policy, grpo_step, recompute_old_logprobs, split_micro_batches
    from shared.config.loader import load_config

    config = load_config(ARMS[arm], [f"learner.model={model_dir}", f"learner.zero_stage={zero_stage}",
                                     "learner.tensorboard_dir=null", "learner.metrics_jsonl=null",
                                     "run.run_dir=null", "learner.output_dir=/tmp/unused-bench-output"])
    cfg, algorithm = config.learner, config.algorithm
    cpu = torch.device("cpu")
    ensure_single_process_env()
    init_distributed(cpu)
    batch, prompt_lengths = batch_for(config, model_dir)
    rss_start = rss_mib("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    rss_loaded = rss_mib("VmRSS")
    engine = create_engine(cfg, model, cpu)
    rss_engine = rss_mib("VmRSS")
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    advantages = batch_advantages(batch, algorithm.advantage, algorithm.kl)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        micro = split_micro_batches(batch, advantages, cfg.micro_batches, cfg.mask_truncated, cpu,
                                    token_budget=cfg.micro_batch_tokens, packing=cfg.packing,
                                    prefix_sharing="off" if cfg.gradient_checkpointing else cfg.prefix_sharing)
        bypass = config.off_policy_bypass
        if not bypass:  # as the learner does (learner/main.py: train_on)
            recompute_old_logprobs(engine.module, micro, batch.temperature, cfg.logprob_chunk_tokens)
            apply_off_policy(micro, algorithm.off_policy)
        outcome = grpo_step(engine, micro, algorithm.loss, temperature=batch.temperature,
                            old_mode="behaviour" if bypass else "recompute",
                            world_size=1, log_entropy=cfg.log_entropy, chunk_tokens=cfg.logprob_chunk_tokens)
        times.append(time.perf_counter() - started)
        if not outcome.finite:
            raise SystemExit(f"{arm}: a non-finite loss in the bench batch")
        print(f"[{arm}] step {len(times)}: {times[-1]:.2f} s, peak RSS {rss_mib('VmHWM'):.0f} MiB", file=sys.stderr,
              flush=True)
    later = times[1:] or times
    return {"arm": arm, "config": ARMS[arm], "zero_stage": zero_stage, "lr": cfg.lr,
            "lora": cfg.lora.model_dump() if cfg.lora is not None else None,
            "trainable_params": trainable, "total_params": sum(p.numel() for p in engine.module.parameters()),
            "batch": f"{cfg.groups_per_step} groups x {config.generator.group_size} completions of "
                     f"{config.generator.sampling.max_tokens} tokens, prompts {min(prompt_lengths)}-"
                     f"{max(prompt_lengths)} tokens",
            "threads": torch.get_num_threads(), "rss_start_mib": round(rss_start), "rss_model_mib": round(rss_loaded),
            "rss_engine_mib": round(rss_engine), "peak_rss_mib": round(rss_mib("VmHWM")),
            "step_s": [round(t, 3) for t in times], "median_step_s": round(statistics.median(later), 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="SmolLM2 folder (grpo fetch-model smollm2-135m-instruct)")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per arm (the median skips the first)")
    parser.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--child", choices=list(ARMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.steps, args.zero_stage)), flush=True)
        return 0
    results = {}
    for arm in args.arms:  # one process each: VmHWM is per process
        env = dict(os.environ, PYTHONPATH=os.getcwd(), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--model", args.model, "--steps",
                               str(args.steps), "--zero-stage", str(args.zero_stage), "--child", arm],
                              env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"the {arm} arm failed (exit {proc.returncode})")
        results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
        r = results[arm]
        print(f"{arm}: {r['trainable_params'] / 1e6:.2f} M trainable, RSS model {r['rss_model_mib']} MiB, engine "
              f"{r['rss_engine_mib']} MiB, peak {r['peak_rss_mib']} MiB, median step {r['median_step_s']} s "
              f"({r['step_s']})", flush=True)
    summary = {"results": results, "load_avg": os.getloadavg(), "cpu_count": os.cpu_count(),
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if set(results) == set(ARMS):
        full, lora = results["full"], results["lora"]
        summary["lora_over_full"] = {
            "peak_rss": round(lora["peak_rss_mib"] / full["peak_rss_mib"], 3),
            "peak_rss_above_model": round((lora["peak_rss_mib"] - lora["rss_model_mib"])
                                          / (full["peak_rss_mib"] - full["rss_model_mib"]), 3),
            "median_step": round(lora["median_step_s"] / full["median_step_s"], 3)}
        print(f"LoRA / full: peak RSS {summary['lora_over_full']['peak_rss']}, above the loaded model "
              f"{summary['lora_over_full']['peak_rss_above_model']}, median step "
              f"{summary['lora_over_full']['median_step']}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
