"""Weight sync: from "the learner has new weights" to "every generator serves them", per transport.

For each model (the tiny demo model; a Qwen2.5-0.5B-shaped model with random weights and a 128-token vocabulary,
358 M parameters, as in issue 12) and each transport that applies on this machine:

* ``http``: the learner's publisher with ``weight_sync.transport: http`` (send buffer -> relay upload in the
  background), generators polling the relay, downloading, checking and loading the file;
* ``gloo`` (CPU) / ``nccl`` (GPU): ``transport: collective``, generators joined through the hub, each served
  bucket by bucket through its group;
* ``ipc`` (GPU): learner and generator on the same GPU, the generator copying out of the learner's mapped buffer;
* ``bare``: a bare ``broadcast`` of the same number of bytes, one flat tensor, in a group of the same size (gloo
  on CPU, NCCL on GPU), measured in the same run: the floor any transport is compared with.

Generators are separate processes (``--role generator``, bench/weight_sync_processes.py), each a real transformers
engine and :class:`shared.weight_sync.receiver.WeightReceiver` polling as often as it would between engine calls; they report
when they serve each version (wall clock, same host). The learner's side is the real
:class:`shared.weight_sync.publisher.WeightPublisher`; its stall per publish (the copy into the send buffer) is compared
with the forward + backward time of one micro-batch of the same model (a lower bound of a learner step).
For the group transports it also reports the **generator blocked per version**: the generator's time from the
hub poll that answered "receive" to the weights loaded into its model (what ``grpo run`` logs as "version N
received in X s"; the generator serves nothing meanwhile), compared with the bare broadcast of the same bytes.
``--busy-learner`` runs the learner's forward + backward in a loop in a thread of the learner process while the
versions are published, as in a run, where the training thread holds the interpreter lock most of the time.
The last line is a JSON summary.

``--publish merged,adapter`` measures a LoRA learner (``learner.lora``, rank ``--lora-rank``, adapters randomized
as training would leave them) publishing the merged policy (the whole model's bytes plus the merge) and only the
adapter (``learner.lora.publish: adapter``: lora_A/lora_B + scaling; generators apply it onto the base they loaded
from the model folder) over the same transports; each mode reports its bytes per publish (the send buffer, what
each group member is sent per version). ``--models`` also takes a model folder (e.g. SmolLM2 from ``grpo
fetch-model``).

    .venv/bin/python bench/weight_sync.py                        # CPU: tiny + 0.5B-shaped, http / gloo / bare
    .venv/bin/python bench/weight_sync.py --models tiny --repeats 5
    .venv/bin/python bench/weight_sync.py --models tiny --transports gloo --repeats 20 --busy-learner
    .venv/bin/python bench/weight_sync.py --device cuda          # + nccl / ipc (one GPU: ipc and http only)
    .venv/bin/python bench/weight_sync.py --models tiny --transports gloo --publish merged,adapter --lora-rank 8
    .venv/bin/python bench/weight_sync.py --device cuda --models tiny --publish adapter   # adapter over ipc / nccl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.weight_sync_processes import (  # noqa: E402
    GeneratorProcess,
    HubProcess,
    build_model_dir,
    run_generator,
)


# ------------------------------------------------------------------------------------------------ measurements
def measure_transport(args, url: str, model, model_dir: Path, transport: str, devices: list[str],
                      learner_device: torch.device, first_version: int) -> dict:
    """Publish ``repeats`` versions; per version the time until every generator served it, and the stall."""
    from shared.config.schema import WeightSyncConfig
    from shared.protocol.client import HubClient, RetryPolicy
    from shared.weight_sync.publisher import WeightPublisher

    wire = {"gloo": "collective", "nccl": "collective", "ipc": "ipc", "http": "http"}[transport]
    cfg = WeightSyncConfig(transport=wire, bucket_mb=args.bucket_mb, timeout_s=60, join_timeout_s=600, poll_s=0.2)
    publisher = WeightPublisher(model, lambda: HubClient(url, retry=RetryPolicy(max_retry_s=60)), cfg, rank=0,
                                world=1, device=learner_device, relay_version=HubClient(url).weights_version(),
                                adapter_only=args.mode == "adapter")
    gens = [GeneratorProcess(args, url, model_dir, wire, f"{transport}-{i}", d) for i, d in enumerate(devices)]
    busy = BusyLearner(model, learner_device) if args.busy_learner else None
    try:
        for g in gens:
            if not g.ready.wait(600):
                raise RuntimeError(f"{transport} generator did not get ready")
        if busy is not None:
            busy.start()
        latencies, stalls, blocked = [], [], []
        versions = range(first_version, first_version + args.repeats)
        for version in versions:
            started = time.time()
            stalls.append(publisher.publish(version))
            done = max(g.wait_version(version, 600) for g in gens)
            latencies.append(done - started)
            blocked += [g.blocked[version] for g in gens]
            time.sleep(0.2)  # let the sender post its bookkeeping before the next version
        time.sleep(0.5)  # the last transfer's bookkeeping (served, bytes) before the counters are read
        counters = publisher.metrics()
    finally:
        if busy is not None:
            busy.stop()
        for g in gens:
            g.stop()
        publisher.close()
    return {"publish_to_serving_s": statistics.median(latencies), "all_s": [round(x, 4) for x in latencies],
            "bytes_per_publish": publisher.layout.total_bytes,
            "group_bytes_sent": counters.get("weight_sync_group_bytes_sent", 0.0),
            "stall_s": statistics.median(stalls), "skipped_busy": counters.get("weight_sync_skipped_busy", 0.0),
            "generator_blocked_s": statistics.median(blocked),
            "generator_blocked_p90_s": sorted(blocked)[int(0.9 * (len(blocked) - 1))],
            "blocked_all_s": [round(x, 4) for x in blocked],
            "busy_learner_steps": busy.steps if busy is not None else 0}


class BusyLearner:
    """The learner's training thread in a run: forward + backward of one micro-batch, over and over (it holds the
    interpreter lock most of the time, and a core), while the sender's threads transfer the versions."""

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device = model, device
        self.halt = threading.Event()
        self.steps = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (4, 64), device=self.device)
        while not self.halt.is_set():
            self.model(input_ids=ids, labels=ids).loss.backward()
            self.model.zero_grad(set_to_none=True)
            self.steps += 1

    def stop(self) -> None:
        self.halt.set()
        self.thread.join(600)


def measure_bare_broadcast(total_bytes: int, receivers: int, backend: str, devices: list[str], repeats: int) -> float:
    """Median seconds of one broadcast of ``total_bytes`` (one flat tensor) from rank 0 to ``receivers`` ranks
    in other processes, the same group construction as the transports."""
    from shared.weight_sync import groups

    store = groups.host_store("127.0.0.1", receivers + 1, 300)
    address = groups.store_address("127.0.0.1", store.port)
    code = ("import sys,torch; from shared.weight_sync import groups as g; "
            "s=g.join_store('127.0.0.1',int(sys.argv[1]),int(sys.argv[2]),300); "
            "pg=g.build_group(s,sys.argv[3],int(sys.argv[4]),int(sys.argv[2]),sys.argv[5],300); "
            "t=torch.empty(int(sys.argv[6]),dtype=torch.uint8,device=sys.argv[7]); "
            "[(g.broadcast(pg,t,300), g.agree_all_applied(pg,True,t.device,300)) for _ in range(int(sys.argv[8]))]")
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(store.port), str(receivers + 1), address, str(r + 1),
                               backend, str(total_bytes), devices[r], str(repeats)], cwd=root,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
             for r in range(receivers)]
    group = groups.build_group(store, address, 0, receivers + 1, backend, 300)
    device = torch.device(devices[0] if backend == "nccl" else "cpu")
    tensor = torch.ones(total_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        groups.broadcast(group, tensor, 300)
        groups.agree_all_applied(group, True, device, 300)  # every receiver has the bytes
        times.append(time.perf_counter() - started)
    for p in procs:
        p.wait(120)
    groups.close_group(group)
    return statistics.median(times)


def step_time(model, device: torch.device, batch: int = 4, seq: int = 64) -> float:
    """Forward + backward of one micro-batch: a lower bound of the learner's step time for this model."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    times = []
    for _ in range(2):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return min(times)


def lora_learner(args, model):
    """The policy with LoRA adapters (learner/lora.py), randomized: peft starts lora_B at zero."""
    from learner.lora import adapter_parameters, apply_lora
    from shared.config.schema.learner import LoraConfig

    targets = args.lora_targets.split(",") if args.lora_targets else None
    lora = LoraConfig(r=args.lora_rank, alpha=2.0 * args.lora_rank,
                      **({"target_modules": targets} if targets else {}))
    model = apply_lora(model, lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in adapter_parameters(model):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


def bench_model(args, name: str, live_url: str, first_version: int) -> dict:
    from transformers import AutoModelForCausalLM

    from shared.weight_sync.params import adapter_tensors, policy_tensors

    on_gpu = args.device == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model_dir = build_model_dir(name, Path(args.work) / Path(name).name, dtype)
    learner_device = torch.device("cuda:0" if on_gpu else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if args.mode != "full":
        model = lora_learner(args, model)
    model = model.to(learner_device)
    published = adapter_tensors(model)[0] if args.mode == "adapter" else policy_tensors(model)
    total = sum(torch.Size(t.shape).numel() for t in published) * dtype.itemsize  # the send buffer
    n_gen = args.generators if args.generators else (2 if name == "tiny" else 1)
    result: dict = {"params": sum(p.numel() for p in model.parameters()), "bytes": total, "generators": n_gen,
                    "publish": args.mode}
    version = first_version
    gpus = torch.cuda.device_count() if on_gpu else 0
    plans = [("http", ["cpu"] * n_gen if not on_gpu else ["cuda:0"] * n_gen)]
    if not on_gpu:
        plans.append(("gloo", ["cpu"] * n_gen))
    elif gpus > n_gen:
        plans.append(("nccl", [f"cuda:{i + 1}" for i in range(n_gen)]))
    if on_gpu:
        plans.append(("ipc", ["cuda:0"] * n_gen))
    plans = [(t, d) for t, d in plans if t == "http" or args.transports is None or t in args.transports.split(",")]
    for transport, devices in plans:
        print(f"[{name}] {transport}: {n_gen} generator(s) on {devices}", flush=True)
        result[transport] = measure_transport(args, live_url, model, model_dir, transport, devices,
                                              learner_device, version)
        version += args.repeats + 1
        print(f"[{name}] {transport}: {json.dumps(result[transport])}", flush=True)
    bare_backend, bare_devices = ("nccl", [f"cuda:{i + 1}" for i in range(n_gen)]) if gpus > n_gen else (
        "gloo", ["cpu"] * n_gen)
    result["bare_broadcast_s"] = measure_bare_broadcast(total, n_gen, bare_backend, bare_devices, args.repeats)
    if args.busy_learner:  # the floor under the same load: the bare broadcast beside the busy training thread
        busy = BusyLearner(model, learner_device)
        busy.start()
        try:
            result["bare_broadcast_busy_s"] = measure_bare_broadcast(total, n_gen, bare_backend, bare_devices,
                                                                     args.repeats)
        finally:
            busy.stop()
    result["bare_backend"] = bare_backend
    result["step_fwd_bwd_s"] = step_time(model, learner_device)
    http = result["http"]["publish_to_serving_s"]
    for transport, _ in plans:
        r = result[transport]
        r["vs_http"] = r["publish_to_serving_s"] / http
        r["vs_bare"] = r["publish_to_serving_s"] / result["bare_broadcast_s"]
        r["stall_vs_step"] = r["stall_s"] / result["step_fwd_bwd_s"]
        if transport != "http":  # the generator's time in the receive against the bare broadcast of the bytes
            r["blocked_vs_bare"] = r["generator_blocked_s"] / result["bare_broadcast_s"]
            if "bare_broadcast_busy_s" in result:
                r["blocked_vs_bare_busy"] = r["generator_blocked_s"] / result["bare_broadcast_busy_s"]
    return result, version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=["bench", "generator"], default="bench")
    parser.add_argument("--models", default="tiny,qwen0.5b-shape", help="comma list of tiny, qwen0.5b-shape")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="versions published per transport")
    parser.add_argument("--generators", type=int, default=0, help="generators (default: 2 tiny, 1 for 0.5B)")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--transports", default=None, help="comma list among gloo, nccl, ipc (http always runs)")
    parser.add_argument("--poll-every-s", type=float, default=0.01, help="generator's pause between syncs")
    parser.add_argument("--publish", default="full",
                        help="comma list among full, merged, adapter (merged / adapter: a LoRA learner)")
    parser.add_argument("--lora-rank", type=int, default=8, help="LoRA rank for --publish merged/adapter")
    parser.add_argument("--lora-targets", default=None, help="comma list of target modules (default: learner's)")
    parser.add_argument("--busy-learner", action="store_true",
                        help="run forward + backward in a loop in the learner process while publishing (as in a run)")
    parser.add_argument("--url"), parser.add_argument("--model-dir"), parser.add_argument("--transport")
    parser.add_argument("--name"), parser.add_argument("--work", default=None)
    args = parser.parse_args(argv)
    if args.role == "generator":
        args.device = args.device if args.device != "cuda" else "cuda:0"
        run_generator(args)
        return 0
    if not set(args.publish.split(",")) <= {"full", "merged", "adapter"}:
        parser.error(f"--publish: a comma list among full, merged, adapter, got {args.publish!r}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as work:
        args.work = work
        summary: dict = {"bench": "weight_sync", "device": args.device, "cpus": os.cpu_count(),
                         "loadavg_start": list(os.getloadavg()), "bucket_mb": args.bucket_mb,
                         "repeats": args.repeats, "busy_learner": args.busy_learner, "models": {}}
        for name in args.models.split(","):  # a hub per model and mode: the relay holds one layout's versions
            for mode in args.publish.split(","):
                args.mode = mode
                hub = HubProcess(Path(work) / f"hub-{Path(name).name}-{mode}")
                try:
                    key = name if mode == "full" else f"{name}:{mode}"
                    summary["models"][key], _ = bench_model(args, name, hub.url, 1)
                finally:
                    hub.stop()
        summary["loadavg_end"] = list(os.getloadavg())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
