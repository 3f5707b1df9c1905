"""Benchmark: one micro-batch's forward + backward of the learner's logprobs, padded against packed rows.

Isolates what ``learner.packing`` changes: :func:`shared.forward.logprobs.sequence_logprobs` (the learner's forward: the
backbone, then the chunked LM head) and the backward of a token-sum, on one micro-batch of ``--rows`` rows whose
lengths are ``--prompt-len`` + U[``--completion-len-min``, ``--completion-len``] (fixed seed), for the model of
a :mod:`bench.learner_throughput` preset (random weights, fp32 on CPU, bf16 on CUDA). Layouts run interleaved,
``--repeats`` times each after one warm-up each; the minimum and the median are reported (the minimum is the
least disturbed by other work on a shared machine), with ratios against ``padded`` from the same run, and what
``learner.packing: auto`` would choose for this micro-batch (:func:`shared.forward.packing.choose_layout`).

    .venv/bin/python bench/packing_layouts.py                          # cpu-small, 8 rows of 64 + 16..128
    .venv/bin/python bench/packing_layouts.py --device cuda --preset qwen2.5-0.5b --rows 8 --prompt-len 256 \\
        --completion-len-min 128 --completion-len 1024 --attn flash_attention_2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner_throughput import model_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="cpu-small")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager, flash_attention_2)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len-min", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from shared.forward.logprobs import sequence_logprobs
    from shared.forward.packing import choose_layout, layout_costs

    device = torch.device(args.device)
    config = model_config(args.preset)
    config._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    completions = torch.randint(args.completion_len_min, args.completion_len + 1, (args.rows,), generator=gen)
    prompts = torch.full((args.rows,), args.prompt_len)
    width = int((prompts + completions).max())
    ids = torch.randint(0, config.vocab_size, (args.rows, width), generator=gen).to(device)
    prompts, completions = prompts.to(device), completions.to(device)
    lengths = (prompts + completions).tolist()

    def run(layout: str) -> float:
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        out = sequence_logprobs(model, ids, prompts, completions, layout=layout)
        out.logprobs.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    layouts = ["padded", "packed"]
    times: dict[str, list[float]] = {layout: [] for layout in layouts}
    for layout in layouts:
        run(layout)  # warm-up (and the one-time packing probe)
    for _ in range(args.repeats):
        for layout in layouts:
            times[layout].append(run(layout))
    tokens = sum(lengths)
    costs = layout_costs(model, lengths)
    auto = choose_layout(model, lengths, "auto")
    print(f"packing layouts: preset {args.preset}, {args.attn} attention, {device.type} {str(dtype)[6:]}, "
          f"{args.rows} rows of {args.prompt_len} + {args.completion_len_min}..{args.completion_len} tokens "
          f"({tokens} real tokens, {args.rows * width} padded: {100 * (1 - tokens / (args.rows * width)):.1f}% "
          f"padding), threads {torch.get_num_threads()}, forward + backward, {args.repeats} interleaved repeats")
    base = min(times["padded"])
    print(f"{'layout':<8} {'min s':>8} {'median s':>9} {'tokens/s (min)':>15} {'vs padded':>10} {'est. GFLOP':>11}")
    for layout in layouts:
        best = min(times[layout])
        print(f"{layout:<8} {best:>8.4f} {statistics.median(times[layout]):>9.4f} {tokens / best:>15.1f} "
              f"{base / best:>10.3f} {costs[layout] / 1e9:>11.2f}")
    print(f"learner.packing auto picks: {auto} (forward FLOP estimate: padded {costs['padded'] / 1e9:.2f}, packed "
          f"{costs['packed'] / 1e9:.2f} GFLOP)")
    print("BENCH_JSON " + json.dumps({"benchmark": "packing_layouts", **vars(args), "lengths": lengths,
                                      "times_s": times, "auto": auto, "est_flops": costs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
