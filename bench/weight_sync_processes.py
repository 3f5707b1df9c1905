"""The processes of bench/weight_sync.py: the model folders it publishes, the generators (``weight_sync.py --role
generator``: a real transformers engine and ``WeightReceiver`` each, reporting when they serve a version) and the hub
(ref server, no reference model), each in its own process as in a run; bench/weight_sync.py measures with them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

WEIGHT_SYNC_SCRIPT = Path(__file__).resolve().with_name("weight_sync.py")  # its --role generator runs run_generator

QWEN_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, vocab_size=128, max_position_embeddings=32768, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)


def build_model_dir(name: str, out: Path, dtype: torch.dtype) -> Path:
    """A model folder with random weights (nothing downloaded) and the demo's character tokenizer; a ``name`` that
    is a folder is used as it is."""
    from deploy.demo.tiny_model import TinyModelSpec, build_char_tokenizer, build_tiny_model, save_model_dir

    if Path(name).is_dir():
        return Path(name)
    tokenizer = build_char_tokenizer()
    if name == "tiny":
        model = build_tiny_model(tokenizer, TinyModelSpec(seed=1))
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE, bos_token_id=tokenizer.bos_token_id,
                                             eos_token_id=tokenizer.eos_token_id,
                                             pad_token_id=tokenizer.pad_token_id))
    return save_model_dir(model.to(dtype), tokenizer, out)


# ------------------------------------------------------------------------------------------- generator process
def run_generator(args: argparse.Namespace) -> None:
    """Sync as fast as a generator between engine calls would, print ``VERSION v wall_time`` per version."""
    from generator.engines.hf import TransformersEngine
    from shared.config.schema import WeightSyncConfig
    from shared.protocol.client import HubClient, RetryPolicy
    from shared.weight_sync.receiver import WeightReceiver

    torch.set_num_threads(1)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    engine = TransformersEngine(args.model_dir, device=args.device, dtype=dtype)
    cfg = WeightSyncConfig(transport=args.transport, bucket_mb=args.bucket_mb, timeout_s=60, join_timeout_s=600,
                           poll_s=0.2)
    client = HubClient(args.url, retry=RetryPolicy(max_retry_s=30))
    receiver = WeightReceiver(engine, client, cfg, args.name, Path(args.work) / f"w-{args.name}")
    have, ready = 0, args.transport == "http"
    if ready:
        print("READY", flush=True)
    while True:
        latest = receiver.sync(have)
        if latest is not None:
            have = latest
            print(f"VERSION {latest} {time.time():.6f} {receiver.last_load_s:.6f}", flush=True)
        if not ready and receiver.connected:
            ready = True
            print("READY", flush=True)
        time.sleep(args.poll_every_s)


class GeneratorProcess:
    def __init__(self, args: argparse.Namespace, url: str, model_dir: Path, transport: str, name: str,
                 device: str) -> None:
        cmd = [sys.executable, str(WEIGHT_SYNC_SCRIPT), "--role", "generator", "--url", url, "--model-dir", str(model_dir),
               "--transport", transport, "--name", name, "--device", device, "--bucket-mb", str(args.bucket_mb),
               "--work", args.work, "--poll-every-s", str(args.poll_every_s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = threading.Event()
        self.served: dict[int, float] = {}
        self.blocked: dict[int, float] = {}   # version -> the generator's time in the receive / load
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            parts = line.split()
            if parts[:1] == ["READY"]:
                self.ready.set()
            elif parts[:1] == ["VERSION"]:
                with self.changed:
                    self.served[int(parts[1])] = float(parts[2])
                    self.blocked[int(parts[1])] = float(parts[3])
                    self.changed.notify_all()

    def wait_version(self, version: int, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while version not in self.served:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"generator never served version {version} (exit {self.proc.poll()})")
                self.changed.wait(0.1)
            return self.served[version]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


class HubProcess:
    """The ref server (hub + relay, no reference model) in its own process, as in a run: its event loop must not
    compete with the learner's threads for this process's GIL."""

    def __init__(self, work: Path) -> None:
        code = ("import sys, time; from tests.live_server import LiveServer, make_config; from pathlib import Path; "
                "live = LiveServer(make_config(Path(sys.argv[1]))).__enter__(); print(live.url, flush=True); "
                "time.sleep(10**6)")
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(work)], stdout=subprocess.PIPE, text=True,
                                     cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)})
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http"):
            raise RuntimeError("the hub did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
