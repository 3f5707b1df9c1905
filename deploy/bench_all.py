"""Every benchmark in bench/ in one command (``make bench``, ``grpo bench``): one table in docs/benchmarks.md.

:data:`BENCHMARKS` is the one list: a benchmark is one :class:`Bench` line (its script, its arguments at a size
fitting this CPU and on the lent GPU machine, a time limit, and which numbers of its JSON summary go into the
table). Each runs in its own child process (the project's interpreter, ``PYTHONPATH`` = the repository) under its
time limit; its last JSON line (``BENCH_JSON {...}`` or a bare ``{...}``) is kept under ``--out`` and turned into
rows of figure, value and ratio. A benchmark that fails, times out or is not run on this device still gets a row
saying so. The table replaces the part of docs/benchmarks.md between this device's two markers (added at the end
the first time), so the hand-written sections around it stay as they are.

``--device cuda`` runs the GPU figures instead, sized for the lent GPU machine (10 minutes a command: the limits
of the cuda entries add up to less; ``--only`` splits the list over several commands).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = "{tiny_model}"  # replaced by a tiny model folder built once (deploy/demo/tiny_model.py)

Row = tuple[str, str, str]  # figure, value, ratio


def dig(data, *path, default=None):
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return default
        data = data[key]
    return data


def num(value, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


def _hub_capacity(d: dict) -> list[Row]:
    rows = []
    for p in d.get("phases", []):
        offered = p.get("offered_groups_per_s")
        rows.append((f"hub, spool {'on' if p['phase'] == 'spool' else 'off'}: groups/s accepted "
                     f"({p['generators']} generators; upload p50/p99 {p['upload_p50_ms']}/{p['upload_p99_ms']} ms, "
                     f"hub CPU {p['hub_cpu_pct']}%)", num(p["accepted_groups_per_s"]),
                     f"{p['accepted_groups_per_s'] / offered:.2f} of offered" if offered else "unpaced"))
    return rows


def _logprobs_memory(d: dict) -> list[Row]:
    naive = {r["seq_len"]: r for r in d.get("rows", []) if r.get("label") == "naive"}
    return [(f"chunked logprobs, T={r['seq_len']} ({d.get('mode')}, {d.get('device')}): peak extra MiB, time s",
             f"{num(r.get('peak_extra_mib'))} MiB, {num(r.get('time_s'))} s (naive {num(dig(naive, r['seq_len'], 'peak_extra_mib'))}"
             f" MiB, {num(dig(naive, r['seq_len'], 'time_s'))} s)",
             f"mem {num(r.get('mem_ratio'))}, time {num(r.get('time_ratio'))} of naive")
            for r in d.get("rows", []) if "mem_ratio" in r]


def _learner_throughput(d: dict) -> list[Row]:
    rows = [r for r in d.get("rows", []) if r.get("ok", True) and "tokens_per_s" in r]
    first = rows[0]["tokens_per_s"] if rows else None
    return [(f"learner ZeRO-{r['zero_stage']} tokens/s ({d.get('preset')}, {r.get('dtype')})", num(r["tokens_per_s"]),
             f"{r['tokens_per_s'] / first:.2f} of ZeRO-{rows[0]['zero_stage']}"
             + (f"; MFU {r['mfu']:.3f}" if r.get("mfu") is not None else "")) for r in rows]


def _packing_layouts(d: dict) -> list[Row]:
    times = {layout: min(t) for layout, t in d.get("times_s", {}).items() if t}
    return [(f"learner forward+backward, {layout} layout ({d.get('preset')}, {d.get('device')}): s per batch",
             num(t), f"{times['padded'] / t:.2f}x padded" if "padded" in times else "") for layout, t in times.items()]


def _ref_server(d: dict) -> list[Row]:
    return [(f"ref server {key.replace('/', ', clients ')} ({d.get('preset')}, {d.get('device')}): tokens/s",
             num(r.get("tokens_per_s")), f"{num(r.get('ratio_vs_inprocess'))} of in-process")
            for key, r in d.get("results", {}).items()]


def _weight_sync(d: dict) -> list[Row]:
    rows = []
    for model, result in d.get("models", {}).items():
        for transport, r in result.items():
            if isinstance(r, dict) and "publish_to_serving_s" in r:
                rows.append((f"weight sync {model} over {transport} ({d.get('device')}): publish to serving, s",
                             num(r["publish_to_serving_s"]), f"{num(r.get('vs_http'))} of HTTP; learner stall "
                             f"{num(r.get('stall_s'))} s"))
    return rows


def _learner_overhead(d: dict) -> list[Row]:
    return [(f"learner step on the tiny model ({Path(tree).name}): step ms, overhead ms", f"{num(r.get('step_ms'))}, "
             f"{num(r.get('overhead_ms'))}", f"overhead {r['overhead_ms'] / r['step_ms']:.2f} of the step"
             if r.get("step_ms") else "") for tree, r in d.get("results", {}).items()]


def _generic(keys: dict[str, tuple]) -> Callable[[dict], list[Row]]:
    """Rows from fixed paths of the summary: label -> (value path, ratio path or None)."""
    def figures(d: dict) -> list[Row]:
        return [(label, num(dig(d, *value)), num(dig(d, *ratio)) if ratio else "")
                for label, (value, ratio) in keys.items()]
    return figures


def _flat(prefix: str, wanted: tuple[str, ...]) -> Callable[[dict], list[Row]]:
    """Every number of the summary whose key path ends with one of ``wanted`` (a summary keyed by run names)."""
    def figures(d: dict) -> list[Row]:
        rows = []

        def walk(node, path):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, path + [str(k)])
            elif path and path[-1] in wanted and isinstance(node, (int, float)):
                rows.append((f"{prefix} {'/'.join(Path(p).name for p in path)}", num(node),
                             num(node) if "ratio" in path[-1] or "over" in path[-1] else ""))
        walk(d, [])
        return rows
    return figures


@dataclass(frozen=True)
class Bench:
    name: str                          # bench/<name>.py
    cpu: tuple[str, ...] | None        # arguments on this CPU; None: not run here (``why``)
    cuda: tuple[str, ...] | None       # arguments on the GPU machine; None: not run there (``why``)
    figures: Callable[[dict], list[Row]]
    cpu_limit_s: int = 240
    cuda_limit_s: int = 120
    why: str = ""
    alone: bool | str = False          # too long to share a command: runs only when named in ``--only``
                                       # (a device name: there only)

    def args(self, device: str) -> tuple[str, ...] | None:
        return self.cpu if device == "cpu" else self.cuda

    def alone_on(self, device: str) -> bool:
        return self.alone is True or self.alone == device

    def limit_s(self, device: str) -> int:
        return self.cpu_limit_s if device == "cpu" else self.cuda_limit_s


# The one list: adding a benchmark is one line here.
BENCHMARKS: list[Bench] = [
    Bench("hub_capacity", ("--duration", "15"), None, _hub_capacity, 120,
          why="the hub needs no GPU: its figure is this CPU's"),
    Bench("logprobs_memory", ("--seq-lens", "1024", "--repeats", "1"), ("--device", "cuda"), _logprobs_memory,
          120, 90),
    Bench("learner_throughput", ("--steps", "3"), ("--device", "cuda", "--zero-stages", "0", "--steps", "5"),
          _learner_throughput, 300, 150),
    Bench("packing_layouts", ("--repeats", "3"), ("--device", "cuda", "--preset", "qwen2.5-0.5b"),
          _packing_layouts, 90, 45),   # 14.5 s on the 2-core CPU (docs/benchmarks.md)
    Bench("ref_server", ("--repeats", "1", "--rows", "32", "--clients", "1", "4"), ("--device", "cuda", "--repeats", "2"),
          _ref_server, 150, 90),
    Bench("weight_sync", ("--models", "tiny", "--repeats", "2"),
          ("--device", "cuda", "--models", "qwen0.5b-shape", "--transports", "nccl,ipc", "--repeats", "2"),
          _weight_sync, 180, 90),
    Bench("learner_overhead", ("--model", TINY_MODEL, "--steps", "12"), None, _learner_overhead, 240,
          why="a CPU figure (the learner's own overhead per step)"),
    Bench("lora_sizes", ("--model", TINY_MODEL, "--rank", "8", "--repeats", "1"), None,
          _generic({"LoRA adapter bytes, ratio to a full publish (tiny model, rank 8)": (("adapter_bytes",), ("adapter_over_full",))}),
          60, why="bytes do not depend on the device"),
    Bench("vs_trl", None, ("--device", "cuda"), _flat("vs TRL", ("ratio_ours_over_trl", "ratio_ours_over_trl_from_model_load")), 0, 540,
          why="needs trl (not installed on this CPU; on the GPU machine: EXTRA_WHEELS=trl) and minutes of training: "
          "a command of its own there (--device cuda --only vs_trl)", alone=True),
    Bench("process_vs_outcome", None, None, _flat("process vs outcome", ("ratio",)),
          why="a learning-curve comparison over several training runs (~1 h on this CPU): run it alone"),
    Bench("scorers", (), None, _generic({"scoring tokens/s of two scorers, ratio to one (one thread each)":
                                         (("two",), ("ratio",))}), 240,
          why="scorers on this CPU, one thread each: the ratio of two to one"),
    Bench("lora_curves", None, None, _flat("LoRA vs full", ("gain_ratio",)),
          why="two SmolLM2 training runs and their evals (~45 min on this CPU), docs/lora.md: run it alone"),
    Bench("off_policy", None, None, _flat("off-policy", ("final_accuracy",)),
          why="a grid of 12 training runs (staleness x correction) and their evals (~40 min on this CPU), "
          "docs/off-policy.md: run it alone"),
    Bench("distill", None, None, _flat("distillation", ("steps", "wall_s")),
          why="a teacher's training run, then three arms per seed and their evals (~19 min for 3 seeds on this CPU), "
          "docs/distillation.md: run it alone"),
    Bench("rollout_schedule", ("--model", TINY_MODEL, "--groups", "32"),
          ("--model", TINY_MODEL, "--engine", "transformers", "--device", "cuda", "--groups", "96", "--max-tokens",
           "1024", "--prompts-per-batch", "32"),
          _flat("rollout schedule", ("tokens_per_s", "tokens_per_s_continuous_over_batch",
                                     "tokens_per_s_continuous_keep_over_batch", "publish_to_first_use_s")), 240, 300,
          why="on the GPU machine (no vLLM there: the transformers engine on the GPU) 9 arms of 96 groups up to "
          "1024 tokens: a command of its own (--device cuda --only rollout_schedule)", alone="cuda"),
    Bench("engine_mismatch", ("--model", TINY_MODEL, "--prompts", "8", "--group", "4"),
          ("--model", TINY_MODEL, "--device", "cuda", "--prompts", "32", "--group", "8"),
          _flat("engine mismatch at staleness 0", ("mismatch_kl",)), 60, 60),
    Bench("lora_learner", None, None, _flat("LoRA / full learner", ("ratio",)),
          why="needs SmolLM2 (grpo fetch-model) and minutes per arm, docs/lora.md: run it alone"),
]


def by_name(names: list[str] | None) -> list[Bench]:
    known = {b.name: b for b in BENCHMARKS}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise UsageError(f"unknown benchmark {', '.join(unknown)} (known: {', '.join(known)})")
    return [known[n] for n in names] if names else list(BENCHMARKS)


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("BENCH_JSON "):
            line = line[len("BENCH_JSON "):]
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def machine(device: str) -> str:
    if device == "cuda":
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            gpu = "GPU (nvidia-smi unavailable)"
        return f"{gpu}, {os.cpu_count()} CPU cores"
    return f"{os.cpu_count()}-core {platform.machine()} CPU, no GPU"


def run_one(bench: Bench, device: str, out: Path, tiny_model: Callable[[], str], named: bool = False) -> dict:
    """Run one benchmark (one that runs ``alone`` only when ``named``); its record: command, status, seconds, rows."""
    args = bench.args(device)
    command = f"python bench/{bench.name}.py"
    if args is None or (bench.alone_on(device) and not named):
        return {"name": bench.name, "status": "not run", "command": command, "seconds": 0,
                "rows": [("not run on " + device, "-", bench.why or "-")]}
    args = tuple(tiny_model() if a == TINY_MODEL else a for a in args)
    command = " ".join(["python", f"bench/{bench.name}.py", *map(shlex.quote, args)])
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    start = time.monotonic()
    log = out / f"{bench.name}.log"
    with open(log, "w") as sink:
        try:
            proc = subprocess.run([sys.executable, str(REPO / "bench" / f"{bench.name}.py"), *args], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=sink, text=True,
                                  timeout=bench.limit_s(device))
            status, stdout = ("ok" if proc.returncode == 0 else f"exit {proc.returncode}"), proc.stdout
        except subprocess.TimeoutExpired as exc:
            status = f"timed out ({bench.limit_s(device)} s)"
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    seconds = round(time.monotonic() - start, 1)
    (out / f"{bench.name}.out").write_text(stdout)
    summary = last_json(stdout)
    if summary is not None:
        (out / f"{bench.name}.json").write_text(json.dumps(summary, indent=1))
    record = {"name": bench.name, "status": status, "command": command, "seconds": seconds}
    (out / f"{bench.name}.record.json").write_text(json.dumps(record))
    return {**record, "rows": figures_of(bench, summary, status, log)}


def figures_of(bench: Bench, summary: dict | None, status: str, log: Path) -> list[Row]:
    rows: list[Row] = []
    if summary is not None:
        try:
            rows = bench.figures(summary)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            rows = [("summary not understood", "-", f"{type(exc).__name__}: {exc}"[:120])]
    return rows or [(f"no figures ({status}; see {log.name})", "-", "-")]


def rerender(bench: Bench, out: Path) -> dict:
    """The record of an earlier run from its files under ``out`` (the figures read again from its JSON)."""
    saved = out / f"{bench.name}.record.json"
    if not saved.exists():
        return {"name": bench.name, "status": "no earlier run", "command": f"python bench/{bench.name}.py",
                "seconds": 0, "rows": [(f"nothing in {out}", "-", "-")]}
    record = json.loads(saved.read_text())
    summary_file = out / f"{bench.name}.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    return {**record, "rows": figures_of(bench, summary, record["status"], out / f"{bench.name}.log")}


def table(records: list[dict], device: str, when: str, where: str) -> str:
    lines = [f"Machine: {where}. Date: {when}. Command: `make bench` (= `grpo bench --device {device}`).", "",
             "| benchmark | figure | value | ratio | machine | date | command | status, s |",
             "|---|---|---:|---|---|---|---|---|"]
    for r in records:
        for figure, value, ratio in r["rows"]:
            cells = [r["name"], figure, value, ratio, where, when, f"`{r['command']}`", f"{r['status']}, {r['seconds']}"]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def write_section(doc: Path, device: str, body: str) -> None:
    start, end = f"<!-- bench-all:{device} start -->", f"<!-- bench-all:{device} end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    section = f"{start}\n{body}{end}\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + section + rest.split(end, 1)[1].lstrip("\n")
    else:
        title = "CPU" if device == "cpu" else "GPU"
        text = text.rstrip("\n") + f"\n\n## Every benchmark in one command ({title}: `grpo bench --device {device}`)\n\n" + section
    doc.write_text(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="grpo bench", description="Run every benchmark in bench/ at a size fitting "
                                "the machine and write one table into docs/benchmarks.md.")
    add_arguments(p)
    return p.parse_args(argv)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: this machine's figures; cuda: the GPU figures, sized for the lent GPU machine.")
    p.add_argument("--only", nargs="+", metavar="NAME", help="These benchmarks only (default: all): "
                   + ", ".join(b.name for b in BENCHMARKS) + ".")
    p.add_argument("--out", default="runs/bench/all", help="Folder for each benchmark's output, log and JSON.")
    p.add_argument("--doc", default="docs/benchmarks.md", help="Markdown file whose table section is replaced.")
    p.add_argument("--dry-run", action="store_true", help="Print the commands and the limits, run nothing.")
    p.add_argument("--rerender", action="store_true", help="Run nothing: write the table again from the outputs "
                   "an earlier run left in --out (its date and machine are this call's: say so if they differ).")


def run(args: argparse.Namespace) -> int:
    benches = by_name(args.only)
    if args.dry_run:
        for b in benches:
            bench_args = None if b.alone_on(args.device) and not args.only else b.args(args.device)
            print(f"{b.name}: " + (f"python bench/{b.name}.py {' '.join(bench_args)} (limit {b.limit_s(args.device)} s)"
                                   if bench_args is not None else f"not run ({b.why})"))
        print(f"total limit {sum(b.limit_s(args.device) for b in benches if b.args(args.device) is not None and (args.only or not b.alone_on(args.device)))} s")
        return 0
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    built: list[str] = []

    def tiny_model() -> str:
        """The demo's tiny model with random weights (no warm-up: sizes and speeds do not need a trained one)."""
        if not built:
            from deploy.demo.tiny_model import (
                TinyModelSpec,
                build_char_tokenizer,
                build_tiny_model,
                save_model_dir,
            )

            tokenizer = build_char_tokenizer()
            built.append(str(save_model_dir(build_tiny_model(tokenizer, TinyModelSpec()), tokenizer,
                                            out / "tiny-model")))
        return built[0]

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = machine(args.device)
    records = []
    for bench in benches:
        if args.rerender:
            runnable = bench.args(args.device) is not None and (bool(args.only) or not bench.alone_on(args.device))
            records.append(rerender(bench, out) if runnable else run_one(bench, args.device, out, tiny_model))
            continue
        print(f"[bench] {bench.name} ...", flush=True)
        record = run_one(bench, args.device, out, tiny_model, named=bool(args.only))
        print(f"[bench] {bench.name}: {record['status']} in {record['seconds']} s", flush=True)
        records.append(record)
    body = table(records, args.device, when, where)
    (out / f"table-{args.device}.md").write_text(body)
    write_section(Path(args.doc), args.device, body)
    print(body)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    except UsageError as exc:
        print(f"grpo bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
