"""A verifiers environment (PrimeIntellect's library, its classic API ``verifiers.legacy``; tested with verifiers
0.3.1) as the agent of ``generator.agent``: each episode is one ``env.rollout`` against the episode's endpoint,
scored by the environment's rubric, whose reward is the episode's.

The environment is loaded once per process, in the main thread (its constructor installs SIGINT/SIGTERM handlers,
which is refused elsewhere; the generator's own handlers are put back). Its rows are the generator's examples
(``dataset.kind: verifiers``, generator/datasets/verifiers.py) and each example goes back to the rollout as the row
it came from. Episodes run on the runner's threads, each in its own event loop, through verifiers' OpenAI chat
client wrapped around the episode's ``openai.AsyncOpenAI`` client, so every model call is recorded token in/token
out by the endpoint. A rollout that raises, or ends with an error verifiers keeps in ``state["error"]`` (a failed
call, a tool error the environment stops on, its infrastructure), fails its episode only (``on_error``, counted);
one that ends because the model's answer was unusable (empty) is scored by the rubric like any other.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import threading
from typing import Any

from generator.agent.calls import MODEL_NAME
from shared.config.schema.verifiers import VerifiersConfig
from shared.errors import UsageError

KEY = "generator.environment.args"   # where a user writes env_id and env_args (shared/config/schema/verifiers.py)
INSTALL = "pip install 'grpo-stack[verifiers]' (verifiers==0.3.1)"
# rollout input keys the generator's examples add to a verifiers row (generator/datasets/base.py)
OWN_KEYS = ("prompt_messages",)


def verifiers_legacy():
    """``verifiers.legacy`` (``import verifiers as vf``'s classic API); a UsageError saying what to install."""
    try:
        import verifiers.legacy as vf
    except ImportError as exc:
        raise UsageError(f"{KEY}: a verifiers environment needs the verifiers package: {INSTALL} ({exc})") from None
    return vf


def load_environment(cfg: VerifiersConfig):
    """The environment ``cfg`` names, loaded once per process (same env_id and env_args: the same object)."""
    return _load(cfg.env_id, json.dumps(cfg.env_args, sort_keys=True, default=str))


@functools.cache
def _load(env_id: str, env_args_json: str):
    vf = verifiers_legacy()
    from verifiers.legacy.utils.env_utils import env_module_name

    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("a verifiers environment is loaded in the main thread (it installs signal handlers)")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    quiet = logging.getLogger("verifiers.legacy.utils.env_utils")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)   # its errors are the UsageErrors below, said once
    try:
        env = vf.load_environment(env_id, **json.loads(env_args_json))
    except ValueError as exc:   # verifiers' "Could not import ..." (an ImportError inside)
        cause = exc.__cause__ or exc
        raise UsageError(f"{KEY}.env_id: cannot import the module {env_module_name(env_id)!r} of verifiers "
                         f"environment {env_id!r} ({type(cause).__name__}: {cause}); install the environment's "
                         "package (e.g. `prime env install OWNER/NAME` or pip install it)") from None
    except Exception as exc:   # noqa: BLE001 - the environment's own load_environment failed: named, not a traceback
        cause = exc.__cause__ or exc
        raise UsageError(f"{KEY}: verifiers environment {env_id!r} did not load with env_args {env_args_json} "
                         f"({type(cause).__name__}: {cause})") from None
    finally:
        quiet.setLevel(level)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return checked(vf, env, env_id)


def checked(vf, env, env_id: str):
    """``env`` when this adapter can run it; a UsageError naming what it cannot."""
    if not isinstance(env, vf.Environment):
        raise UsageError(f"{KEY}.env_id: {env_id}'s load_environment returned {type(env).__name__}, not a verifiers "
                         "Environment")
    if env.message_type != "chat":
        raise UsageError(f"{KEY}.env_id: {env_id} is a '{env.message_type}' environment; only chat environments run "
                         "through the endpoint")
    if env.requires_group_rollouts or env.provides_advantages:
        raise UsageError(f"{KEY}.env_id: {env_id}'s rubric scores whole groups (group reward functions or "
                         "advantages), which episodes scored one by one cannot give")
    return env


def rollout_input(example: dict[str, Any]) -> dict[str, Any]:
    """The verifiers rollout input of an example: its row as the environment gave it (the example's own keys
    dropped); an example from another dataset kind gets its prompt messages (or its question as the user message)
    as ``prompt`` and example_id 0 (its other fields, ``answer`` among them, go as they are)."""
    row = {k: v for k, v in example.items() if k not in OWN_KEYS}
    if not isinstance(row.get("prompt"), list):
        messages = example.get("prompt_messages") or [{"role": "user", "content": example["question"]}]
        row["prompt"] = messages
    row.setdefault("example_id", 0)
    return row


class VerifiersAgent:
    """``episode(client, example)``: the agent function of the runner (generator/agent/runner.py)."""

    def __init__(self, cfg: VerifiersConfig) -> None:
        self.env = load_environment(cfg)
        self.sampling_args = {k: v for k, v in self.env.sampling_args.items() if v not in (None, {})}
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        self.client_type = OpenAIChatCompletionsClient
        # what the model answered is unusable (empty: no text, no tool call): the rollout ends and the rubric scores
        # it, as verifiers does; the policy wrote it, so it is trained on, not counted as the environment failing
        self.model_fault = verifiers_legacy().InvalidModelResponseError

    async def episode(self, client, example: dict[str, Any]) -> float:
        """One rollout against the episode's endpoint, scored by the rubric: its reward."""
        env = self.env
        state = await env.rollout(rollout_input(example), self.client_type(client), MODEL_NAME,
                                  dict(self.sampling_args))
        error = state.get("error")
        if error is not None and not isinstance(error, self.model_fault):
            cause = f" (caused by {error.__cause__!r})" if error.__cause__ is not None else ""
            raise RuntimeError(f"the verifiers rollout ended with {type(error).__name__}: {error}{cause}")
        try:
            if env.score_rollouts:
                await env.rubric.score_rollout(state)
            else:
                await env.rubric.dummy_score_rollout(state)
        finally:
            await env.rubric.cleanup(state)
        return float(state["reward"])


def verifiers_agent(cfg: VerifiersConfig):
    """The runner's agent function for a verifiers environment (an async fn: the runner gives it an AsyncOpenAI)."""
    return VerifiersAgent(cfg).episode


def verifiers_problems(generator) -> list[str]:
    """What ``grpo check-config`` says about the verifiers environment of a generator section (its agent has one):
    the package missing, the env_id not importable, its load_environment failing, an environment this adapter cannot
    run. Nothing when the dataset is that environment's rows: the dataset's check loads it and says it once."""
    cfg = generator.agent.verifiers
    if generator.dataset.kind == "verifiers" and generator.dataset.verifiers == cfg:
        return []
    try:
        load_environment(cfg)
    except UsageError as exc:
        return [str(exc)]
    return []
