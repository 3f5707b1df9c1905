"""LoRA (learner.lora): what a publish would carry, full vs adapter, and what merging costs the learner.

For a model folder and LoRA settings it prints: the policy's bytes (what a publish sends today: the merged weights,
``shared.weight_sync.params.policy_tensors``), the adapter's bytes (what an adapter-only publish would send; the
checkpoint's ``adapter_model.safetensors``), their ratio, the trainable-parameter count, and the median time of
one pass over the merged policy tensors (the learner's per-publish merge work, ``iter_parameters``) against the
same pass over a plain model. The last line is a JSON summary.

    .venv/bin/python bench/lora_sizes.py --model DIR --rank 32
    .venv/bin/python bench/lora_sizes.py --model DIR --rank 32 --targets q_proj v_proj
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from learner.lora import adapter_parameters, apply_lora
from shared.config.schema.learner import LoraConfig
from shared.weight_sync.params import iter_parameters, policy_tensors


def timed_pass(model: torch.nn.Module, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _name, _tensor in iter_parameters(model):
            pass
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder.")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=64.0)
    parser.add_argument("--targets", nargs="+", default=None, help="target_modules (default: learner.lora's).")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    settings = {"r": args.rank, "alpha": args.alpha}
    if args.targets:
        settings["target_modules"] = args.targets if args.targets != ["all-linear"] else "all-linear"
    cfg = LoraConfig(**settings)
    plain = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    plain_s = timed_pass(plain, args.repeats)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32), cfg)
    full_bytes = sum(torch.Size(t.shape).numel() * t.dtype.itemsize for t in policy_tensors(model))
    adapter = adapter_parameters(model)
    adapter_bytes = sum(p.numel() * p.element_size() for _, p in adapter)
    merged_s = timed_pass(model, args.repeats)
    summary = {"model": args.model, "rank": args.rank, "target_modules": cfg.target_modules,
               "policy_params": sum(torch.Size(t.shape).numel() for t in policy_tensors(model)),
               "adapter_params": sum(p.numel() for _, p in adapter), "full_publish_bytes": full_bytes,
               "adapter_bytes": adapter_bytes, "adapter_over_full": adapter_bytes / full_bytes,
               "plain_pass_s": plain_s, "merged_pass_s": merged_s}
    print(f"policy {full_bytes / 2**20:.1f} MiB, adapter {adapter_bytes / 2**20:.2f} MiB "
          f"({100 * adapter_bytes / full_bytes:.2f}% of a full publish), "
          f"{summary['adapter_params']} trainable parameters")
    print(f"one pass over the policy tensors: plain {plain_s:.3f} s, LoRA merged {merged_s:.3f} s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
