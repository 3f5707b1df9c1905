"""The learner's own cost per step when rollouts are waiting for it: step wall time minus compute.

    .venv/bin/python bench/learner_overhead.py --steps 30
    .venv/bin/python bench/learner_overhead.py --trees /tmp/old-checkout . --steps 30   # before/after, one run

For each source tree (a checkout of another commit gives the baseline, measured in the same run): a ref server
(``grpo ref-server``, a real subprocess) is filled with enough rollout groups for every step (sampled once from
the demo's tiny model, then uploaded under fresh group ids), then ``grpo learner`` (a real subprocess) trains
``--steps`` steps on them with the tiny-cpu config's settings (16 groups of 16 per step, publish every step,
checkpoints off). The hub always holds the next batch, so whatever the learner spends outside compute is its
control-plane cost: leasing, encoding/decoding and acknowledging batches, version reports, publishing, logging.

Per tree it prints the medians over steps 2.. of: wall time between consecutive metrics records, compute
(``time_compute_s``: forward, backward, optimizer) and their difference, the overhead; where the tree logs the
step breakdown, the median of each part too. Then the ratio of the overheads to the first tree's. The last
line is a JSON summary. Other jobs on the machine change every number here: run the trees back to back and
compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from shared.config.loader import load_config  # noqa: E402
from shared.protocol.client import HubClient  # noqa: E402
from shared.protocol.health import NotHealthy, wait_healthy  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sampled_groups(model_dir: str, config, count: int):
    """``count`` groups of the config's group size, sampled from the model (prompts from the config's task)."""

    from generator.engines.hf import TransformersEngine
    from generator.main import load_examples
    from shared.protocol.records import RolloutGroup, SamplingParams

    engine = TransformersEngine(model_dir)
    gen = config.generator
    sampling = SamplingParams(temperature=gen.sampling.temperature, max_tokens=gen.sampling.max_tokens)
    examples = load_examples(gen.dataset, config.seed)[:count]
    prompts = [engine.tokenizer(e.question, add_special_tokens=False)["input_ids"] for e in examples]
    groups = []
    for prompt, samples in zip(prompts, engine.generate(prompts, sampling, n=gen.group_size, seed=config.seed)):
        groups.append(RolloutGroup.from_samples(
            prompt_ids=prompt, completion_ids=[s.token_ids for s in samples],
            behaviour_logprobs=[s.logprobs for s in samples],
            # alternating rewards: every group has a learning signal, as the demo's dynamic sampling ensures
            rewards=[float(i % 2) for i in range(len(samples))],
            finish_reasons=[s.finish_reason for s in samples], policy_version=0, generator_id="bench",
            sampling=sampling))
    engine.close()
    return groups


def write_config(path: Path, base: Path, model_dir: str, port: int, work: Path, steps: int) -> None:
    """Only the keys both old and new trees know (the demo config's, plus paths and this run's knobs)."""
    data = yaml.safe_load(base.read_text())
    data.pop("demo", None)
    data["ref_server"].update(model=model_dir, port=port, spool_dir=str(work / "spool"),
                              weights_dir=str(work / "relay"), max_staleness=100000, queue_capacity=100000)
    data["learner"].update(model=model_dir, hub_url=f"http://127.0.0.1:{port}", max_steps=steps,
                           checkpoint_dir=str(work / "checkpoints"), output_dir=str(work / "final"),
                           metrics_jsonl=str(work / "metrics.jsonl"), tensorboard_dir=None, checkpoint_every=None,
                           device="cpu")
    data["generator"]["model"] = model_dir
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def measure(tree: Path, groups, config_path: Path, model_dir: str, steps: int, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    port = free_port()
    config = work / "config.yaml"
    write_config(config, config_path, model_dir, port, work, steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(work / "services.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "deploy.cli", "ref-server", "--config", str(config)], cwd=tree,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", 120, process=server, poll_s=0.2)
        except NotHealthy:
            raise SystemExit(f"the ref server of {tree} did not start; see {work / 'services.log'}") from None
        client = HubClient(f"http://127.0.0.1:{port}")
        per_step = load_config(str(config_path), []).learner.groups_per_step
        for i in range((steps + 2) * per_step):  # the same rollouts, each upload a new group id
            client.upload_group(replace(groups[i % len(groups)], group_id=f"bench-{i:06d}"))
        started = time.monotonic()
        learner = subprocess.run([sys.executable, "-m", "deploy.cli", "learner", "--config", str(config)], cwd=tree,
                                 env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
        wall = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    if learner.returncode != 0:
        raise SystemExit(f"the learner of {tree} failed; see {work / 'services.log'}")
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    return summarize(records, wall)


def median(values) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def summarize(records: list[dict], wall: float) -> dict:
    later = list(zip(records, records[1:]))[1:]  # steps 3.. against their predecessor (step 1 includes set-up)
    gaps = [b["time"] - a["time"] for a, b in later]
    compute = [b["time_compute_s"] for _, b in later]
    result = {"steps": len(records), "learner_process_s": round(wall, 2),
              "step_ms": round(1000 * median(gaps), 2), "compute_ms": round(1000 * median(compute), 2),
              "overhead_ms": round(1000 * median(g - c for g, c in zip(gaps, compute)), 2)}
    parts = [k for k in records[-1] if k.startswith("time_") and k.endswith("_s")]
    result["parts_ms"] = {k.removeprefix("time_").removesuffix("_s"): round(1000 * median(b.get(k, 0.0)
                                                                                       for _, b in later), 2)
                          for k in parts}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parents[1])],
                        help="Source trees to measure, the first one being the baseline of the ratios.")
    parser.add_argument("--config", default="deploy/configs/tiny-cpu.yaml", help="Settings (and the tiny model).")
    parser.add_argument("--model", default=None,
                        help="A model folder to train instead of the demo's warmed-up tiny model (built first when "
                             "absent, minutes on a CPU): the overhead per step does not depend on what the weights "
                             "learned, only on the model's shape.")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="runs/bench/learner-overhead")
    args = parser.parse_args(argv)
    config = load_config(args.config, [])
    if args.model is None:
        from deploy.demo.run import build_model

        build_model(config)  # the demo's model, built once and cached
    model_dir = str(Path(args.model or config.generator.model).resolve())
    groups = sampled_groups(model_dir, config, config.learner.groups_per_step)
    results = {}
    for index, tree in enumerate(args.trees):
        tree_path = Path(tree).resolve()
        print(f"[bench] {tree_path}: {args.steps} learner steps with the hub always holding the next batch",
              flush=True)
        results[str(tree_path)] = measure(tree_path, groups, Path(args.config).resolve(), model_dir, args.steps,
                                          Path(args.out).resolve() / f"tree{index}")
        r = results[str(tree_path)]
        print(f"[bench]   step {r['step_ms']} ms, compute {r['compute_ms']} ms, overhead {r['overhead_ms']} ms "
              f"(medians); parts: {r['parts_ms']}", flush=True)
    base = next(iter(results.values()))["overhead_ms"]
    for r in results.values():
        r["overhead_ratio_to_first"] = round(r["overhead_ms"] / base, 3) if base else None
    summary = {"results": results, "load_avg": os.getloadavg(), "cpu_count": os.cpu_count()}
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
