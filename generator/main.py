"""``grpo generator``: build the engine, prompts and rewards from config and run the rollout loop."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading

import torch

from generator.curriculum import curriculum_stream
from generator.datasets import PromptStream, load_examples, system_prompt_for
from generator.loop import RolloutLoop
from generator.progress import Progress
from generator.rewards import RewardSet
from generator.stats import LoopStats
from shared.config.schema import GRPOConfig
from shared.devices import default_dtype, resolve_device
from shared.errors import UsageError
from shared.progress import startup_phase
from shared.protocol.client import HubClient, service_client, stop_on_signals
from shared.protocol.records import SamplingParams
from shared.weight_sync.receiver import WeightReceiver

log = logging.getLogger("grpo.generator")


class GeneratorSetupError(UsageError):
    """The generator cannot start (no model, unknown engine...); the message says which setting."""


def resolve_engine_name(requested: str) -> str:
    if requested != "auto":
        return requested
    try:
        import vllm  # noqa: F401
    except ImportError:
        return "transformers"
    return "vllm" if torch.cuda.is_available() or os.environ.get("GRPO_VLLM_ON_CPU") == "1" else "transformers"


def build_engine(config: GRPOConfig):
    cfg = config.generator
    if cfg.model is None:
        raise GeneratorSetupError("generator.model is not set (pass --model or set it in the config)")
    name = resolve_engine_name(cfg.engine)
    if name == "vllm":
        from generator.engines.vllm_engine import VLLMEngine
        from generator.engines.vllm_lora import lora_serving

        try:
            lora = lora_serving(config)  # vLLM enables LoRA only at start: learner.lora of the same config says so
        except ValueError as exc:
            raise GeneratorSetupError(str(exc)) from None
        return VLLMEngine(cfg.model, tensor_parallel_size=cfg.tensor_parallel_size,
                          gpu_memory_utilization=cfg.gpu_memory_utilization, max_model_len=cfg.max_model_len,
                          device=cfg.device, seed=config.seed, lora=lora, dtype=cfg.dtype)
    from generator.engines.hf import TransformersEngine

    device = resolve_device(cfg.device)
    return TransformersEngine(cfg.model, device=str(device), dtype=default_dtype(cfg.dtype, device))


def check_environment(config: GRPOConfig) -> None:
    """Multi-turn: the environment class loads (a UsageError naming the key otherwise), before any model is loaded.
    Both engines support it (``generate_turns``)."""
    cfg = config.generator
    if cfg.agent is not None and cfg.agent.fn:
        from generator.agent.runner import load_agent

        load_agent(cfg.agent.fn)
    if cfg.agent is not None and cfg.agent.verifiers is not None:
        from generator.agent.verifiers_env import load_environment

        load_environment(cfg.agent.verifiers)   # in the main thread (it installs signal handlers), once
    if cfg.environment is None:
        return
    from generator.environments.base import environment_factory

    environment_factory(cfg.environment)


def build_loop(config: GRPOConfig, engine, client: HubClient, progress: Progress, rewards: RewardSet,
               examples: list) -> RolloutLoop:
    cfg = config.generator
    from transformers import AutoTokenizer

    tokenizer = getattr(engine, "tokenizer", None) or AutoTokenizer.from_pretrained(cfg.model)
    generator_id = cfg.id or f"{socket.gethostname()}-{os.getpid()}"
    return RolloutLoop(
        engine=engine, tokenizer=tokenizer, client=client, rewards=rewards,
        prompts=curriculum_stream(PromptStream(examples, seed=config.seed, generator_id=generator_id),
                                  cfg.curriculum, config.seed, client),
        sampling=SamplingParams(**cfg.sampling.model_dump()), group_size=cfg.group_size,
        prompts_per_batch=cfg.prompts_per_batch, generator_id=generator_id, weights_dir=cfg.weights_dir,
        system_prompt=system_prompt_for(cfg.dataset), template=cfg.dataset.template,
        drop_constant_groups=cfg.drop_constant_groups, seed=config.seed, progress=progress,
        wait_for_budget=cfg.wait_for_budget, step_rewards=cfg.step_rewards, environment=cfg.environment,
        max_refused_in_a_row=cfg.max_refused_in_a_row, failures=cfg.failures)


def start_agent(config: GRPOConfig, engine, loop: RolloutLoop):
    """``generator.agent``: the endpoint started and its episodes made the loop's rollouts; None without one."""
    cfg = config.generator
    if cfg.agent is None:
        return None
    if not hasattr(engine, "generate_turns"):
        raise GeneratorSetupError(f"generator.agent: the {engine.name} engine cannot sample turns")
    from generator.agent.journal import journal_dir
    from generator.agent.runner import AgentRollouts

    rollouts = AgentRollouts(engine, loop.tokenizer, cfg.agent, loop.sampling, seed=config.seed,
                             journal_dir=journal_dir(cfg.weights_dir))
    loop.use_agent(rollouts, cfg.agent)
    return rollouts


def continuous_rollouts(loop: RolloutLoop, engine, config: GRPOConfig):
    """``generator.schedule.mode: continuous``: the engine kept full (generator/continuous/)."""
    from generator.continuous.engines import continuous_engine
    from generator.continuous.schedule import ContinuousRollouts

    cfg = config.generator
    schedule = cfg.schedule
    if schedule.on_weights == "keep" and engine.name != "transformers":
        raise GeneratorSetupError(f"generator.schedule.on_weights: keep runs on the transformers engine only; the "
                                  f"{engine.name} engine recomputes unfinished prefixes at a switch (set "
                                  "generator.schedule.on_weights: recompute)")
    max_in_flight = schedule.max_in_flight or cfg.prompts_per_batch * cfg.group_size
    return ContinuousRollouts(loop, continuous_engine(engine, max_in_flight), max_in_flight=max_in_flight,
                              upload_interval_s=schedule.upload_interval_s,
                              check_interval_s=schedule.check_interval_s,
                              recompute=schedule.on_weights == "recompute",
                              max_switch_share=schedule.max_switch_share)


def run_generator(config: GRPOConfig, stop: threading.Event | None = None) -> LoopStats:
    """Run until ``max_groups`` are uploaded or a stop is requested (SIGINT/SIGTERM in the main thread)."""
    stop = stop or threading.Event()
    if config.generator.weights_dir is None:  # no run folder: downloaded weights go to a folder removed at exit
        with tempfile.TemporaryDirectory(prefix="grpo-generator-weights-") as scratch:
            config = config.model_copy(deep=True)
            config.generator.weights_dir = scratch
            return run_generator(config, stop)
    cfg = config.generator
    # Rewards and prompts first: a config mistake there should not wait for a model to load.
    rewards = RewardSet.from_specs(cfg.rewards, config.learner.max_steps)
    examples = load_examples(cfg.dataset, config.seed)
    check_environment(config)
    client = service_client(cfg.hub_url, config.ref_server.token, cfg.retry_max_s)
    stop_on_signals(stop, client, "finishing the current upload, then exiting")
    startup_phase(log, f"loading the model {cfg.model} (engine {cfg.engine})")
    engine = build_engine(config)
    try:
        loop = build_loop(config, engine, client, Progress(total=cfg.max_groups), rewards, examples)
        agent = start_agent(config, engine, loop)
        loop.receiver = WeightReceiver(engine, client, config.weight_sync, loop.generator_id, cfg.weights_dir,
                                       stats=loop.stats)
        log.info("generator %s: engine %s, G=%d, %d prompts per batch, hub %s", loop.generator_id, engine.name,
                 cfg.group_size, cfg.prompts_per_batch, cfg.hub_url)
        startup_phase(log, "generating the first groups")
        try:
            if cfg.schedule.mode == "continuous":
                return continuous_rollouts(loop, engine, config).run(stop, max_groups=cfg.max_groups)
            return loop.run(stop, max_groups=cfg.max_groups)
        finally:
            loop.receiver.close()
            if agent is not None:
                agent.close()
    finally:
        engine.close()
        client.close()
