"""LoRA (learner.lora): what a publish would carry, full vs adapter, and what merging costs the learner.

For a model folder and LoRA settings it prints: the policy's bytes (what a publish sends today: the merged weights,
``shared.weight_sync.params.policy_tensors``), the adapter's bytes (what an adapter-only publish would send; the
checkpoint's ``adapter_model.safetensors``), their ratio, the trainable-parameter count, and the median time of
one pass over the merged policy tensors (the learner's per-publish merge work, ``iter_parameters``) against the
same pass over a plain model. The last line is a JSON summary.

``--publish N`` also measures N real publishes over the HTTP relay per ``learner.lora.publish`` mode (``merged``:
the whole policy; ``adapter``: lora_A/lora_B + scaling): a hub in its own process (bench/weight_sync.py's
HubProcess, one per mode: each registers its own layout), the learner's :class:`WeightPublisher` (adapter
weights randomized before each version, as training would change them), and a transformers generator's
:class:`WeightReceiver` in this process. Per version: bytes on the relay, the learner's stall (copy into the send
buffer), publish -> on the relay (stall + upload), and publish -> served by the generator (+ download + load or
apply); medians.

    .venv/bin/python bench/lora_sizes.py --model DIR --rank 32
    .venv/bin/python bench/lora_sizes.py --model DIR --rank 32 --targets q_proj v_proj
    .venv/bin/python bench/lora_sizes.py --model DIR --rank 32 --publish 3
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


def measure_publish(model: torch.nn.Module, model_dir: str, mode: str, repeats: int) -> dict:
    """``repeats`` versions over the relay with ``learner.lora.publish: mode`` (see the module docstring)."""
    import tempfile
    from pathlib import Path

    from bench.weight_sync_processes import HubProcess
    from generator.engines.hf import TransformersEngine
    from shared.config.schema import WeightSyncConfig
    from shared.protocol.client import HubClient, RetryPolicy
    from shared.weight_sync.publisher import WeightPublisher
    from shared.weight_sync.receiver import WeightReceiver

    with tempfile.TemporaryDirectory() as work:
        hub = HubProcess(Path(work))
        try:
            def client() -> HubClient:
                return HubClient(hub.url, retry=RetryPolicy(max_retry_s=60))
            learner = client()
            publisher = WeightPublisher(model, lambda: learner, WeightSyncConfig(transport="http"), rank=0, world=1,
                                        device=torch.device("cpu"), relay_version=None,
                                        adapter_only=mode == "adapter")
            learner.register_learner(0, 1, publisher.layout.to_json())
            engine = TransformersEngine(model_dir)
            receiver = WeightReceiver(engine, client(), WeightSyncConfig(transport="http"), "bench",
                                      Path(work) / "gen")
            rows = []
            for version in range(1, repeats + 1):
                with torch.no_grad():
                    for _, param in adapter_parameters(model):
                        param.normal_(0.0, 0.02)
                started = time.perf_counter()
                stall = publisher.publish(version)
                if not publisher.sender.wait_idle(600):
                    raise RuntimeError("the relay upload did not finish")
                on_relay = time.perf_counter() - started
                while receiver.sync(version - 1) != version:
                    time.sleep(0.01)
                served = time.perf_counter() - started
                size = (Path(work) / "weights" / f"v{version:010d}.safetensors").stat().st_size
                rows.append({"bytes": size, "stall_s": stall, "on_relay_s": on_relay, "served_s": served})
            publisher.close()
        finally:
            hub.stop()
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder.")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=64.0)
    parser.add_argument("--targets", nargs="+", default=None, help="target_modules (default: learner.lora's).")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--publish", type=int, default=0, help="Also time this many publishes per mode over the "
                        "relay (merged, adapter).")
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
    if args.publish:
        del plain
        for mode in ("merged", "adapter"):
            result = summary[f"publish_{mode}"] = measure_publish(model, args.model, mode, args.publish)
            print(f"publish {mode}: {result['bytes'] / 2**20:.2f} MiB on the relay, learner stall "
                  f"{result['stall_s']:.3f} s, on the relay after {result['on_relay_s']:.3f} s, served by the "
                  f"generator after {result['served_s']:.3f} s (medians of {args.publish})")
        ratio = summary["publish_adapter"]["bytes"] / summary["publish_merged"]["bytes"]
        summary["publish_bytes_adapter_over_merged"] = ratio
        print(f"adapter publish / merged publish: {100 * ratio:.2f}% of the bytes")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
