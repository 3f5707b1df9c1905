"""Benchmark: reference scoring throughput of one vs two joined scorers (``grpo scorer``), side by side in one run.

A hub (``grpo ref-server`` with ``ref_server.local_scoring: false``, a child process on 127.0.0.1) and scorer
processes (``grpo scorer --threads 1``, ``OMP_NUM_THREADS=1``) on the same model; ``--clients`` threads of this
process keep ``POST /v1/logprobs`` requests (binary, ``--rows`` rows of ``--prompt-tokens`` + ``--completion-tokens``
random ids each) in flight, so the hub's scorer pool always has work waiting. Each phase also reports the CPU the
scorer processes got (their CPU seconds per wall second, /proc/PID/stat): on a shared machine, whether two
single-threaded scorers had two cores. Phases, in one run, each
``--seconds`` long after a warm-up: ``one`` (scorer A), ``two`` (A and B), ``one`` again (B sent SIGTERM: it finishes
its jobs and leaves). Scorer start-up (imports, model load) happens between phases, never inside one.
Throughput = tokens of the rows scored (prompt + completion) per second of wall time; the ratio is ``two`` over the
mean of the two ``one`` phases (so a drift in the machine's other load hits both sides). Every answer is checked
for its shape; a final ``BENCH_JSON {...}`` line holds every number.

Model: random weights (nothing downloaded), the demo's character tokenizer, Llama ``--hidden`` x ``--layers``.
``--teacher``: the same with the model as on-policy distillation's teacher (``ref_server.teacher_model``, no
reference: its own pool), scorers started with ``grpo scorer --teacher`` and requests naming ``model=teacher``.

    .venv/bin/python bench/scorers.py                       # CPU: hidden 384, 4 layers, 8 x (128 + 384), 20 s phases
    .venv/bin/python bench/scorers.py --seconds 30 --clients 6
    .venv/bin/python bench/scorers.py --teacher             # the teacher's pool (docs/distillation.md)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from shared.protocol.health import wait_healthy  # noqa: E402
from shared.protocol.logprob_messages import decode_logprob_response, encode_logprob_request  # noqa: E402

OCTET = {"Content-Type": "application/octet-stream"}


def build_model_dir(out: Path, hidden: int, layers: int, max_positions: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deploy.demo.tiny_model import build_char_tokenizer, save_model_dir

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
                         num_key_value_heads=max(hidden // 64, 1), max_position_embeddings=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return save_model_dir(AutoModelForCausalLM.from_config(config), tokenizer, out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1"}


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", *argv], cwd=REPO, env=child_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


SCORING = "scoring"  # the healthz key that says who scores: "teacher_scoring" with --teacher


def joined(url: str) -> str:
    return requests.get(f"{url}/healthz", timeout=10).json()[SCORING]


def wait_scoring(url: str, status: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while joined(url) != status:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the hub's scoring never became {status!r} (it is {joined(url)!r})")
        time.sleep(0.2)


class Load:
    """``clients`` threads sending requests back to back; counts the tokens of the rows answered."""

    def __init__(self, url: str, bodies: list[tuple[bytes, int, list[int]]], clients: int) -> None:
        self.url, self.bodies = url, bodies
        self.tokens = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        session = requests.Session()
        n = i
        while not self.stop.is_set():
            body, tokens, completions = self.bodies[n % len(self.bodies)]
            n += len(self.threads)
            answer = session.post(f"{self.url}/v1/logprobs", data=body, headers=OCTET, timeout=600,
                                  params={"model": "teacher"} if SCORING == "teacher_scoring" else None)
            answer.raise_for_status()
            rows = decode_logprob_response(answer.content)
            assert [r.numel() for r in rows] == completions, "answer of the wrong shape"
            with self.lock:
                self.tokens += tokens

    def __enter__(self):
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)

    def measure(self, warmup_s: float, seconds: float, scorers: list[int]) -> tuple[float, float]:
        """(tokens/s, CPU cores the scorer processes got: their CPU seconds per wall second) over ``seconds``."""
        time.sleep(warmup_s)
        with self.lock:
            before, started, cpu = self.tokens, time.perf_counter(), cpu_seconds(scorers)
        time.sleep(seconds)
        with self.lock:
            wall = time.perf_counter() - started
            return (self.tokens - before) / wall, (cpu_seconds(scorers) - cpu) / wall


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (/proc/PID/stat): whether the scorers got the cores."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / ticks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8, help="Rows per request.")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--completion-tokens", type=int, default=384)
    parser.add_argument("--clients", type=int, default=8, help="Requests kept in flight (more than the scorers "
                        "hold, so that work always waits for a free scorer).")
    parser.add_argument("--seconds", type=float, default=20.0, help="Length of each timed phase.")
    parser.add_argument("--warmup", type=float, default=4.0, help="Seconds of load before each phase is timed.")
    parser.add_argument("--teacher", action="store_true", help="Score the model as the teacher of on-policy "
                        "distillation (its own pool, grpo scorer --teacher) instead of the reference.")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    global SCORING
    SCORING = "teacher_scoring" if args.teacher else "scoring"

    tmp = tempfile.TemporaryDirectory(prefix="bench-scorers-")
    folder = Path(tmp.name)
    tokens_per_row = args.prompt_tokens + args.completion_tokens
    model = build_model_dir(folder / "model", args.hidden, args.layers, tokens_per_row + 8)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = folder / "hub.yaml"
    config.write_text(yaml.safe_dump({
        "algorithm": {"loss": {"beta": 0.0 if args.teacher else 0.04}},
        "ref_server": {"model": None if args.teacher else str(model), "teacher_model": str(model) if args.teacher
                       else None, "port": port, "local_scoring": False, "device": "cpu",
                       "dtype": "float32", "spool_dir": None, "weights_dir": str(folder / "relay"),
                       "log_level": "warning", "max_request_bytes": 2**28, "max_request_tokens": 2**22}}))
    gen = torch.Generator().manual_seed(0)
    bodies = []
    for _ in range(16):
        ids = torch.randint(3, vocab, (args.rows, tokens_per_row), generator=gen)
        bodies.append((encode_logprob_request(list(ids), [args.prompt_tokens] * args.rows, 1.0),
                       args.rows * tokens_per_row, [args.completion_tokens] * args.rows))

    processes: dict[str, subprocess.Popen] = {}
    results: dict[str, float] = {}
    cpu: dict[str, float] = {}
    load_before = os.getloadavg()
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        processes["hub"] = start(["ref-server", "--config", str(config)], folder / "hub.log")
        wait_healthy(url, 600, process=processes["hub"])

        def scorer(name: str) -> subprocess.Popen:
            return start(["scorer", "--config", str(config), "--hub", url, "--id", name, "--device", "cpu",
                          "--threads", "1", *(["--teacher"] if args.teacher else [])], folder / f"{name}.log")

        processes["a"] = scorer("a")
        wait_scoring(url, "1 joined")
        with Load(url, bodies, args.clients) as load:
            def phase(name: str, scorers: list[str]) -> None:
                rate, cores = load.measure(args.warmup, args.seconds, [processes[s].pid for s in scorers])
                results[name], cpu[name] = rate, cores
                print(f"{name:9s} ({'+'.join(scorers)}): {rate:8.0f} tokens/s, the scorers got {cores:.2f} cores",
                      flush=True)

            phase("one", ["a"])
            processes["b"] = scorer("b")
            wait_scoring(url, "2 joined")
            phase("two", ["a", "b"])
            processes["b"].send_signal(signal.SIGTERM)
            if processes["b"].wait(timeout=120) != 0:
                raise RuntimeError("scorer b did not exit 0 after SIGTERM")
            wait_scoring(url, "1 joined")
            phase("one_again", ["a"])
    finally:
        for process in reversed(list(processes.values())):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
    one = (results["one"] + results["one_again"]) / 2
    ratio = results["two"] / one
    print(f"\ntwo / one = {ratio:.2f}x (target >= 1.7x)")
    summary = {"ratio": ratio, "teacher": args.teacher, **results, "scorer_cores": cpu, "hidden": args.hidden, "layers": args.layers, "rows": args.rows,
               "prompt_tokens": args.prompt_tokens, "completion_tokens": args.completion_tokens,
               "clients": args.clients, "seconds": args.seconds, "cpus": os.cpu_count(),
               "machine": platform.processor() or platform.machine(), "started": started_at,
               "load_before": load_before, "load_after": os.getloadavg(), "torch": torch.__version__}
    print("BENCH_JSON " + json.dumps(summary))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
