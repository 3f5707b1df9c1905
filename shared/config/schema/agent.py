"""``generator.agent``: a user's agent as the rollout, through the generator's OpenAI-compatible endpoint
(generator/agent/, docs/agents.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from shared.config.schema.base import StrictModel
from shared.config.schema.verifiers import VerifiersConfig


class AgentConfig(StrictModel):
    """An agent that calls an OpenAI-compatible client drives the rollouts: the generator serves
    ``/episodes/{id}/v1/chat/completions`` and ``/v1/completions`` with the policy being trained, records every
    call's tokens (token in, token out) and takes each episode's reward. ``generator.agent: path/to/file.py:fn`` is
    short for ``{fn: path/to/file.py:fn}``."""

    fn: str | None = Field(
        None, description="The agent: 'path/to/file.py:fn' or 'package.module:fn', called as fn(client, example) "
        "-> float (or an async fn) G times per prompt, concurrently, with an openai.OpenAI client pointed at its "
        "episode; its return value is the episode's reward unless it posted one. null: an external process drives "
        "the endpoint, claiming episodes with POST /episodes (docs/agents.md).")
    verifiers: VerifiersConfig | None = Field(
        None, description="A verifiers environment as the agent (generator/agent/verifiers_env.py; "
        "generator.environment: {name: verifiers, args: ...} sets it): its rollout and rubric run each episode. "
        "null: the agent is fn.")
    host: str = Field("127.0.0.1", description="Address the endpoint binds. Keep 127.0.0.1 unless a token is set.")
    port: int = Field(0, ge=0, le=65535, description="Port of the endpoint; 0: any free port (logged; each "
                      "generator of a node gets its own). Set one for an external agent to reach.")
    token: str | None = Field(None, description="Bearer token required on every route but /healthz (the agent's "
                              "client is given it as its api_key); null: none.")
    timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False, description="Wall-clock limit of one episode, from "
                             "its start to its reward; an episode past it expires: it fails (on_error) and is "
                             "counted, and later calls to it get 404.")
    max_turns: int = Field(16, ge=1, description="Most model calls of one episode; one more is answered 400 and "
                           "fails the episode.")
    max_total_tokens: int = Field(1024, ge=1, description="Most completion tokens of one episode (model and "
                                  "other text together, after its first prompt); a call that leaves no room is "
                                  "answered 400 (context_length_exceeded) and ends the episode with 'length'.")
    max_request_bytes: int = Field(2**20, ge=1024, description="Largest request body (413 above).")
    body_timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False, description="Time a request's body may take "
                                  "to arrive (408 after).")
    reward: Literal["agent", "rewards"] = Field(
        "agent", description="'agent': the number the agent returns or posts (POST /episodes/{id}/reward, a number "
        "or step rewards); 'rewards': generator.rewards score the decoded episode.")
    on_error: float = Field(0.0, allow_inf_nan=False, description="Reward of an episode that failed (the agent "
                            "raised or timed out, its conversation diverged from the recorded one, it expired).")

    @property
    def name(self) -> str:
        """What the failure rule calls it (generator/failures.py)."""
        if self.verifiers is not None:
            return f"verifiers environment {self.verifiers.env_id}"
        return f"agent {self.fn}" if self.fn else "external agent"

    @model_validator(mode="after")
    def _one_agent(self) -> AgentConfig:
        if self.fn and self.verifiers is not None:
            raise ValueError(f"generator.agent.fn ({self.fn}) and generator.agent.verifiers are both set: an episode "
                             "is driven by one of them; remove one")
        return self

    @model_validator(mode="before")
    @classmethod
    def _short_form(cls, value: Any) -> Any:
        return {"fn": value} if isinstance(value, str) else value


def agent_conflict(generator: Any) -> str | None:
    """What in the generator section (a GeneratorConfig with ``agent`` set) contradicts the agent, or None."""
    if generator.environment is not None:
        return ("generator.agent and generator.environment are both set: an episode is driven by the agent or by the "
                "environment, not both; remove one")
    if generator.agent.reward == "agent" and "rewards" in generator.model_fields_set and generator.rewards:
        names = [spec.label or spec.name for spec in generator.rewards]
        return (f"generator.rewards lists {names}, but generator.agent.reward is 'agent', which scores episodes by "
                "the agent's reward alone: remove generator.rewards, or set generator.agent.reward: rewards")
    return None
