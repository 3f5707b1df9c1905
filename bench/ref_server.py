"""Benchmark: reference-server scoring throughput, in-process vs over HTTP (binary, JSON, /v1/completions).

Measures tokens/s (prompt + completion tokens of every row scored, per second of wall time) of the same workload,
``--rows`` rows of ``--prompt-tokens`` + ``--completion-tokens`` random token ids, four ways, in one run:

* ``inprocess``: :class:`ref_server.scoring.scorer.ReferenceScorer` (the server's own micro-batching scorer) called
  directly, on a model loaded from the same folder as the server's;
* ``binary``: ``POST /v1/logprobs`` with safetensors bodies (:func:`shared.protocol.logprob_messages.encode_logprob_request`,
  results decoded to tensors with :func:`shared.protocol.logprob_messages.decode_logprob_response`);
* ``json``: ``POST /v1/logprobs`` with JSON bodies (``requests``' ``json=`` / ``.json()``, as any tool would);
* ``completions``: ``POST /v1/completions`` with token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 0``
  (what lm-eval asks for, minus the one generated token): every token's logprob plus a top-1 dict per token.

each with one client (one request of all rows at a time, sequentially) and with several (``--clients``: the rows
split evenly, every client sending its share concurrently; threads for in-process). Ratios are against
in-process with the same number of clients, from the same run. The server is the real one (``grpo ref-server``'s
``ref_server.server.serve``: uvicorn bound by host/port) in a child process on 127.0.0.1, so client and server
do not share a GIL; on a GPU both processes load the model on it (the in-process one is idle while the server is
measured and vice versa). Each mode gets one warm-up round, then ``--repeats`` timed rounds, the modes taking
turns round by round (so that other load on the machine hits them alike); the median is reported.
Every HTTP answer is checked against the in-process logprobs (max |diff| reported).

Model: random weights from a config (nothing is downloaded) plus the demo's character tokenizer, saved to a
temporary folder. Presets: ``tiny`` (default on CPU: Llama, hidden 192, 2 layers, vocab 86, 1.0 M parameters: the
forward is cheap, so HTTP overheads show the most), ``small`` (Qwen2, hidden 512, 8 layers, vocab 32000) and
``qwen2.5-0.5b`` (default on CUDA: Qwen2.5-0.5B's shape, vocab 151936, bf16). ``--model-dir`` uses a folder instead.

    .venv/bin/python bench/ref_server.py                          # CPU: tiny, 64 x (256 + 768), clients 1 and 4
    .venv/bin/python bench/ref_server.py --preset small --repeats 2
    .venv/bin/python bench/ref_server.py --device cuda            # GPU: Qwen2.5-0.5B shape, bf16

The last line is ``BENCH_JSON {...}`` with every number. ``--strict`` exits 1 unless, with one client, binary
>= 0.9x and JSON >= 0.75x in-process (the issue's targets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
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

from shared.protocol.health import NotHealthy, wait_healthy  # noqa: E402

PRESETS = {
    "tiny": ("llama", dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=4)),
    "small": ("qwen2", dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1e6)),
}
MODES = ("inprocess", "binary", "json", "completions")
OCTET = {"Content-Type": "application/octet-stream"}


def build_model_dir(preset: str, out: Path, max_positions: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from deploy.demo.tiny_model import build_char_tokenizer, save_model_dir

    tokenizer = build_char_tokenizer()
    family, shape = PRESETS[preset]
    shape = {"vocab_size": len(tokenizer), **shape}
    config_cls = LlamaConfig if family == "llama" else Qwen2Config
    config = config_cls(max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    return save_model_dir(model, tokenizer, out)


def serve(args: argparse.Namespace) -> None:
    """Child process: the real server (``ref_server.server.serve``) on 127.0.0.1:port."""
    from ref_server.server import serve as run_server
    from shared.config.schema import GRPOConfig

    run_server(GRPOConfig.model_validate({
        "algorithm": {"loss": {"beta": 0.04}},
        "ref_server": {"model": args.serve, "host": "127.0.0.1", "port": args.port, "device": args.device,
                       "batch_tokens": args.batch_tokens, "max_request_tokens": 2**22,
                       "max_request_bytes": 2**30, "log_level": "warning",
                       "spool_dir": str(Path(args.serve) / "spool"), "weights_dir": str(Path(args.serve) / "w")},
    }))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One HTTP client (its own keep-alive session) for one mode."""

    def __init__(self, url: str, mode: str) -> None:
        from shared.protocol.logprob_messages import decode_logprob_response, encode_logprob_request

        self.url, self.mode, self.session = url, mode, requests.Session()
        self._encode, self._decode = encode_logprob_request, decode_logprob_response

    def score(self, ids: list[list[int]], plens: list[int]) -> list[torch.Tensor]:
        if self.mode == "binary":
            r = self.session.post(self.url + "/v1/logprobs", data=self._encode(ids, plens, 1.0), headers=OCTET)
            r.raise_for_status()
            return self._decode(r.content)
        if self.mode == "json":
            r = self.session.post(self.url + "/v1/logprobs", json={"input_ids": ids, "prompt_lengths": plens})
            r.raise_for_status()
            return [torch.tensor(row) for row in r.json()["logprobs"]]
        r = self.session.post(self.url + "/v1/completions", json={"model": "bench", "prompt": ids, "echo": True,
                                                                  "logprobs": 1, "max_tokens": 0, "temperature": 0})
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return [torch.tensor(c["logprobs"]["token_logprobs"][p:]) for c, p in zip(choices, plens)]


def run_round(score_fns, parts) -> tuple[float, list]:
    """Every client scores its part concurrently; returns (seconds, results in row order)."""
    results: list = [None] * len(parts)
    errors: list = []

    def work(i):
        try:
            results[i] = score_fns[i](*parts[i])
        except Exception as exc:  # noqa: BLE001 - reported after the round
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(parts))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed, [row for part in results for row in part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None)
    parser.add_argument("--model-dir", default=None, help="Use this model folder instead of a preset.")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N].")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--completion-tokens", type=int, default=768)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-tokens", type=int, default=16384, help="ref_server.batch_tokens (both sides).")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--strict", action="store_true")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.serve:
        serve(args)
        return 0

    from ref_server.scoring.scorer import ReferenceScorer, Row
    from ref_server.server import load_reference_model
    from shared.devices import default_dtype

    device = torch.device(args.device)
    preset = args.preset or ("qwen2.5-0.5b" if device.type == "cuda" else "tiny")
    seq = args.prompt_tokens + args.completion_tokens
    tmp = tempfile.TemporaryDirectory()
    folder = Path(args.model_dir) if args.model_dir else build_model_dir(preset, Path(tmp.name) / "model",
                                                                         max(2048, seq))
    model = load_reference_model(str(folder), device, default_dtype("auto", device))
    vocab = model.config.get_text_config().vocab_size
    params = sum(p.numel() for p in model.parameters())
    scorer = ReferenceScorer(model, vocab_size=vocab, max_context=2**31, batch_tokens=args.batch_tokens)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.rows, seq), generator=gen).tolist()
    plens = [args.prompt_tokens] * args.rows
    tokens = args.rows * seq

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(folder), "--port", str(port),
                               "--device", args.device, "--batch-tokens", str(args.batch_tokens)], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, 300, process=server)
        except NotHealthy:
            raise SystemExit("the benchmark server did not start") from None

        reference = None
        table: dict[str, dict] = {}
        for clients in args.clients:
            share = -(-args.rows // clients)
            parts = [(ids[i:i + share], plens[i:i + share]) for i in range(0, args.rows, share)]
            fns = {mode: [lambda i, p: scorer.score([Row(r, pl) for r, pl in zip(i, p)])] * len(parts)
                   if mode == "inprocess" else [Client(url, mode).score for _ in parts] for mode in args.modes}
            for mode in args.modes:  # warm-up
                run_round(fns[mode], parts)
            times: dict[str, list[float]] = {mode: [] for mode in args.modes}
            diffs: dict[str, float] = {}
            for _ in range(args.repeats):  # modes interleaved, so that load drifting on the machine hits all alike
                for mode in args.modes:
                    elapsed, results = run_round(fns[mode], parts)
                    times[mode].append(elapsed)
                    if reference is None:
                        reference = results  # the first mode's answers (in-process when it runs)
                    diffs[mode] = max(diffs.get(mode, 0.0),
                                      max(float((a.float() - b.float()).abs().max()) for a, b in zip(results,
                                                                                                     reference)))
            for mode in args.modes:
                seconds = statistics.median(times[mode])
                table[f"{mode}/{clients}"] = {"mode": mode, "clients": clients, "tokens_per_s": tokens / seconds,
                                              "seconds": seconds, "all_seconds": times[mode],
                                              "max_abs_diff": diffs[mode]}
                print(f"{mode:12s} clients={clients}: {tokens / seconds:12,.0f} tokens/s  ({seconds:.3f} s per "
                      f"round; max|diff| vs {args.modes[0]} {diffs[mode]:.1e})", flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
        scorer.close()

    machine = (torch.cuda.get_device_name(device) if device.type == "cuda"
               else f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, "
                    f"torch threads {torch.get_num_threads()}")
    print(f"\n{preset if not args.model_dir else args.model_dir} ({params / 1e6:.1f} M parameters, "
          f"{next(model.parameters()).dtype}) on {machine}; {args.rows} rows x ({args.prompt_tokens} + "
          f"{args.completion_tokens}) tokens, batch_tokens {args.batch_tokens}, median of {args.repeats}")
    print(f"{'clients':>8} " + " ".join(f"{m:>13}" for m in args.modes))
    ok = True
    for clients in args.clients:
        base = table.get(f"inprocess/{clients}")
        cells = []
        for mode in args.modes:
            row = table[f"{mode}/{clients}"]
            ratio = row["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
            row["ratio_vs_inprocess"] = ratio
            cells.append(f"{row['tokens_per_s'] / 1e3:7.1f}k {ratio:4.2f}x")
        print(f"{clients:>8} " + " ".join(f"{c:>13}" for c in cells))
    single = {m: table.get(f"{m}/1", {}).get("ratio_vs_inprocess") for m in ("binary", "json")}
    if single["binary"] is not None and single["json"] is not None:
        ok = single["binary"] >= 0.9 and single["json"] >= 0.75
        print(f"targets (1 client): binary {single['binary']:.2f}x >= 0.9: {'PASS' if single['binary'] >= 0.9 else 'FAIL'}"
              f"; json {single['json']:.2f}x >= 0.75: {'PASS' if single['json'] >= 0.75 else 'FAIL'}")
    summary = {"preset": preset, "model_dir": args.model_dir, "params": params, "device": str(device),
               "machine": machine, "rows": args.rows, "prompt_tokens": args.prompt_tokens,
               "completion_tokens": args.completion_tokens, "batch_tokens": args.batch_tokens,
               "repeats": args.repeats, "results": table}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    print("BENCH_JSON " + json.dumps(summary))
    tmp.cleanup()
    return 1 if args.strict and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
