"""Checks run before anything starts: every mistake a config can hold that would otherwise show up only after three
services started (or after ~50 s of model-hub retries), reported together, one line each, exit code 2.

* ``grpo check-config`` and the top of ``grpo run`` (:data:`CONFIG_CHECKS`, plus :data:`RUN_CHECKS` for a run):
  the model folders, the dataset (readable, with the fields the task and the rewards need), the rewards (built as
  the generator builds them: a python reward's file or module imported and its signature checked against its
  documented contract), a reference model when the KL penalty needs one, and, for ``grpo run``, the hub's port
  and cores (``ref_server.cpu_cores``; ``grpo ref-server`` checks both too).
* ``grpo learner``, ``grpo generator``, ``grpo eval``, ``grpo ref-server`` and ``grpo scorer``: their model
  folder (:func:`require_models`; the ref server's only when it names one); the generator and ``grpo eval`` build
  their rewards and prompts before any model loads anyway.

A model is a folder with a readable ``config.json`` naming its ``model_type``. A name that is not a folder and
looks like a Hugging Face Hub id (``org/name``) is looked up in the local cache, then (unless ``HF_HUB_OFFLINE`` or
``TRANSFORMERS_OFFLINE`` is set) with one request to the Hub of at most :data:`HUB_TIMEOUT_S`, never with retries.
Every check is meant to take well under 5 s; :func:`run_checks` times each one.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shared.config.schema import GRPOConfig
from shared.errors import UsageError

__all__ = ["CONFIG_CHECKS", "RUN_CHECKS", "PreflightError", "PreflightReport", "dataset_problems",
           "environment_problems", "model_problem", "reference_problems", "require", "require_models",
           "reward_problems", "run_checks"]

HUB_TIMEOUT_S = 3.0
# org/name, as the Hub spells ids; anything else that does not exist is a missing local folder
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}


class PreflightError(UsageError):
    """One or more problems found before anything started; the message lists them, one line each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        if len(problems) == 1:
            message = problems[0]
        else:
            message = f"{len(problems)} problems, found before starting anything:\n" + "\n".join(
                f"  - {p}" for p in problems)
        super().__init__(message)


# -- models -----------------------------------------------------------------------------------------------------
def hub_offline() -> bool:
    """Whether the environment forbids model-hub access (what huggingface_hub and transformers read)."""
    return any(os.environ.get(name, "").upper() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` whose ``org`` is not a folder here: ``runs/tiny-model`` with a ``runs/`` folder is a local
    path that is missing, not a Hub id."""
    return bool(_HUB_ID.match(name)) and ".." not in name and not Path(name.split("/")[0]).is_dir()


def _hub_problem(name: str, key: str) -> str | None:
    """None when the Hub id ``name`` is in the local cache or (online) on the Hub; else why not, in one line."""
    reason = _hub_lookup(name, hub_offline())
    return None if reason is None else f"{key}: no model folder {name!r}, and {reason}"


@functools.lru_cache(maxsize=32)
def _hub_lookup(name: str, offline: bool) -> str | None:
    """Why the Hub id ``name`` cannot be had, or None; one request at most per name and process (a run's learner,
    generator and reference model are usually one id)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except ValueError:  # not a valid repo id after all
        return "it is not a valid Hugging Face Hub id either"
    if offline:
        return (f"{name!r} is not in the local Hugging Face cache (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set, so "
                "nothing is downloaded)")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403, 404):
            return f"no model {name!r} on the Hugging Face Hub ({status})"
        return f"the Hugging Face Hub answered {status} for it"
    except Exception as exc:  # noqa: BLE001 - network libraries raise many kinds; any means "cannot fetch it"
        return (f"the Hugging Face Hub could not be reached to download it ({type(exc).__name__}); build or fetch "
                "the model into a folder, or set HF_HUB_OFFLINE=1 with a cached copy")
    return None


def model_problem(path: str | None, key: str) -> str | None:
    """Why ``path`` (the value of config key ``key``) cannot be loaded as a model, in one line; None when it can."""
    if path is None:
        return f"{key} is not set: name the model folder (or a Hugging Face Hub id)"
    folder = Path(path).expanduser()
    if not folder.exists():
        if looks_like_hub_id(path):
            return _hub_problem(path, key)
        return (f"{key}: no model folder {path} (from {Path.cwd()}); build one with `grpo tiny-model --out {path}` "
                "or `grpo fetch-model`, or fix the path")
    if not folder.is_dir():
        return f"{key}: {path} is a file, not a model folder"
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        return f"{key}: {path} has no config.json, so it is not a Hugging Face model folder"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{key}: cannot read {config_file}: {exc}"
    if not isinstance(config, dict) or not config.get("model_type"):
        return f"{key}: {config_file} names no model_type, so transformers cannot load it"
    return None


def model_roles(config: GRPOConfig) -> dict[str, str | None]:
    """Config key -> model path, for every model a run loads."""
    models = {"generator.model": config.generator.model, "learner.model": config.learner.model}
    if config.algorithm.needs_reference and config.ref_server.model is not None:
        models["ref_server.model"] = config.ref_server.model
    for key in ("prm_model", "teacher_model"):
        if getattr(config.ref_server, key) is not None:
            models[f"ref_server.{key}"] = getattr(config.ref_server, key)
    return models


def model_problems(config: GRPOConfig) -> list[str]:
    return [p for key, path in model_roles(config).items() if (p := model_problem(path, key))]


def require_models(models: dict[str, str | None]) -> None:
    """A :class:`PreflightError` listing every model (config key or flag -> path) that cannot be loaded."""
    problems = [p for key, path in models.items() if (p := model_problem(path, key))]
    if problems:
        raise PreflightError(problems)


# -- the KL penalty needs a reference model -----------------------------------------------------------------------
def reference_problems(config: GRPOConfig) -> list[str]:
    algorithm = config.algorithm
    if not config.hub_scores_reference or config.ref_server.model is not None:
        return []
    why = ("algorithm.kl.in_reward is true" if algorithm.kl.in_reward
           else f"algorithm.loss.beta is {algorithm.loss.beta} (> 0)")
    return [f"ref_server.model is not set, but {why}: the KL penalty needs a reference model; set ref_server.model "
            "(usually the learner's starting model) or algorithm.loss.beta: 0"]


# -- rewards ------------------------------------------------------------------------------------------------------
def reward_problems(config: GRPOConfig) -> list[str]:
    """Every reward built as the generator builds it (a python reward's code imported, its signature checked)."""
    from generator.rewards import RewardSet

    problems = []
    for i, spec in enumerate(config.generator.rewards):
        try:
            RewardSet.build_term(spec, i)
        except UsageError as exc:
            problems.append(str(exc))
    return problems


# -- a multi-turn environment ------------------------------------------------------------------------------------
def environment_problems(config: GRPOConfig) -> list[str]:
    """The environment class (and, for tool calling, every tool function and its schema) loads as the generator
    loads it; a prompt format template cannot show a tool-calling environment's tools."""
    env = config.generator.environment
    if env is None:
        return agent_problems(config)
    from generator.environments.base import prompt_tools

    try:
        tools = prompt_tools(env)
    except UsageError as exc:
        return [str(exc)]
    if tools and config.generator.dataset.template is not None:
        return ["generator.dataset.template: tool calling renders the prompt with the chat template (and its tools); "
                "set it to null"]
    return []


def agent_problems(config: GRPOConfig) -> list[str]:
    """generator.agent: the openai client installed (the 'agent' extra) and the agent function loads."""
    agent = config.generator.agent
    if agent is None:
        return []
    try:
        import openai  # noqa: F401 - only whether it is installed
    except ImportError:
        return ["generator.agent needs the openai package: pip install 'grpo-stack[agent]'"]
    if agent.verifiers is not None:
        from generator.agent.verifiers_env import verifiers_problems

        return verifiers_problems(config.generator)
    if not agent.fn:
        return []
    from generator.agent.runner import load_agent

    try:
        load_agent(agent.fn)
    except UsageError as exc:
        return [str(exc)]
    return []


# -- the dataset --------------------------------------------------------------------------------------------------
def _factory_default(reward: str, arg: str) -> str:
    from generator.rewards import REWARDS

    return inspect.signature(REWARDS.get(reward)).parameters[arg].default


# reward -> its argument naming the example field it reads (the field's default name is the argument's default)
REWARD_FIELDS = {"arithmetic": "answer_field", "math": "answer_field", "final_number": "answer_field",
                 "code": "tests_field", "chain": "answer_field", "chain_steps": "answer_field"}


def fields_needed(config: GRPOConfig) -> dict[str, str]:
    """Example field -> the reward that reads it (its config key), beyond the question and answer fields the loader
    itself requires (it copies ``answer_field`` to ``answer``, where the rewards read it by default)."""
    needed: dict[str, str] = {}
    for i, spec in enumerate(config.generator.rewards):
        arg = REWARD_FIELDS.get(spec.name)
        if arg is not None:
            name = spec.args.get(arg, _factory_default(spec.name, arg))
            needed.setdefault(name, f"generator.rewards[{i}] ({spec.name}, args.{arg})")
    return needed


def dataset_problems(config: GRPOConfig) -> list[str]:
    """The dataset loaded as the generator loads it (a JSONL file read whole; a Hugging Face dataset from a file or
    folder, or from the local cache: datasets are read offline), then every example checked for the fields the
    rewards read; and ``eval.path``, when it names a local file, checked to exist."""
    from generator.datasets import load_examples

    dataset = config.generator.dataset
    missing_eval = eval_path_problem(config)
    try:
        examples = load_examples(dataset, config.seed)
    except UsageError as exc:
        return [f"generator.dataset: {exc}", *missing_eval]
    except (TypeError, ValueError) as exc:  # a built-in task's settings (generator.dataset.arithmetic / chain)
        return [f"generator.dataset ({dataset.kind}): {exc}"]
    missing_eval += reasoning_gym_items_problems(config, examples)
    if dataset.kind not in ("jsonl", "hf"):
        return missing_eval  # the built-in tasks give every field their rewards read
    problems = list(missing_eval)
    for name, who in fields_needed(config).items():
        missing = next((e for e in examples if name not in e.data), None)
        if missing is not None:
            problems.append(f"generator.dataset: {missing.example_id}: no {name!r} field, which {who} needs "
                            f"(fields: {sorted(missing.data)})")
    return problems


def reasoning_gym_items_problems(config: GRPOConfig, examples: list) -> list[str]:
    """The ``reasoning_gym`` reward scores reasoning-gym items only (an answer and metadata naming the task: kind
    reasoning_gym, or rows exported from reasoning-gym): any other example is named."""
    i = next((i for i, spec in enumerate(config.generator.rewards) if spec.name == "reasoning_gym"), None)
    if i is None:
        return []
    from generator.rewards.reasoning_gym_reward import reasoning_gym_entry

    for example in examples:
        try:
            reasoning_gym_entry(example.question, example.data)
        except ValueError as exc:
            return [f"generator.rewards[{i}] (reasoning_gym): {example.example_id}: {exc}"]
    return []


def eval_path_problem(config: GRPOConfig) -> list[str]:
    """``eval.path`` missing where it is meant as a local path: a dataset name is looked up in the cache by
    ``grpo eval`` itself."""
    from generator.datasets import looks_local

    path = config.eval.path
    if path is None or Path(path).expanduser().exists():
        return []
    if looks_local(path):
        return [f"eval.path: no file or folder {path} (from {Path.cwd()})"]
    return []


# -- the hub's port and cores ---------------------------------------------------------------------------------------
def port_problems(config: GRPOConfig) -> list[str]:
    from shared.ports import port_problem, token_problem

    cfg = config.ref_server
    problems = [port_problem(cfg.host, cfg.port, "ref_server.port"),
                token_problem(cfg.host, cfg.resolved_token())]
    return [p for p in problems if p]


def cpu_core_problems(config: GRPOConfig) -> list[str]:
    """ref_server.cpu_cores lists only cores this process (and so the ref server it starts) may run on."""
    from ref_server.cpu_cores import cpu_cores_problem

    problem = cpu_cores_problem(config.ref_server.cpu_cores)
    return [problem] if problem else []


# -- running them -------------------------------------------------------------------------------------------------
Check = Callable[[GRPOConfig], list[str]]
CONFIG_CHECKS: dict[str, Check] = {"models": model_problems, "reference": reference_problems,
                                   "dataset": dataset_problems, "rewards": reward_problems,
                                   "environment": environment_problems}
RUN_CHECKS: dict[str, Check] = {**CONFIG_CHECKS, "port": port_problems, "cpu_cores": cpu_core_problems}


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)   # check name -> how long it took


def run_checks(config: GRPOConfig, checks: dict[str, Check]) -> PreflightReport:
    """Every check, each timed; problems in check order."""
    report = PreflightReport()
    for name, check in checks.items():
        started = time.perf_counter()
        report.problems.extend(check(config))
        report.seconds[name] = time.perf_counter() - started
    return report


def require(config: GRPOConfig, checks: Iterable[str] | dict[str, Check] = CONFIG_CHECKS) -> PreflightReport:
    """Run ``checks`` (names in :data:`RUN_CHECKS`, or a dict of them); a :class:`PreflightError` with every
    problem found."""
    selected = checks if isinstance(checks, dict) else {name: RUN_CHECKS[name] for name in checks}
    report = run_checks(config, selected)
    if report.problems:
        raise PreflightError(report.problems)
    return report
