"""Typed messages that cross a process boundary, and their safetensors encoding (:mod:`shared.protocol.wire`).

One meaning per field. Ragged per-sample data travels as right-padded ``[N, L]`` tensors plus an explicit
lengths tensor; padding values carry no meaning and masks always come from the lengths.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from shared.protocol import loss_mask, numbers
from shared.protocol import steps as step_fields
from shared.protocol import teacher_topk as topk_field
from shared.protocol import token_versions as versions_field
from shared.protocol.errors import require as _require
from shared.protocol.sampling import MIN_TEMPERATURE, SamplingParams, check_temperature  # noqa: F401 - re-exported
from shared.protocol.token_versions import MAX_VERSION
from shared.protocol.wire import WireError, decode, encode
from shared.tensors.masks import completion_mask

FINISH_REASONS = ("stop", "length")
# Ids become file names (the hub's spool) and metric labels: letters, digits, '_', '-', '.', not starting with '.'.
SAFE_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")


def _check_ragged(name: str, values: torch.Tensor, lengths: torch.Tensor, rows: int) -> None:
    _require(values.dim() == 2 and values.shape[0] == rows, f"{name} must be [{rows}, L], got {tuple(values.shape)}")
    _require(lengths.shape == (rows,), f"{name} lengths must be [{rows}]")
    if rows:
        _require(int(lengths.min()) >= 0, f"{name}: negative length")
        _require(int(lengths.max()) <= values.shape[1], f"{name}: a length exceeds the tensor width")


def _check_dtype(name: str, tensor: torch.Tensor, floating: bool) -> None:
    ok = tensor.is_floating_point() if floating else (not tensor.is_floating_point() and tensor.dtype != torch.bool)
    _require(ok, f"{name} must be {'a floating-point' if floating else 'an integer'} tensor, got {tensor.dtype}")


def _right_padded(rows: Sequence[Sequence[int | float]], dtype: torch.dtype, width: int) -> torch.Tensor:
    """``[len(rows), width]``: each row's values from the left, then zeros."""
    out = torch.zeros(len(rows), width, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            out[i, :len(row)] = torch.tensor(row, dtype=dtype)
    return out


@dataclass
class RolloutGroup:
    """G completions of one prompt, as a generator uploads them to the hub."""

    prompt_ids: torch.Tensor            # [P] int64, the prompt's token ids
    completion_ids: torch.Tensor        # [G, L] int64, right-padded
    completion_lengths: torch.Tensor    # [G] int64, valid tokens per completion (EOS included when emitted)
    behaviour_logprobs: torch.Tensor    # [G, L] float32, sampler's logprob of each sampled token
    rewards: torch.Tensor               # [G] float32, total (weighted) reward per completion
    finish_reasons: list[str]           # G entries, "stop" (EOS or stop string) or "length" (cut at max_tokens)
    policy_version: int                 # weights version that sampled this group: the oldest of its tokens
    generator_id: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # reward name -> [G] unweighted
    task: dict[str, str] = field(default_factory=dict)  # task metadata, e.g. {"answer": "82"}
    group_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # step rewards (shared.protocol.steps), None for an outcome-only group:
    step_rewards: torch.Tensor | None = None  # [S] float32, reward of each step
    step_index: torch.Tensor | None = None    # [S] int64, its completion (0..G-1), non-decreasing
    step_end: torch.Tensor | None = None      # [S] int64, its last token among the completion's tokens
    # multi-turn (shared.protocol.loss_mask): [G, L] bool, True where the model wrote the token; None: all ones
    completion_mask: torch.Tensor | None = None
    # continuous generation (shared.protocol.token_versions): [G, L] int64, the version that sampled each token;
    # None: every token has policy_version
    token_versions: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return int(self.completion_ids.shape[0])

    @classmethod
    def from_samples(
        cls,
        *,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[Sequence[int]],
        behaviour_logprobs: Sequence[Sequence[float]],
        rewards: Sequence[float],
        finish_reasons: Sequence[str],
        policy_version: int,
        generator_id: str,
        sampling: SamplingParams | None = None,
        reward_components: Mapping[str, Sequence[float]] | None = None,
        task: Mapping[str, str] | None = None,
        group_id: str | None = None,
        steps: Sequence[Sequence[tuple[int, float]]] | None = None,
        masks: Sequence[Sequence[int]] | None = None,
        versions: Sequence[Sequence[int] | None] | None = None,
    ) -> RolloutGroup:
        """A group from per-sample lists: completion ``i`` is ``completion_ids[i]`` (its token ids, any length),
        ``behaviour_logprobs[i]`` (one sampler logprob per token of it), ``rewards[i]``, ``finish_reasons[i]`` and
        ``reward_components[name][i]``.

        The ragged rows become right-padded ``[G, L]`` tensors, ``L`` the longest completion (at least 1, so a
        group of empty completions is ``[G, 1]``), padded with zeros, which mean nothing: ``completion_lengths`` are
        the row lengths. Token ids are int64, logprobs, rewards and reward components float32. A logprob row whose
        length is not its completion's is a :class:`ProtocolError` (padding would hide it); everything else is
        checked by :meth:`validate`, as for any group (this constructor does not call it). ``group_id`` None: a
        fresh one. ``steps[i]``: completion i's ``(step end token, step reward)`` pairs (:mod:`shared.protocol.steps`);
        None: an outcome-only group. ``masks[i]``: completion i's 0/1 per token (1 = the model wrote it,
        :mod:`shared.protocol.loss_mask`); None: every token is the model's (no mask is sent). ``versions[i]``:
        the policy version that sampled each token of completion i (:mod:`shared.protocol.token_versions`), None
        (the list or an entry): every token at ``policy_version``, the oldest; nothing is sent when all are.
        """
        sizes = [len(row) for row in completion_ids]
        _require(len(behaviour_logprobs) == len(sizes),
                 f"{len(behaviour_logprobs)} behaviour logprob rows for {len(sizes)} completions")
        for i, (size, logprobs) in enumerate(zip(sizes, behaviour_logprobs)):
            _require(len(logprobs) == size, f"completion {i}: {len(logprobs)} behaviour logprobs for {size} tokens")
        width = max([1, *sizes])
        optional = {"group_id": group_id} if group_id is not None else {}
        if steps is not None:
            optional.update(step_fields.steps_from_lists(steps, sizes))
        if masks is not None:
            optional["completion_mask"] = loss_mask.mask_from_lists(masks, sizes, width)
        if versions is not None:
            optional["token_versions"] = versions_field.versions_from_lists(versions, sizes, width, policy_version)
        return cls(
            prompt_ids=torch.as_tensor(prompt_ids, dtype=torch.long),
            completion_ids=_right_padded(completion_ids, torch.long, width),
            completion_lengths=torch.tensor(sizes, dtype=torch.long),
            behaviour_logprobs=_right_padded(behaviour_logprobs, torch.float32, width),
            rewards=torch.as_tensor(rewards, dtype=torch.float32),
            finish_reasons=list(finish_reasons), policy_version=policy_version, generator_id=generator_id,
            sampling=sampling if sampling is not None else SamplingParams(),
            reward_components={name: torch.as_tensor(values, dtype=torch.float32)
                               for name, values in (reward_components or {}).items()},
            task=dict(task or {}),
            **optional,
        )

    def validate(self, vocab_size: int | None = None) -> RolloutGroup:
        """Everything a batch relies on, so that a group accepted by the hub can always join a batch."""
        _require(isinstance(self.group_id, str) and bool(SAFE_ID.match(self.group_id)),
                 f"group_id {str(self.group_id)[:40]!r} must be 1-128 letters, digits, '_', '-' or '.' "
                 "(not starting with '.')")
        _require(isinstance(self.generator_id, str) and bool(SAFE_ID.match(self.generator_id)),
                 f"generator_id {str(self.generator_id)[:40]!r} must be 1-128 letters, digits, '_', '-' or '.'")
        for name, tensor, floating in (("prompt_ids", self.prompt_ids, False),
                                       ("completion_ids", self.completion_ids, False),
                                       ("completion_lengths", self.completion_lengths, False),
                                       ("behaviour_logprobs", self.behaviour_logprobs, True),
                                       ("rewards", self.rewards, True)):
            _check_dtype(name, tensor, floating)
        g = self.group_size
        _require(self.prompt_ids.dim() == 1 and self.prompt_ids.numel() >= 1, "prompt_ids must be a non-empty [P]")
        _require(g >= 1, "a group needs at least one completion")
        _check_ragged("completion_ids", self.completion_ids, self.completion_lengths, g)
        _require(self.behaviour_logprobs.shape == self.completion_ids.shape,
                 "behaviour_logprobs must have the shape of completion_ids")
        # every float is checked as the float32 the learner computes with (a float64 1e300 is inf there)
        valid = completion_mask(self.completion_lengths, self.completion_ids.shape[1])
        numbers.check_logprobs("behaviour_logprobs", self.behaviour_logprobs, mask=valid)
        _require(self.rewards.shape == (g,), f"rewards must be [{g}]")
        numbers.as_float32("rewards", self.rewards)
        _require(isinstance(self.finish_reasons, list) and len(self.finish_reasons) == g
                 and all(r in FINISH_REASONS for r in self.finish_reasons),
                 f"finish_reasons must be {g} values out of {FINISH_REASONS}")
        _require(type(self.policy_version) is int and 0 <= self.policy_version < MAX_VERSION,
                 f"policy_version must be an integer in [0, 2^53), got {self.policy_version!r}")
        _require(isinstance(self.sampling, SamplingParams), "sampling must be SamplingParams")
        self.sampling.validate()
        for name, values in self.reward_components.items():
            _require(bool(SAFE_ID.match(name)), f"reward component name {name[:40]!r} is not a safe name")
            _check_dtype(f"reward component {name!r}", values, True)
            _require(values.shape == (g,), f"reward component {name!r} must be [{g}]")
            numbers.as_float32(f"reward component {name!r}", values)
        step_fields.check_steps(self.step_rewards, self.step_index, self.step_end, self.completion_lengths)
        loss_mask.check_mask(self.completion_mask, self.completion_ids, self.completion_lengths)
        versions_field.check_versions(self.token_versions, self.completion_lengths,
                                      torch.full((g,), self.policy_version), tuple(self.completion_ids.shape),
                                      oldest=self.policy_version)
        for name, ids in (("prompt_ids", self.prompt_ids), ("completion_ids", self.completion_ids)):
            numbers.check_token_ids(name, ids, vocab_size)
        return self

    def to_bytes(self) -> bytes:
        tensors = {
            "prompt_ids": self.prompt_ids.long(), "completion_ids": self.completion_ids.long(),
            "completion_lengths": self.completion_lengths.long(),
            "behaviour_logprobs": self.behaviour_logprobs.float(), "rewards": self.rewards.float(),
        }
        tensors.update({f"reward/{name}": v.float() for name, v in self.reward_components.items()})
        tensors.update(step_fields.step_tensors(self))  # nothing for an outcome-only group
        tensors.update(loss_mask.mask_tensors(self))    # nothing for a single-turn group
        tensors.update(versions_field.version_tensors(self))  # nothing for a group of one version
        fields = dict(finish_reasons=self.finish_reasons, policy_version=self.policy_version,
                      generator_id=self.generator_id, sampling=asdict(self.sampling), task=self.task,
                      group_id=self.group_id)
        return encode("rollout_group/v1", tensors, fields)

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int | None = None) -> RolloutGroup:
        """Decode and validate (ids < ``vocab_size`` if given); every problem is a WireError or ProtocolError."""
        tensors, fields = decode(data, "rollout_group/v1")
        try:
            sampling = fields["sampling"]
            task = fields.get("task", {})
            _require(isinstance(sampling, dict), "sampling must be a JSON object")
            _require(isinstance(task, dict), "task must be a JSON object")
            group = cls(
                prompt_ids=tensors.pop("prompt_ids"), completion_ids=tensors.pop("completion_ids"),
                completion_lengths=tensors.pop("completion_lengths"),
                behaviour_logprobs=tensors.pop("behaviour_logprobs"), rewards=tensors.pop("rewards"),
                reward_components={k.removeprefix("reward/"): tensors.pop(k) for k in list(tensors)
                                   if k.startswith("reward/")},
                finish_reasons=fields["finish_reasons"], policy_version=fields["policy_version"],
                generator_id=fields["generator_id"], sampling=SamplingParams(**sampling),
                task={str(k): str(v) for k, v in task.items()}, group_id=fields["group_id"],
                **step_fields.take_steps(tensors), **loss_mask.take_mask(tensors),
                **versions_field.take_versions(tensors),
            )
        except KeyError as exc:
            raise WireError(f"rollout group is missing {exc}") from None
        except (TypeError, AttributeError) as exc:
            raise WireError(f"rollout group has a malformed field: {exc}") from None
        _require(not tensors, f"rollout group has unknown tensors: {sorted(tensors)}")
        return group.validate(vocab_size)


@dataclass
class TrainBatch:
    """What the learner consumes: B = sum of group sizes rows, each prompt + completion, right-padded.

    A plain container: the learner computes advantages from ``rewards`` and ``group_index`` over the whole batch.
    """

    input_ids: torch.Tensor             # [B, T] int64
    prompt_lengths: torch.Tensor        # [B]
    completion_lengths: torch.Tensor    # [B]
    rewards: torch.Tensor               # [B] float32
    behaviour_logprobs: torch.Tensor    # [B, L] float32, L = max completion length
    ref_logprobs: torch.Tensor | None   # [B, L] float32, None when beta = 0
    group_index: torch.Tensor           # [B] int64, which group of this batch the row belongs to (0..groups-1)
    policy_versions: torch.Tensor       # [B] int64, version that sampled the row (the oldest of its tokens)
    truncated: torch.Tensor             # [B] bool, finish reason "length"
    reward_components: dict[str, torch.Tensor]  # name -> [B]
    group_ids: list[str]                # one per group
    generator_ids: list[str]            # one per group: which generator sampled it
    temperature: float                  # sampling temperature shared by every group of the batch
    batch_id: str = ""                  # the hub's lease on these groups: acknowledge it once the step is applied
    # step rewards (shared.protocol.steps), present when a group of the batch has them; step_index is the batch row
    step_rewards: torch.Tensor | None = None  # [S] float32
    step_index: torch.Tensor | None = None    # [S] int64, row in this batch (0..B-1), non-decreasing
    step_end: torch.Tensor | None = None      # [S] int64, the step's last token among the row's completion tokens
    # multi-turn (shared.protocol.loss_mask): [B, L] bool like behaviour_logprobs, True where the model wrote the
    # token; present when a group of the batch has one (rows of the others all True), None: all ones
    completion_mask: torch.Tensor | None = None
    # continuous generation (shared.protocol.token_versions): [B, L] int64 like behaviour_logprobs, each token's
    # version; present when a group of the batch has them (the others' rows hold their policy_version), None: all
    token_versions: torch.Tensor | None = None
    # on-policy distillation: [B, L] float32 like behaviour_logprobs, the teacher's logprobs of the same tokens
    # (ref_server.teacher_model); None without a teacher
    teacher_logprobs: torch.Tensor | None = None
    # top-k distillation: [B, L, k] int32 / float32, the teacher's k likeliest next tokens (shared.protocol.teacher_topk)
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_groups(self) -> int:
        return len(self.group_ids)

    @staticmethod
    def fields_of_groups(groups: list[RolloutGroup]) -> dict[str, Any]:
        """The batch fields of ``groups`` other than the token-aligned tensors (``input_ids``,
        ``behaviour_logprobs``, ``ref_logprobs``) and ``batch_id``: per-row lengths, rewards, group index, versions,
        truncation and reward components (NaN in the rows of a group without that component), the per-group ids,
        the temperature they share (checked), the step rewards (:func:`shared.protocol.steps.batch_steps`) and the
        token versions (:func:`shared.protocol.token_versions.batch_versions`, laid out as the logprobs). One
        definition for :meth:`from_groups` and the hub's batch assembly (ref_server/hub/batching.py), so that the
        two cannot drift."""
        _require(len(groups) > 0, "a batch needs at least one group")
        temperatures = {g.sampling.temperature for g in groups}
        _require(len(temperatures) == 1, f"groups of one batch were sampled at different temperatures {temperatures}")
        def per_row(values: list[int]) -> torch.Tensor:  # each group's value on its rows (repeat_interleave: ms)
            return torch.tensor([v for g, v in zip(groups, values) for _ in range(g.group_size)], dtype=torch.long)
        return dict(
            prompt_lengths=per_row([g.prompt_ids.numel() for g in groups]),
            completion_lengths=torch.cat([g.completion_lengths.long() for g in groups]),
            rewards=torch.cat([g.rewards.float() for g in groups]),
            group_index=per_row(list(range(len(groups)))),
            policy_versions=per_row([g.policy_version for g in groups]),
            truncated=torch.tensor([r == "length" for g in groups for r in g.finish_reasons], dtype=torch.bool),
            reward_components={
                name: torch.cat([g.reward_components.get(name, torch.full((g.group_size,), float("nan")))
                                 for g in groups])
                for name in sorted({name for g in groups for name in g.reward_components})
            },
            group_ids=[g.group_id for g in groups], generator_ids=[g.generator_id for g in groups],
            temperature=temperatures.pop(), **step_fields.batch_steps(groups),
            **versions_field.batch_versions(groups),
        )

    @classmethod
    def from_groups(cls, groups: list[RolloutGroup], ref_logprobs: list[torch.Tensor] | None, *,
                    batch_id: str = "", teacher_logprobs: list[torch.Tensor] | None = None) -> TrainBatch:
        """Concatenate groups into right-padded rows (``ref_logprobs[i]`` and ``teacher_logprobs[i]`` are group
        i's ``[G, L_i]``)."""
        fields = cls.fields_of_groups(groups)
        rows, behaviour, refs, teachers = [], [], [], []
        for index, group in enumerate(groups):
            for i in range(group.group_size):
                c = int(group.completion_lengths[i])
                rows.append(torch.cat([group.prompt_ids.long(), group.completion_ids[i, :c].long()]))
                behaviour.append(group.behaviour_logprobs[i, :c].float())
                if ref_logprobs is not None:
                    refs.append(ref_logprobs[index][i, :c].float())
                if teacher_logprobs is not None:
                    teachers.append(teacher_logprobs[index][i, :c].float())
        pad = torch.nn.utils.rnn.pad_sequence
        behaviour_logprobs = pad(behaviour, batch_first=True)
        return cls(
            input_ids=pad(rows, batch_first=True), behaviour_logprobs=behaviour_logprobs,
            ref_logprobs=pad(refs, batch_first=True) if ref_logprobs is not None else None, batch_id=batch_id,
            completion_mask=loss_mask.batch_mask(groups, behaviour_logprobs.shape[1]),
            teacher_logprobs=pad(teachers, batch_first=True) if teacher_logprobs is not None else None, **fields,
        )

    def select_groups(self, keep: list[int]) -> TrainBatch:
        """The batch with only the groups at positions ``keep`` (renumbered 0..len(keep)-1, widths trimmed)."""
        _require(len(keep) > 0, "select_groups needs at least one group")
        positions = torch.tensor(keep)
        rows = torch.isin(self.group_index, positions).nonzero().flatten()
        width = int((self.prompt_lengths[rows] + self.completion_lengths[rows]).max())
        width_c = max(int(self.completion_lengths[rows].max()), 1)
        renumber = torch.full((self.num_groups,), -1, dtype=torch.long)
        renumber[positions] = torch.arange(len(keep))
        return replace(
            self, input_ids=self.input_ids[rows, :width], prompt_lengths=self.prompt_lengths[rows],
            completion_lengths=self.completion_lengths[rows], rewards=self.rewards[rows],
            behaviour_logprobs=self.behaviour_logprobs[rows, :width_c],
            ref_logprobs=self.ref_logprobs[rows, :width_c] if self.ref_logprobs is not None else None,
            group_index=renumber[self.group_index[rows]], policy_versions=self.policy_versions[rows],
            truncated=self.truncated[rows], reward_components={k: v[rows] for k, v in self.reward_components.items()},
            group_ids=[self.group_ids[i] for i in keep], generator_ids=[self.generator_ids[i] for i in keep],
            completion_mask=self.completion_mask[rows, :width_c] if self.completion_mask is not None else None,
            token_versions=self.token_versions[rows, :width_c] if self.token_versions is not None else None,
            teacher_logprobs=self.teacher_logprobs[rows, :width_c] if self.teacher_logprobs is not None else None,
            **topk_field.select_topk(self, rows, width_c),
            **step_fields.select_steps(vars(self), rows, self.batch_size))

    def to_bytes(self) -> bytes:
        tensors = {
            "input_ids": self.input_ids, "prompt_lengths": self.prompt_lengths,
            "completion_lengths": self.completion_lengths, "rewards": self.rewards.float(),
            "behaviour_logprobs": self.behaviour_logprobs.float(), "group_index": self.group_index,
            "policy_versions": self.policy_versions, "truncated": self.truncated,
        }
        if self.ref_logprobs is not None:
            tensors["ref_logprobs"] = self.ref_logprobs.float()
        if self.teacher_logprobs is not None:
            tensors["teacher_logprobs"] = self.teacher_logprobs.float()
        tensors.update({f"reward/{k}": v.float() for k, v in self.reward_components.items()})
        tensors.update(step_fields.step_tensors(self))
        tensors.update(loss_mask.mask_tensors(self) | topk_field.topk_tensors(self))
        tensors.update(versions_field.version_tensors(self))
        return encode("train_batch/v2", tensors, {"group_ids": self.group_ids, "generator_ids": self.generator_ids,
                                                  "temperature": self.temperature, "batch_id": self.batch_id})

    @classmethod
    def from_bytes(cls, data: bytes) -> TrainBatch:
        tensors, fields = decode(data, "train_batch/v2")
        try:
            return cls(
                input_ids=tensors["input_ids"], prompt_lengths=tensors["prompt_lengths"],
                completion_lengths=tensors["completion_lengths"], rewards=tensors["rewards"],
                behaviour_logprobs=tensors["behaviour_logprobs"], ref_logprobs=tensors.get("ref_logprobs"),
                teacher_logprobs=tensors.get("teacher_logprobs"),
                group_index=tensors["group_index"], policy_versions=tensors["policy_versions"],
                truncated=tensors["truncated"],
                reward_components={k.removeprefix("reward/"): v for k, v in tensors.items()
                                   if k.startswith("reward/")},
                group_ids=[str(g) for g in fields["group_ids"]],
                generator_ids=[str(g) for g in fields["generator_ids"]], temperature=float(fields["temperature"]),
                batch_id=str(fields.get("batch_id", "")), **step_fields.take_steps(dict(tensors)),
                **loss_mask.take_mask(dict(tensors)), **versions_field.take_versions(dict(tensors)),
                **topk_field.take_topk(dict(tensors), tensors["behaviour_logprobs"].shape),
            )
        except KeyError as exc:
            raise WireError(f"train batch is missing {exc}") from None
