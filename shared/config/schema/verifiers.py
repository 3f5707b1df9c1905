"""A verifiers environment (PrimeIntellect's library, its classic API) as the rollout: ``generator.environment:
{name: verifiers, args: {env_id, env_args}}`` is short for ``generator.agent: {verifiers: {env_id, env_args}}`` (its
episodes run through the agent endpoint, generator/agent/verifiers_env.py) with ``generator.dataset.kind:
verifiers`` (the environment's own rows) unless a dataset kind is given. docs/agents.md."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from shared.config.schema.base import StrictModel

NAME = "verifiers"
# generator.environment keys that carry over to generator.agent (the same meaning there)
AGENT_KEYS = ("max_turns", "max_total_tokens", "on_error")
# generator.environment keys of the reset/step interface, which a verifiers environment does not run through
NOT_APPLICABLE = {"max_turn_tokens": "generator.sampling.max_tokens", "max_env_tokens": None, "stop": None,
                  "timeout_s": "generator.agent.timeout_s (a whole episode's limit)"}


class VerifiersConfig(StrictModel):
    """The environment ``verifiers.load_environment(env_id, **env_args)`` returns."""

    env_id: str = Field(min_length=1, description="The environment, as verifiers names it: the module of an "
                        "installed environment package ('OWNER/vf-gsm8k' imports vf_gsm8k) or any importable module "
                        "with load_environment().")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment's "
                                     "load_environment().")


def environment_as_agent(generator: Any) -> Any:
    """The raw generator section with ``environment: {name: verifiers, ...}`` rewritten as ``agent: {verifiers: ...}``
    and, when no dataset kind is given, ``dataset.kind: verifiers`` of that environment; any other section unchanged.
    A key that has no meaning for a verifiers environment is a ValueError naming it."""
    if not isinstance(generator, dict):
        return generator
    environment = generator.get("environment")
    if isinstance(environment, dict) and environment.get("name") == NAME:
        generator = {**generator, "environment": None, "agent": _agent(environment, generator.get("agent"))}
    agent = _fields(generator.get("agent"))
    if not isinstance(agent, dict) or agent.get(NAME) is None:
        return generator
    dataset = _fields(generator.get("dataset"))
    dataset = dict(dataset) if isinstance(dataset, dict) else {}
    dataset.setdefault("kind", NAME)
    if dataset["kind"] == NAME:
        dataset.setdefault(NAME, agent[NAME])
    return {**generator, "dataset": dataset}


def _fields(section: Any) -> Any:
    """A section given as a config object (the Python API) as the keys it was given; anything else as it is."""
    return section.model_dump(exclude_unset=True) if isinstance(section, BaseModel) else section


def _agent(environment: dict, agent: Any) -> dict:
    for key, instead in NOT_APPLICABLE.items():
        if key in environment:
            raise ValueError(f"generator.environment.{key} does not apply to a verifiers environment (its episodes "
                             "run through the agent endpoint)" + (f": use {instead}" if instead else ""))
    agent = _fields(agent)
    if agent is not None and not isinstance(agent, dict):
        raise ValueError("generator.environment (verifiers) and generator.agent are both set: a verifiers "
                         "environment is the agent; generator.agent may only hold its endpoint settings (a mapping)")
    agent = dict(agent or {})
    if agent.get("fn"):
        raise ValueError(f"generator.environment (verifiers) and generator.agent.fn ({agent['fn']}) are both set: "
                         "an episode is driven by one of them; remove one")
    args = environment.get("args")
    if not isinstance(args, dict) or not args.get("env_id"):
        raise ValueError("generator.environment.args.env_id is required with name verifiers: the environment to "
                         "load, e.g. {env_id: vf-gsm8k, env_args: {}}")
    agent[NAME] = args
    agent.update({key: environment[key] for key in AGENT_KEYS if key in environment})
    if "reward" in environment:   # 'environment': the rubric's reward; 'rewards': generator.rewards
        agent["reward"] = "agent" if environment["reward"] == "environment" else environment["reward"]
    return agent
