"""The one YAML config schema (pydantic), its loader and the command-line overrides.

Every field carries a description (a test enforces it) and ``grpo config-reference`` prints them all. An unknown
key is an error that names the key and the file; names of algorithm variants are checked against their
registries when the config is loaded, not when a training step first uses them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the file and the key."""


class StrictModel(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _check_registered(registry_module: str, registry_name: str, value: str) -> str:
    # Imported here because the registries' modules import this one (they take LossConfig as an argument).
    import importlib

    registry = getattr(importlib.import_module(registry_module), registry_name)
    if value not in registry:
        raise ValueError(f"unknown {registry.kind} {value!r}; known: {', '.join(registry.names())}")
    return value


class AdvantageConfig(StrictModel):
    """How rewards become advantages (shared/advantages.py)."""

    estimator: str = Field(
        "grpo",
        description="Advantage estimator: 'grpo' (group baseline) or 'rloo' (leave-one-out baseline).",
    )
    scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide by the group's std ('group', GRPO), the batch's std ('batch'), or not at all "
        "('none', Dr. GRPO).",
    )
    eps: float = Field(1e-4, gt=0, description="Added to the std before dividing, so tiny stds stay finite.")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return _check_registered("shared.advantages", "ADVANTAGE_ESTIMATORS", value)


class LossConfig(StrictModel):
    """The policy loss (shared/losses.py): surrogate, clipping, importance weights, KL and aggregation."""

    policy_loss: str = Field(
        "grpo",
        description="Surrogate: 'grpo' (one importance ratio per token) or 'gspo' (one per sequence, the "
        "geometric mean of its token ratios).",
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="Lower clip range: the ratio is clipped at 1 - eps_low.")
    eps_high: float = Field(
        0.2, gt=0, description="Upper clip range: the ratio is clipped at 1 + eps_high (DAPO's clip-higher: 0.28)."
    )
    dual_clip: float | None = Field(
        None, gt=1, description="Dual-clip constant c > 1: caps a negative-advantage token's loss at -c*A. Off when null."
    )
    beta: float = Field(
        0.04, ge=0, description="Weight of the KL(pi_theta || pi_ref) penalty. 0 disables it and the reference model."
    )
    kl_estimator: str = Field("k3", description="Per-token KL estimator: 'k1', 'k2' or 'k3' (GRPO uses k3).")
    kl_log_ratio_clamp: float | None = Field(
        None, gt=0, description="Clamp log(pi_ref/pi_theta) to [-c, c] before the KL estimator. Off when null."
    )
    kl_value_clamp: float | None = Field(
        None, gt=0, description="Clamp each token's KL estimate to [-v, v]. Off when null."
    )
    tis_cap: float | None = Field(
        2.0,
        gt=0,
        description="Truncated importance sampling: weight each token by min(pi_old/pi_behaviour, cap) when the "
        "old logprobs are recomputed by the trainer and differ from the sampler's. Off when null.",
    )
    aggregation: str = Field(
        "token-mean",
        description="How token losses become one number: 'token-mean' (DAPO), 'seq-mean-token-mean' (original "
        "GRPO) or 'seq-mean-token-sum-norm' (Dr. GRPO, needs norm_len).",
    )
    norm_len: int | None = Field(
        None, ge=1, description="The constant length L of 'seq-mean-token-sum-norm' (use the max completion length)."
    )

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, value: str) -> str:
        return _check_registered("shared.losses", "POLICY_LOSSES", value)

    @field_validator("aggregation")
    @classmethod
    def _known_aggregation(cls, value: str) -> str:
        return _check_registered("shared.losses", "AGGREGATIONS", value)

    @field_validator("kl_estimator")
    @classmethod
    def _known_kl(cls, value: str) -> str:
        return _check_registered("shared.kl", "KL_ESTIMATORS", value)

    @model_validator(mode="after")
    def _norm_len_when_needed(self) -> LossConfig:
        if self.aggregation == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (the max completion length)")
        return self


class AlgorithmConfig(StrictModel):
    """The GRPO algorithm: advantages and loss."""

    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig, description="Advantage estimation.")
    loss: LossConfig = Field(default_factory=LossConfig, description="Policy loss.")


class RefServerConfig(StrictModel):
    """The reference server: reference logprobs, the rollout hub and the weight relay (ref_server/)."""

    model: str | None = Field(
        None, description="Folder of the reference model (any AutoModelForCausalLM). Not loaded when "
        "algorithm.loss.beta is 0; the hub and weight relay work without it.")
    host: str = Field("127.0.0.1", description="Address to bind. Keep 127.0.0.1 unless a token is set.")
    port: int = Field(8470, ge=1, le=65535, description="TCP port; every other process is told this address.")
    token: str | None = Field(
        None, description="Bearer token required on every endpoint except /healthz (or set GRPO_TOKEN). Off when null.")
    device: str = Field("auto", description="'auto' (first visible GPU, else CPU), 'cpu', or 'cuda:N' (N indexes "
                        "the node's visible GPUs).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Reference model dtype; 'auto' is bfloat16 on GPU and float32 on CPU.")
    batch_tokens: int = Field(8192, ge=1, description="Token budget of one scoring micro-batch (padded rows x width).")
    max_request_bytes: int = Field(64 * 2**20, ge=1024, description="Largest request body accepted (413 above).")
    max_request_tokens: int = Field(262144, ge=1, description="Most tokens one logprob request may hold (413 above).")
    queue_capacity: int = Field(256, ge=1, description="Rollout groups the hub holds; uploads get 429 when full.")
    max_staleness: int = Field(
        4, ge=0, description="Drop groups sampled more than this many policy versions before the learner's.")
    spool_dir: str | None = Field(
        "runs/ref_server/spool", description="Where accepted groups are spooled until consumed, so a restart loses "
        "none. Null keeps them in memory only.")
    weights_dir: str = Field("runs/ref_server/weights", description="Where published weight versions are stored.")
    keep_weight_versions: int = Field(2, ge=1, description="How many newest weight versions to keep on disk.")
    max_weight_bytes: int = Field(
        256 * 2**30, ge=1024, description="Largest weights upload accepted (one safetensors file per version).")
    max_long_poll_s: float = Field(30.0, ge=0, description="Longest wait a batch request may ask for.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Server log level.")


class GRPOConfig(StrictModel):
    """The whole run. Services read their own sections; all of them share ``algorithm`` and ``seed``."""

    seed: int = Field(0, description="Base random seed; each service and generator derives its own from it.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The GRPO algorithm.")
    ref_server: RefServerConfig = Field(default_factory=RefServerConfig, description="The reference server.")


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {'.'.join(keys[: depth + 1])} is not a section")
        node = child
    node[keys[-1]] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML: ``1e-4``, ``null``, ``[1, 2]``) in order."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
        _set_path(tree, key.strip(), value)
    return tree


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem, each naming the dotted key: ``algorithm.loss.bta: unknown key``."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "<top level>"
        if error["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            lines.append(f"{key}: {error['msg']}")
    return f"invalid config {source}:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                schema: type[StrictModel] = GRPOConfig) -> StrictModel:
    """Read a YAML file (or start from defaults when ``path`` is None), apply overrides, validate."""
    tree: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {source}: {exc.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {source} is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {source} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded
    apply_overrides(tree, overrides or [])
    try:
        return schema.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def config_reference(schema: type[BaseModel] = GRPOConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(dotted key, default, description)`` for every field, sections first-to-last, recursively."""
    rows: list[tuple[str, str, str]] = []
    for name, field in schema.model_fields.items():
        key = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append((key, "(section)", field.description or ""))
            rows.extend(config_reference(annotation, prefix=f"{key}."))
        else:
            default = field.get_default(call_default_factory=True)
            rows.append((key, json.dumps(default), field.description or ""))
    return rows
