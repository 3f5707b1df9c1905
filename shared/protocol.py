"""Typed messages that cross a process boundary, and their safetensors encoding (:mod:`shared.wire`).

One meaning per field. Ragged per-sample data travels as right-padded ``[N, L]`` tensors plus an explicit
lengths tensor; padding values carry no meaning and masks always come from the lengths.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field

import torch

from shared.advantages import compute_advantages, process_advantages
from shared.wire import WireError, decode, encode

FINISH_REASONS = ("stop", "length")


class ProtocolError(ValueError):
    """A message whose fields are inconsistent (wrong shapes, lengths out of range, unknown values)."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings; the ref server and learner must use the same temperature (and top-p/top-k)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    max_tokens: int = 64


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ProtocolError(message)


def _check_ragged(name: str, values: torch.Tensor, lengths: torch.Tensor, rows: int) -> None:
    _require(values.dim() == 2 and values.shape[0] == rows, f"{name} must be [{rows}, L], got {tuple(values.shape)}")
    _require(lengths.shape == (rows,), f"{name} lengths must be [{rows}]")
    if rows:
        _require(int(lengths.min()) >= 0, f"{name}: negative length")
        _require(int(lengths.max()) <= values.shape[1], f"{name}: a length exceeds the tensor width")


@dataclass
class RolloutGroup:
    """G completions of one prompt, as a generator uploads them to the hub."""

    prompt_ids: torch.Tensor            # [P] int64, the prompt's token ids
    completion_ids: torch.Tensor        # [G, L] int64, right-padded
    completion_lengths: torch.Tensor    # [G] int64, valid tokens per completion (EOS included when emitted)
    behaviour_logprobs: torch.Tensor    # [G, L] float32, sampler's logprob of each sampled token
    rewards: torch.Tensor               # [G] float32, total (weighted) reward per completion
    finish_reasons: list[str]           # G entries, "stop" (EOS or stop string) or "length" (cut at max_tokens)
    policy_version: int                 # weights version that sampled this group
    generator_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # reward name -> [G] unweighted
    step_rewards: torch.Tensor | None = None   # [G, S] process rewards, or None
    step_ends: torch.Tensor | None = None      # [G, S] completion-token index where each step ends
    num_steps: torch.Tensor | None = None      # [G] valid steps per completion
    task: dict[str, str] = field(default_factory=dict)  # task metadata, e.g. {"answer": "82"}
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def group_size(self) -> int:
        return int(self.completion_ids.shape[0])

    def validate(self, vocab_size: int | None = None) -> RolloutGroup:
        g = self.group_size
        _require(self.prompt_ids.dim() == 1 and self.prompt_ids.numel() >= 1, "prompt_ids must be a non-empty [P]")
        _require(g >= 1, "a group needs at least one completion")
        _check_ragged("completion_ids", self.completion_ids, self.completion_lengths, g)
        _require(self.behaviour_logprobs.shape == self.completion_ids.shape,
                 "behaviour_logprobs must have the shape of completion_ids")
        _require(self.rewards.shape == (g,), f"rewards must be [{g}]")
        _require(bool(torch.isfinite(self.rewards).all()), "rewards must be finite")
        _require(len(self.finish_reasons) == g and all(r in FINISH_REASONS for r in self.finish_reasons),
                 f"finish_reasons must be {g} values out of {FINISH_REASONS}")
        _require(self.policy_version >= 0, "policy_version must be >= 0")
        for name, values in self.reward_components.items():
            _require(values.shape == (g,), f"reward component {name!r} must be [{g}]")
        if vocab_size is not None:
            for name, ids in (("prompt_ids", self.prompt_ids), ("completion_ids", self.completion_ids)):
                if ids.numel():
                    _require(int(ids.min()) >= 0 and int(ids.max()) < vocab_size,
                             f"{name}: token ids must be in [0, {vocab_size})")
        has_steps = [t is not None for t in (self.step_rewards, self.step_ends, self.num_steps)]
        _require(all(has_steps) or not any(has_steps), "step_rewards, step_ends and num_steps come together")
        return self

    def to_bytes(self) -> bytes:
        tensors = {
            "prompt_ids": self.prompt_ids.long(), "completion_ids": self.completion_ids.long(),
            "completion_lengths": self.completion_lengths.long(),
            "behaviour_logprobs": self.behaviour_logprobs.float(), "rewards": self.rewards.float(),
        }
        tensors.update({f"reward/{name}": v.float() for name, v in self.reward_components.items()})
        if self.step_rewards is not None:
            tensors.update(step_rewards=self.step_rewards.float(), step_ends=self.step_ends.long(),
                           num_steps=self.num_steps.long())
        fields = dict(finish_reasons=self.finish_reasons, policy_version=self.policy_version,
                      generator_id=self.generator_id, sampling=asdict(self.sampling), task=self.task,
                      group_id=self.group_id)
        return encode("rollout_group/v1", tensors, fields)

    @classmethod
    def from_bytes(cls, data: bytes) -> RolloutGroup:
        tensors, fields = decode(data, "rollout_group/v1")
        try:
            group = cls(
                prompt_ids=tensors.pop("prompt_ids"), completion_ids=tensors.pop("completion_ids"),
                completion_lengths=tensors.pop("completion_lengths"),
                behaviour_logprobs=tensors.pop("behaviour_logprobs"), rewards=tensors.pop("rewards"),
                step_rewards=tensors.pop("step_rewards", None), step_ends=tensors.pop("step_ends", None),
                num_steps=tensors.pop("num_steps", None),
                reward_components={k.removeprefix("reward/"): tensors.pop(k) for k in list(tensors)
                                   if k.startswith("reward/")},
                finish_reasons=list(fields["finish_reasons"]), policy_version=int(fields["policy_version"]),
                generator_id=str(fields["generator_id"]), sampling=SamplingParams(**fields["sampling"]),
                task={str(k): str(v) for k, v in fields.get("task", {}).items()},
                group_id=str(fields["group_id"]),
            )
        except KeyError as exc:
            raise WireError(f"rollout group is missing {exc}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise WireError(f"rollout group has a malformed field: {exc}") from None
        _require(not tensors, f"rollout group has unknown tensors: {sorted(tensors)}")
        return group.validate()


@dataclass
class TrainBatch:
    """What the learner consumes: B = sum of group sizes rows, each prompt + completion, right-padded."""

    input_ids: torch.Tensor             # [B, T] int64
    prompt_lengths: torch.Tensor        # [B]
    completion_lengths: torch.Tensor    # [B]
    advantages: torch.Tensor            # [B] float32 (or [B, L] with process rewards)
    rewards: torch.Tensor               # [B] float32
    behaviour_logprobs: torch.Tensor    # [B, L] float32, L = max completion length
    ref_logprobs: torch.Tensor | None   # [B, L] float32, None when beta = 0
    group_index: torch.Tensor           # [B] int64, which group of this batch the row belongs to
    policy_versions: torch.Tensor       # [B] int64, version that sampled the row
    truncated: torch.Tensor             # [B] bool, finish reason "length"
    reward_components: dict[str, torch.Tensor]  # name -> [B]
    group_ids: list[str]                # one per group
    generator_ids: list[str]            # one per group: which generator sampled it
    temperature: float                  # sampling temperature shared by every group of the batch

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def from_groups(
        cls,
        groups: list[RolloutGroup],
        ref_logprobs: list[torch.Tensor] | None,
        *,
        estimator: str = "grpo",
        scale: str = "group",
        eps: float = 1e-4,
    ) -> TrainBatch:
        """Concatenate groups; advantages are computed per group (GRPO's baseline is the group)."""
        _require(len(groups) > 0, "a batch needs at least one group")
        temperatures = {g.sampling.temperature for g in groups}
        _require(len(temperatures) == 1, f"groups of one batch were sampled at different temperatures {temperatures}")
        rows = sum(g.group_size for g in groups)
        max_c = max(int(g.completion_lengths.max()) for g in groups)
        width = max(g.prompt_ids.numel() + int(g.completion_lengths.max()) for g in groups)
        input_ids = torch.zeros(rows, width, dtype=torch.long)
        behaviour = torch.zeros(rows, max_c)
        refs = torch.zeros(rows, max_c) if ref_logprobs is not None else None
        prompt_lengths, advantages, group_index, versions, truncated = [], [], [], [], []
        components = {name for g in groups for name in g.reward_components}
        # With process rewards anywhere in the batch, advantages are per token ([B, L]) for every row.
        process = any(g.step_rewards is not None for g in groups)
        row = 0
        for index, group in enumerate(groups):
            p = group.prompt_ids.numel()
            for i in range(group.group_size):
                c = int(group.completion_lengths[i])
                input_ids[row + i, :p] = group.prompt_ids
                input_ids[row + i, p:p + c] = group.completion_ids[i, :c]
                behaviour[row + i, :c] = group.behaviour_logprobs[i, :c]
                if refs is not None:
                    refs[row + i, :c] = ref_logprobs[index][i, :c]
            if process:
                advantages.append(_token_advantages(group, max_c, estimator, scale, eps))
            else:
                advantages.append(compute_advantages(group.rewards.unsqueeze(0), estimator, scale=scale, eps=eps)[0])
            prompt_lengths += [p] * group.group_size
            group_index += [index] * group.group_size
            versions += [group.policy_version] * group.group_size
            truncated += [r == "length" for r in group.finish_reasons]
            row += group.group_size
        return cls(
            input_ids=input_ids, prompt_lengths=torch.tensor(prompt_lengths),
            completion_lengths=torch.cat([g.completion_lengths.long() for g in groups]),
            advantages=torch.cat(advantages), rewards=torch.cat([g.rewards.float() for g in groups]),
            behaviour_logprobs=behaviour, ref_logprobs=refs, group_index=torch.tensor(group_index),
            policy_versions=torch.tensor(versions), truncated=torch.tensor(truncated, dtype=torch.bool),
            reward_components={
                name: torch.cat([g.reward_components.get(name, torch.full((g.group_size,), float("nan")))
                                 for g in groups]) for name in sorted(components)
            },
            group_ids=[g.group_id for g in groups], generator_ids=[g.generator_id for g in groups],
            temperature=temperatures.pop(),
        )

    def to_bytes(self) -> bytes:
        tensors = {
            "input_ids": self.input_ids, "prompt_lengths": self.prompt_lengths,
            "completion_lengths": self.completion_lengths, "advantages": self.advantages.float(),
            "rewards": self.rewards.float(), "behaviour_logprobs": self.behaviour_logprobs.float(),
            "group_index": self.group_index, "policy_versions": self.policy_versions, "truncated": self.truncated,
        }
        if self.ref_logprobs is not None:
            tensors["ref_logprobs"] = self.ref_logprobs.float()
        tensors.update({f"reward/{k}": v.float() for k, v in self.reward_components.items()})
        return encode("train_batch/v1", tensors, {"group_ids": self.group_ids, "generator_ids": self.generator_ids,
                                                  "temperature": self.temperature})

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainBatch:
        tensors, fields = decode(data, "train_batch/v1")
        try:
            return cls(
                input_ids=tensors["input_ids"], prompt_lengths=tensors["prompt_lengths"],
                completion_lengths=tensors["completion_lengths"], advantages=tensors["advantages"],
                rewards=tensors["rewards"], behaviour_logprobs=tensors["behaviour_logprobs"],
                ref_logprobs=tensors.get("ref_logprobs"), group_index=tensors["group_index"],
                policy_versions=tensors["policy_versions"], truncated=tensors["truncated"],
                reward_components={k.removeprefix("reward/"): v for k, v in tensors.items()
                                   if k.startswith("reward/")},
                group_ids=[str(g) for g in fields["group_ids"]],
                generator_ids=[str(g) for g in fields["generator_ids"]], temperature=float(fields["temperature"]),
            )
        except KeyError as exc:
            raise WireError(f"train batch is missing {exc}") from None


def _token_advantages(group: RolloutGroup, width: int, estimator: str, scale: str, eps: float) -> torch.Tensor:
    """``[G, width]`` advantages: process rewards per token, or the outcome advantage on every token."""
    if group.step_rewards is not None:
        return process_advantages(group.step_rewards, group.step_ends, group.num_steps, width, eps=eps)
    outcome = compute_advantages(group.rewards.unsqueeze(0), estimator, scale=scale, eps=eps)[0]
    return outcome.unsqueeze(1).expand(-1, width).clone()


def encode_logprob_request(input_ids: list[list[int]], prompt_lengths: list[int], temperature: float) -> bytes:
    """Binary form of ``POST /v1/logprobs``: flat ids + per-row lengths (rows may differ in length)."""
    flat = torch.tensor([t for row in input_ids for t in row], dtype=torch.long)
    return encode("logprob_request/v1", {
        "input_ids": flat, "row_lengths": torch.tensor([len(r) for r in input_ids], dtype=torch.long),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long),
    }, {"temperature": temperature})


def decode_logprob_request(data: bytes) -> tuple[list[list[int]], list[int], float]:
    tensors, fields = decode(data, "logprob_request/v1")
    try:
        flat, row_lengths, prompt_lengths = tensors["input_ids"], tensors["row_lengths"], tensors["prompt_lengths"]
    except KeyError as exc:
        raise WireError(f"logprob request is missing tensor {exc}") from None
    if flat.dim() != 1 or row_lengths.dim() != 1 or prompt_lengths.dim() != 1:
        raise WireError("input_ids, row_lengths and prompt_lengths must be 1-D")
    if row_lengths.numel() and (int(row_lengths.min()) < 0 or int(row_lengths.sum()) != flat.numel()):
        raise WireError("row_lengths must be >= 0 and add up to the number of input_ids")
    temperature = fields.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool):
        raise WireError("temperature must be a number")
    rows = [r.tolist() for r in torch.split(flat, row_lengths.tolist())] if row_lengths.numel() else []
    return rows, prompt_lengths.tolist(), float(temperature)


def encode_logprob_response(logprobs: list[list[float]] | list[torch.Tensor]) -> bytes:
    rows = [torch.as_tensor(r, dtype=torch.float32) for r in logprobs]
    flat = torch.cat(rows) if rows else torch.zeros(0)
    return encode("logprob_response/v1", {
        "logprobs": flat, "row_lengths": torch.tensor([r.numel() for r in rows], dtype=torch.long),
    }, {})


def decode_logprob_response(data: bytes) -> list[torch.Tensor]:
    tensors, _ = decode(data, "logprob_response/v1")
    return list(torch.split(tensors["logprobs"], tensors["row_lengths"].tolist()))
