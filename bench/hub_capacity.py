"""Benchmark: the rollout hub's capacity with many simulated generators and a simulated learner (no model).

A real hub (the ref server's app: ``build_state`` + ``create_app`` under uvicorn, ``beta`` 0 so there is no
reference model, spool on or off) runs in a child process on 127.0.0.1 (:mod:`bench.hub_process`). The simulated clients are in
:mod:`bench.hub_load`: ``--client-procs`` processes run
``--generators`` simulated generators between them (one thread each): each uploads its engine call's groups
(``--groups-per-upload`` groups of ``--group-size`` completions x ``--completion-len`` tokens with behaviour logprobs,
after a ``--prompt-len``-token prompt) in one binary ``POST /v1/rollouts/batch``, at ``--rate`` groups/s per generator
(0: as fast as the hub answers), sampled at the learner version of the hub's last answer. Groups are encoded once per
generator and version; each upload only stamps fresh group ids into the bytes. A simulated learner (this process,
:class:`shared.protocol.client.HubClient`) registers, leases ``--batch-groups`` groups at a time (long poll),
decodes the batch, acknowledges it and reports a new version every ``--groups-per-step`` groups.

Reported per phase (``--phases``: ``spool`` and ``nospool``, each ``--duration`` s after ``--warmup`` s):
groups/s and completion tokens/s accepted and leased, upload latency p50/p99 (client side, one request),
lease latency (client side, batches that came back), the hub's CPU% (``/proc``: all threads, the event-loop thread,
the others) and where its time went: wall time per stage, summed over threads (instrumented in the hub process:
container decode, group decode + validation, spool write + fsync, spool rename, row layout, batch assembly, batch
serialisation, acknowledgement), the CPU per group (``cpu_ms``: each stage's own thread CPU time per group accepted
or leased, the event loop's and the non-Python threads' from ``/proc/<pid>/task/*/schedstat``), the hub's context
switches per group, and the generators' own CPU% (a saturated client cannot measure the hub).
Accounting: groups accepted == leased + still queued + dropped stale (checked, printed).

    .venv/bin/python bench/hub_capacity.py                                   # 80 generators x 2.44 groups/s, ~60 s
    .venv/bin/python bench/hub_capacity.py --rate 0 --generators 16          # the ceiling: as fast as it answers
    .venv/bin/python bench/hub_capacity.py --generators 4 --duration 2 --warmup 1 --phases nospool   # toy size

The last line is ``BENCH_JSON {...}``. ``--strict`` exits 1 unless the first phase sustains >= 200 groups/s with
upload p99 < 100 ms (the issue's target) and the accounting holds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from bench.hub_load import client_process, learner_thread  # noqa: E402
from bench.hub_process import (  # noqa: E402
    LEASE_STAGES,
    LEASE_TOTAL,
    TICKS,
    UPLOAD_STAGES,
    UPLOAD_TOTAL,
    HubProcess,
    context_switches,
    process_ticks,
    thread_cpu,
)


def cpu_per_group(spent: dict, busy: dict, wall: float, main: str, python_threads: set[str], *, accepted: int,
                  leased: int, refused_full: int) -> dict:
    """Where the hub's CPU goes, in ms: the upload's work per group accepted, the lease's per group leased (each
    stage's own thread CPU time), the event loop's (HTTP, answers, sending batches) and the threads that are not
    Python's (torch's, safetensors') per group accepted; and the CPU of the worker threads that no stage clock
    covers (long polls, budget and stats requests, thread-pool overhead)."""
    def per(stage: str, groups: int) -> float | None:
        return round(spent[stage]["cpu_s"] * 1000 / groups, 3) if groups and stage in spent else None

    loop_s = busy.get(main, 0.0) * wall
    workers_s = sum(v for t, v in busy.items() if t in python_threads) * wall
    native_s = sum(v for t, v in busy.items() if t != main and t not in python_threads) * wall
    clocked = sum(spent.get(s, {"cpu_s": 0.0})["cpu_s"] for s in (UPLOAD_TOTAL, LEASE_TOTAL, "container decode",
                                                                   "ack (+ spool unlink)"))
    return {
        "upload_per_accepted": per(UPLOAD_TOTAL, accepted),
        **{f"  {s}": per(s, accepted) for s in UPLOAD_STAGES if s in spent},
        "lease_per_leased": per(LEASE_TOTAL, leased),
        **{f"  {s}": per(s, leased) for s in LEASE_STAGES if s in spent},
        "event_loop_per_accepted": round(loop_s * 1000 / accepted, 3) if accepted else None,
        "native_threads_per_accepted": round(native_s * 1000 / accepted, 3) if accepted else None,
        "workers_unclocked_per_accepted": round((workers_s - clocked) * 1000 / accepted, 3) if accepted else None,
        "leased_per_accepted": round(leased / accepted, 3) if accepted else None,
        "refused_full_per_accepted": round(refused_full / accepted, 3) if accepted else None,
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_phase(args, name: str) -> dict:
    spool = tempfile.mkdtemp(prefix="hubcap-spool-") if name == "spool" else None
    hub = HubProcess(spool, args.capacity, args.max_staleness, args.hub_cores, args.ungated)
    try:
        return measure_phase(args, name, hub)
    finally:
        hub.stop()
        if spool:
            subprocess.run(["rm", "-rf", spool], check=False)


def measure_phase(args, name: str, hub: HubProcess) -> dict:
    stop, measure = threading.Event(), threading.Event()
    learned = {"taken": 0, "taken_measured": 0, "tokens_measured": 0, "latency": []}
    ctx = mp.get_context("fork")  # before this process starts threads; torch is imported already
    results, ready, go, end = ctx.Queue(), ctx.Semaphore(0), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=client_process, daemon=True, args=(
        args, hub.url, list(range(k, args.generators, args.client_procs)), ready, go, end, results))
        for k in range(min(args.client_procs, args.generators))]
    for p in procs:
        p.start()
    learner = threading.Thread(target=learner_thread, args=(args, hub.url, stop, measure, learned), daemon=True)
    learner.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("the generator processes did not start")
    time.sleep(args.warmup)
    go.set()
    stats0 = requests.get(hub.url + "/v1/hub/stats", timeout=30).json()
    stages0 = requests.get(hub.url + "/bench/stages", timeout=30).json()
    switches0 = context_switches(hub.proc.pid)
    threads0, proc0, wall0 = thread_cpu(hub.proc.pid), process_ticks(hub.proc.pid), time.monotonic()
    measure.set()
    time.sleep(args.duration)
    end.set()
    measure.clear()
    threads1, proc1, wall = thread_cpu(hub.proc.pid), process_ticks(hub.proc.pid), time.monotonic() - wall0
    switches = context_switches(hub.proc.pid) - switches0
    stats1 = requests.get(hub.url + "/v1/hub/stats", timeout=30).json()
    stages1 = requests.get(hub.url + "/bench/stages", timeout=30).json()
    clients = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    time.sleep(1.0)  # the learner drains what is ready
    stop.set()
    learner.join(timeout=15)
    final = requests.get(hub.url + "/v1/hub/stats", timeout=30).json()
    uploads = [u for c in clients for u in c["uploads"]]
    ok = [u[2] for u in uploads if u[0] == "ok"]
    tokens_per_group = args.group_size * args.completion_len
    accepted = stats1["accepted"] - stats0["accepted"]
    main = str(hub.proc.pid)
    busy = {tid: (t - threads0.get(tid, 0)) / wall for tid, t in threads1.items()}
    zero = {"s": 0.0, "cpu_s": 0.0, "calls": 0}
    spent = {s: {k: v[k] - stages0["stages"].get(s, zero)[k] for k in zero} for s, v in stages1["stages"].items()}
    stages = {s: round(v["s"] / wall * 100, 1) for s, v in spent.items()}
    python_threads = {str(t) for t in stages1["python_threads"]} - {main}
    cpu_ms = cpu_per_group(spent, busy, wall, main, python_threads, accepted=accepted,
                           leased=stats1["leased"] - stats0["leased"],
                           refused_full=stats1["rejected_full"] - stats0["rejected_full"])
    return {
        "phase": name, "seconds": round(wall, 2), "generators": args.generators,
        "offered_groups_per_s": round(args.generators * args.rate, 1) if args.rate > 0 else None,
        "accepted_groups_per_s": round(accepted / wall, 1),
        "accepted_tokens_per_s": round(accepted * tokens_per_group / wall),
        "leased_groups_per_s": round(learned["taken_measured"] / wall, 1),
        "leased_tokens_per_s": round(learned["tokens_measured"] / wall),
        "upload_requests": len(ok), "upload_failures": {k: sum(1 for u in uploads if u[0] == k)
                                                        for k in {u[0] for u in uploads} - {"ok"}},
        "upload_p50_ms": _ms(percentile(ok, 50)), "upload_p99_ms": _ms(percentile(ok, 99)),
        "lease_p50_ms": _ms(percentile(learned["latency"], 50)),
        "lease_p99_ms": _ms(percentile(learned["latency"], 99)),
        "hub_cpu_pct": round((proc1 - proc0) / TICKS / wall * 100, 1),
        # CPU time per group moved through the hub (upload + lease): what a busier machine does not change much
        "hub_cpu_ms_per_group": round((proc1 - proc0) / TICKS * 1000 / accepted, 2) if accepted else None,
        "hub_event_loop_cpu_pct": round(busy.get(main, 0) * 100, 1),
        "hub_other_threads_cpu_pct": round(sum(v for t, v in busy.items() if t != main) * 100, 1),
        "cpu_ms": cpu_ms,
        "hub_context_switches_per_group": round(switches / accepted, 1) if accepted else None,
        "client_cpu_pct": round(sum(c["cpu"] for c in clients) * 100, 1),
        "stage_pct_of_wall": dict(sorted(stages.items(), key=lambda kv: -kv[1])),
        "accounting": {"accepted": final["accepted"], "leased_acked": learned["taken"],
                       "consumed": final["consumed"], "queued": final["queue_depth"],
                       "leased_unacked": final["leased_groups"],
                       "dropped_stale": final["dropped_stale"], "refused_stale": final["refused_stale"],
                       "holds": final["accepted"] == final["consumed"] + final["queue_depth"] + final["leased_groups"]
                       + final["dropped_stale"] + final["dropped_ref_failure"] + final["quarantined"]
                       and learned["taken"] == final["consumed"]},
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generators", type=int, default=80)
    p.add_argument("--rate", type=float, default=20000 / (16 * 512),
                   help="groups/s per generator (default: a 0.5B model at 20k completion tokens/s); 0: unpaced")
    p.add_argument("--groups-per-upload", type=int, default=4, help="groups per request (one engine call's)")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--completion-len", type=int, default=512)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--batch-groups", type=int, default=64, help="groups per lease of the learner")
    p.add_argument("--groups-per-step", type=int, default=256, help="groups per learner version")
    p.add_argument("--capacity", type=int, default=1024, help="ref_server.queue_capacity")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--hub-cores", type=int, nargs="+",
                   help="ref_server.cpu_cores: run the hub's process on these cores only (e.g. 0: one core, its threads never "
                   "in parallel)")
    p.add_argument("--client-procs", type=int, default=2)
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per phase")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--phases", nargs="+", default=["spool", "nospool"], choices=["spool", "nospool"])
    p.add_argument("--ungated", action="store_true",
                   help="switch off the hub's CPU gate (uploads decode in parallel; for comparison)")
    p.add_argument("--json-out")
    p.add_argument("--strict", action="store_true")
    args = p.parse_args(argv)
    for name in ("generators", "groups_per_upload", "group_size", "completion_len", "prompt_len", "batch_groups",
                 "groups_per_step", "capacity", "client_procs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate < 0 or args.duration <= 0 or args.warmup < 0:
        p.error("--rate and --warmup must be >= 0, --duration > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = [run_phase(args, name) for name in args.phases]
    print(f"hub capacity: {args.generators} generators x {args.rate:.2f} groups/s, {args.groups_per_upload} groups "
          f"of {args.group_size} x {args.completion_len} tokens per upload; learner {args.batch_groups} groups/lease")
    for r in phases:
        print(f"\n[{r['phase']}] accepted {r['accepted_groups_per_s']} groups/s ({r['accepted_tokens_per_s']} tok/s),"
              f" leased {r['leased_groups_per_s']} groups/s; upload p50 {r['upload_p50_ms']} ms p99 "
              f"{r['upload_p99_ms']} ms; lease p50 {r['lease_p50_ms']} ms p99 {r['lease_p99_ms']} ms")
        print(f"  hub CPU {r['hub_cpu_pct']}% = {r['hub_cpu_ms_per_group']} ms per group (event loop {r['hub_event_loop_cpu_pct']}%, other threads "
              f"{r['hub_other_threads_cpu_pct']}%), generators' CPU {r['client_cpu_pct']}%, failures "
              f"{r['upload_failures']}")
        print("  hub CPU, ms: " + ", ".join(f"{k.strip()} {v}" for k, v in r["cpu_ms"].items())
              + f"; context switches per group {r['hub_context_switches_per_group']}")
        print("  stage time, % of wall (summed over threads): "
              + ", ".join(f"{k} {v}" for k, v in r["stage_pct_of_wall"].items()))
        print(f"  accounting: {r['accounting']}")
    first = phases[0]
    target = (first["accepted_groups_per_s"] >= 200 and (first["upload_p99_ms"] or 1e9) < 100)
    held = all(r["accounting"]["holds"] for r in phases)
    print(f"\ntarget (>= 200 groups/s, p99 < 100 ms, {first['phase']}): {'PASS' if target else 'FAIL'}; "
          f"accounting {'holds' if held else 'BROKEN'}")
    result = {"bench": "hub_capacity", "args": {k: v for k, v in vars(args).items() if v is not None},
              "machine": f"{platform.machine()} {os.cpu_count()} cores", "phases": phases,
              "target_pass": target, "accounting_holds": held}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print("BENCH_JSON " + json.dumps(result))
    return 1 if args.strict and not (target and held) else 0


if __name__ == "__main__":
    sys.exit(main())
