"""Benchmark: peak extra memory and time of chunked per-token logprobs vs the naive full log-softmax.

Compares, on one sequence of ``T`` completion tokens (batch 1) with a Qwen2.5-0.5B-shaped LM head
(vocab 151936, hidden 896):

* ``naive``:   ``logits = lm_head(hidden).float(); logits.log_softmax(-1).gather(-1, targets[:, None])``
* ``chunked``: :func:`shared.forward.logprobs.logprobs_from_hidden` (LM head applied ``chunk_tokens`` rows at a time,
  default the library's per-device ``chunk_tokens_for(vocab, device=...)``: 128 MiB of fp32 logits on CPU, 512
  MiB on a GPU with the free memory for it; a hand-written backward recomputes one chunk's logits at a time).

Forward only by default (under ``torch.no_grad()``, the scoring path); ``--backward`` measures forward +
backward of ``logprobs.sum()`` w.r.t. the hidden states and the head weight (the training path).

Every (variant, T) is measured in a fresh child process (``--_child``), because torch has no allocator
statistics on CPU: the child builds its inputs from a fixed seed, returns freed memory to the OS
(``malloc_trim``), records its RSS, resets the kernel's peak-RSS counter (``/proc/self/clear_refs`` <- ``5``)
and runs the variant once; peak extra = ``VmHWM`` after the call - ``VmRSS`` before it. As a cross-check it
also reports ``ru_maxrss`` after - RSS before, and ``ru_maxrss`` before - RSS before (the setup transient,
which must be ~0 for the ``ru_maxrss`` number to mean anything). On CUDA it uses
``torch.cuda.max_memory_allocated`` - ``memory_allocated`` before. The memory run doubles as the warm-up; the
child then times ``--repeats`` more runs and reports the median. Each child saves its outputs (logprobs, and
with ``--backward`` the hidden-state gradient and a fixed sample of head-weight-gradient rows) and the parent
checks that chunked and naive agree.

Run from the repository root::

    .venv/bin/python bench/logprobs_memory.py                       # forward, T in {1024, 4096}
    .venv/bin/python bench/logprobs_memory.py --backward --repeats 1
    .venv/bin/python bench/logprobs_memory.py --seq-lens 4096 --chunk-tokens 64 128 256 512 1024 --repeats 1

Targets (from issue 14, checked at every T, informational unless ``--strict``): chunked peak extra memory
<= 1/8 of naive; chunked time <= 1.1x naive forward, <= 1.4x naive forward + backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
MEMORY_RATIO_TARGET = 1 / 8
TIME_RATIO_TARGET = {"forward": 1.1, "forward+backward": 1.4}


# ----------------------------------------------------------------------------------------------- child side

from procmem import malloc_trim as _malloc_trim  # noqa: E402 - bench/ is on sys.path when run as a script
from procmem import proc_status_kib as _proc_status_kib  # noqa: E402
from procmem import reset_peak_rss as _reset_peak_rss  # noqa: E402


def _ru_maxrss_kib() -> int:
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value // 1024 if sys.platform == "darwin" else value  # bytes on macOS, KiB on Linux


def _child(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from shared.forward.logprobs import chunk_tokens_for, logprobs_from_hidden

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n, hdim, vocab = args.seq_len, args.hidden, args.vocab

    # Inputs from a fixed seed, generated on CPU in fp32 so that every child (and both devices) sees the same
    # values. On CPU everything is generated in place: no transient bigger than the inputs themselves.
    gen = torch.Generator().manual_seed(args.seed)
    lm_head = nn.Linear(hdim, vocab, bias=False, device="meta")
    weight = torch.empty(vocab, hdim).normal_(0.0, 2.0 / hdim**0.5, generator=gen)  # logits std ~2
    hidden = torch.empty(n, hdim).normal_(0.0, 1.0, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    probe_rows = torch.unique(torch.cat([targets[:512], torch.randperm(vocab, generator=gen)[:512]]))
    if cuda:
        weight, hidden, targets = weight.to(device, dtype), hidden.to(device, dtype), targets.to(device)
    lm_head.weight = nn.Parameter(weight, requires_grad=args.backward)
    hidden.requires_grad_(args.backward)
    del weight

    chunk_tokens = args.chunk_tokens or chunk_tokens_for(vocab, device=device)

    def run_variant() -> torch.Tensor:
        if args.variant == "naive":
            logits = lm_head(hidden).float()
            return logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        return logprobs_from_hidden(hidden, lm_head, targets, chunk_tokens=chunk_tokens)[0]

    def step() -> torch.Tensor:
        if args.backward:
            logp = run_variant()
            logp.sum().backward()
            return logp.detach()
        with torch.no_grad():
            return run_variant()

    def clear_grads() -> None:
        lm_head.weight.grad = None
        hidden.grad = None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    # ---- memory (this run is also the warm-up)
    mem: dict = {}
    if cuda:
        sync()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        logp = step()
        sync()
        first_s = time.perf_counter() - t0
        mem["peak_extra_mib"] = (torch.cuda.max_memory_allocated(device) - before) / MIB
        mem["method"] = "torch.cuda.max_memory_allocated - memory_allocated before"
    else:
        _malloc_trim()
        rss_before = _proc_status_kib("VmRSS")
        maxrss_before = _ru_maxrss_kib()
        hwm_reset = _reset_peak_rss()
        t0 = time.perf_counter()
        logp = step()
        first_s = time.perf_counter() - t0
        hwm_after = _proc_status_kib("VmHWM")
        maxrss_after = _ru_maxrss_kib()
        mem["rss_before_mib"] = rss_before / 1024
        # How far the setup's own peak exceeds the RSS before the call; the ru_maxrss number below only sees
        # growth past that peak, so it is a lower bound unless this is ~0.
        mem["setup_transient_mib"] = (maxrss_before - rss_before) / 1024
        mem["ru_maxrss_extra_mib"] = (maxrss_after - rss_before) / 1024
        if hwm_reset and hwm_after is not None:
            mem["peak_extra_mib"] = (hwm_after - rss_before) / 1024
            mem["method"] = "VmHWM (reset via /proc/self/clear_refs) - VmRSS before"
        else:
            mem["peak_extra_mib"] = mem["ru_maxrss_extra_mib"]
            mem["method"] = "ru_maxrss - VmRSS before"

    outputs = {"logprobs": logp.float().cpu()}
    if args.backward:
        outputs["grad_hidden"] = hidden.grad.float().cpu()
        outputs["grad_weight_rows"] = lm_head.weight.grad[probe_rows.to(device)].float().cpu()
        outputs["probe_rows"] = probe_rows
    del logp
    clear_grads()

    # ---- time: median of --repeats runs after the warm-up (the memory run above)
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
        del out
        clear_grads()

    torch.save(outputs, args.out_file)
    result = {
        "variant": args.variant,
        "seq_len": n,
        "chunk_tokens": chunk_tokens if args.variant == "chunked" else None,
        "time_s": statistics.median(times) if times else first_s,
        "times_s": times,
        "first_run_s": first_s,
        **mem,
    }
    print("CHILD_JSON " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------- parent side


def _run_child(args: argparse.Namespace, variant: str, seq_len: int, chunk_tokens: int | None, out_file: str):
    cmd = [
        sys.executable, os.path.abspath(__file__), "--_child",
        "--variant", variant, "--seq-len", str(seq_len), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
        "--repeats", str(args.repeats), "--device", args.device, "--seed", str(args.seed), "--out-file", out_file,
    ]
    if chunk_tokens is not None:
        cmd += ["--chunk-tokens", str(chunk_tokens)]
    if args.backward:
        cmd.append("--backward")
    label = variant if variant == "naive" else f"chunked(c={chunk_tokens or 'default'})"
    print(f"  running T={seq_len} {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        sys.stdout.write(proc.stdout)
        raise SystemExit(f"child {label} T={seq_len} failed with exit code {proc.returncode}")
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD_JSON "):
            return json.loads(line[len("CHILD_JSON "):])
    raise SystemExit(f"child {label} T={seq_len} printed no result:\n{proc.stdout}")


def _compare(naive_file: str, chunked_file: str) -> dict:
    import torch

    a, b = torch.load(chunked_file), torch.load(naive_file)
    diff = {"logprobs_max_abs_diff": (a["logprobs"] - b["logprobs"]).abs().max().item()}
    for key in ("grad_hidden", "grad_weight_rows"):
        if key in a:
            scale = b[key].abs().max().item() or 1.0
            diff[f"{key}_max_rel_diff"] = (a[key] - b[key]).abs().max().item() / scale
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up (median reported)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backward", action="store_true", help="forward + backward (grads w.r.t. hidden, head)")
    parser.add_argument("--chunk-tokens", type=int, nargs="+", default=None,
                        help="chunk sizes to try (one chunked row each); default: the library default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--strict", action="store_true", help="exit 1 if a target or the agreement check fails")
    # child-only
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._child:
        args.chunk_tokens = args.chunk_tokens[0] if args.chunk_tokens else None
        _child(args)
        return 0

    import torch

    from shared.forward.logprobs import chunk_tokens_for

    chunk_list = args.chunk_tokens or [None]
    default_chunk = chunk_tokens_for(args.vocab, device=args.device)
    mode = "forward+backward" if args.backward else "forward"
    time_target = TIME_RATIO_TARGET[mode]
    dtype = "bf16 weights/hidden, fp32 logits" if args.device == "cuda" else "fp32"
    print(f"logprobs memory benchmark: {mode}, device={args.device} ({dtype}), vocab={args.vocab}, "
          f"hidden={args.hidden}, batch=1, repeats={args.repeats} (+1 warm-up = the memory run), "
          f"threads={torch.get_num_threads()}, default chunk={default_chunk} tokens", flush=True)

    tol = 1e-4 if args.device == "cpu" else 5e-2
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="logprobs_bench_") as tmp:
        for seq_len in args.seq_lens:
            naive_file = os.path.join(tmp, f"naive_{seq_len}.pt")
            naive = _run_child(args, "naive", seq_len, None, naive_file)
            rows.append({**naive, "label": "naive"})
            for chunk in chunk_list:
                chunked_file = os.path.join(tmp, f"chunked_{seq_len}_{chunk}.pt")
                res = _run_child(args, "chunked", seq_len, chunk, chunked_file)
                res["label"] = f"chunked(c={res['chunk_tokens']})"
                res.update(_compare(naive_file, chunked_file))
                res["mem_ratio"] = res["peak_extra_mib"] / naive["peak_extra_mib"]
                res["time_ratio"] = res["time_s"] / naive["time_s"]
                res["mem_pass"] = res["mem_ratio"] <= MEMORY_RATIO_TARGET
                res["time_pass"] = res["time_ratio"] <= time_target
                res["agree"] = all(v <= tol for k, v in res.items() if k.endswith("_diff"))
                ok = ok and res["mem_pass"] and res["time_pass"] and res["agree"]
                rows.append(res)
                os.remove(chunked_file)
            os.remove(naive_file)

    header = (f"{'T':>6} {'variant':<16} {'peak extra MiB':>14} {'time s':>8} {'mem ratio':>10} "
              f"{'time ratio':>10}  {'max|dlogp|':>10}  targets (mem<=1/8, time<={time_target}x)")
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        line = f"{r['seq_len']:>6} {r['label']:<16} {r['peak_extra_mib']:>14.1f} {r['time_s']:>8.3f}"
        if r["variant"] == "chunked":
            verdict = (f"mem {'PASS' if r['mem_pass'] else 'FAIL'}, time {'PASS' if r['time_pass'] else 'FAIL'}"
                       f"{'' if r['agree'] else ', OUTPUTS DISAGREE'}")
            line += (f" {r['mem_ratio']:>10.3f} {r['time_ratio']:>10.3f}  {r['logprobs_max_abs_diff']:>10.2e}  "
                     f"{verdict}")
        print(line)
    print()
    for r in rows:
        if r["variant"] == "chunked" and "grad_hidden_max_rel_diff" in r:
            print(f"T={r['seq_len']} {r['label']}: grad hidden max rel diff {r['grad_hidden_max_rel_diff']:.2e}, "
                  f"grad head-weight (sampled rows) max rel diff {r['grad_weight_rows_max_rel_diff']:.2e}")
    if args.device == "cpu":
        worst = max(r["setup_transient_mib"] for r in rows)
        print(f"memory method: {rows[0]['method']}; ru_maxrss cross-check per row in the JSON; "
              f"largest setup transient above pre-call RSS: {worst:.1f} MiB")

    summary = {
        "benchmark": "logprobs_memory",
        "mode": mode,
        "device": args.device,
        "dtype": dtype,
        "vocab": args.vocab,
        "hidden": args.hidden,
        "batch": 1,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "default_chunk_tokens": default_chunk,
        "targets": {"mem_ratio_max": MEMORY_RATIO_TARGET, "time_ratio_max": TIME_RATIO_TARGET},
        "rows": rows,
        "all_pass": ok,
    }
    print("BENCH_JSON " + json.dumps(summary))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if (args.strict and not ok) else 0


if __name__ == "__main__":
    raise SystemExit(main())
