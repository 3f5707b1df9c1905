"""The environment interface of multi-turn rollouts, and how a config names one.

An environment is a class, instantiated once per trajectory with ``generator.environment.args`` as keyword
arguments::

    class Guess:
        stop = ["</guess>"]            # strings that end a model turn (the config's ``stop`` overrides them)

        def reset(self, sample: dict) -> str | None:
            ...                        # text appended after the prompt, or None

        def step(self, model_turn_text: str) -> str | StepResult | None:
            ...                        # the observation, appended as tokens; None: the trajectory is done

``sample`` is the prompt's example: ``{"question": ..., **data}`` (``data`` holds e.g. the reference ``answer``).
``step`` receives the text of the model's latest turn only (decoded with special tokens skipped) and may return a
:class:`StepResult` to add a reward or end the trajectory after an observation. Everything an environment returns
is checked by :mod:`generator.multiturn`: an exception, a call past ``timeout_s``, an observation that is not a
string or is longer than ``max_env_tokens`` fails that trajectory only (counted), never the generator.

Optional class hooks (the built-in ``tools`` environment uses them; generator/environments/tools.py):

* ``check_args(args)``: checks ``generator.environment.args`` at start-up (a UsageError naming the key);
* ``with_tokenizer(tokenizer, args)``: returns the factory of per-trajectory instances, for an environment that
  needs the tokenizer (e.g. its chat template) and prepares shared state once;
* ``chat_tools(args)``: JSON schemas of tools the prompt's chat template shows (``apply_chat_template(tools=)``);
* instance attributes ``tool_calls`` / ``tool_errors`` (ints): summed into the rollouts' metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from shared.config.schema.generator import EnvironmentConfig
from shared.errors import UsageError
from shared.registry import Registry
from shared.user_code import check_keyword_args, load_object


@dataclass
class StepResult:
    """What ``step`` may return instead of a bare observation."""

    observation: str | None = None   # appended as tokens; None: nothing to append
    reward: float | None = None      # added to the trajectory's environment reward
    done: bool = False               # end the trajectory (after appending the observation, if any)


class Environment(Protocol):
    stop: list[str]

    def reset(self, sample: dict[str, Any]) -> str | None: ...

    def step(self, model_turn_text: str) -> str | StepResult | None: ...


# The built-in environments, by the name a config gives (``@ENVIRONMENTS.register("name")`` on the class); the
# modules that define them are imported on the registry's first read. Any other name is user code.
ENVIRONMENTS: Registry = Registry("environment", modules=(
    "generator.environments.calculator",   # calculator
    "generator.environments.guess",        # guess
    "generator.environments.tools",        # tools: chat tool calling
))


def environment_factory(cfg: EnvironmentConfig, key: str = "generator.environment.name"):
    """The class the config names (a built-in name or user code), checked to have ``reset`` and ``step``; a
    UsageError naming ``key`` otherwise. Called once at start-up so that user code that does not load stops the run
    there (an unknown built-in name already failed at config load)."""
    cls = ENVIRONMENTS.get(cfg.name) if cfg.name in ENVIRONMENTS else load_object(cfg.name, key)
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not callable(cls) or missing:
        raise UsageError(f"{key}: {cfg.name} must be a class with reset(sample) and step(model_turn_text) methods"
                         + (f" (missing {', '.join(missing)})" if missing else ""))
    check_args = getattr(cls, "check_args", None)
    if callable(check_args):
        check_args(cfg.args)
    elif not callable(getattr(cls, "with_tokenizer", None)):   # built with args as keywords: check them now
        check_keyword_args(cls, cfg.args, key.rpartition(".")[0] + ".args")
    return cls


def prompt_tools(cfg: EnvironmentConfig | None) -> list[dict] | None:
    """The tool schemas the prompt shows (the environment's ``chat_tools``), or None: no environment, or one
    without tools."""
    if cfg is None:
        return None
    chat_tools = getattr(environment_factory(cfg), "chat_tools", None)
    return chat_tools(cfg.args) if callable(chat_tools) else None


def stop_strings(cfg: EnvironmentConfig, env_class) -> list[str]:
    """The strings that end a model turn: the config's, else the class's ``stop`` attribute (may be empty)."""
    stop = cfg.stop if cfg.stop is not None else getattr(env_class, "stop", []) or []
    stop = [stop] if isinstance(stop, str) else list(stop)   # stop = "</answer>": one string, not its characters
    if not all(isinstance(s, str) and s for s in stop):
        raise UsageError(f"generator.environment.stop: expected non-empty strings, got {stop!r}")
    return stop
