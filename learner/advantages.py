"""The advantages of a pulled batch: one per completion (outcome supervision) or one per token (process
supervision, the KL penalty in the reward, on-policy distillation), computed over the whole batch with the pure
functions of :mod:`shared.grpo.advantages` and :mod:`shared.grpo.distill`; their metrics; and the optional JSONL
record of what the loss used.

``scale: batch`` means the global batch: the std is taken over every rank's rewards (outcome) or step rewards
(process), all-reduced as count, sum and sum of squares, so the result does not depend on how the hub split the
batch over ranks. Every rank makes the same collective calls whatever its batch holds (they are decided by the
config alone), so a rank whose groups carry no steps still joins the all-reduce.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from learner.distill_topk import require_topk
from learner.lora import reference_logprobs
from learner.step import all_reduce
from shared.config.schema import AdvantageConfig, AlgorithmConfig, DistillConfig, GRPOConfig, KLConfig
from shared.grpo.advantages import (
    compute_advantages,
    kl_in_reward_advantages,
    normalised_step_rewards,
    outcome_token_rewards,
    process_advantages,
    step_token_rewards,
)
from shared.grpo.distill import centred_token_rewards, distill_token_rewards, reverse_kl_mean
from shared.grpo.kl import kl_penalty
from shared.protocol.records import TrainBatch
from shared.registry import Registry
from shared.tensors.masks import lengths_to_mask, masked_mean, masked_min_max

log = logging.getLogger("grpo.learner")


def global_std(values: torch.Tensor) -> float:
    """The unbiased std of ``values`` over every rank (one all-reduce of count, sum and sum of squares, float64);
    0 for fewer than two values in all."""
    values = values.double()
    n, total, squares = all_reduce(torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64),
                                                values.sum(), (values * values).sum()])).tolist()
    return max((squares - total * total / n) / (n - 1), 0.0) ** 0.5 if n > 1 else 0.0


def batch_steps(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(step_rewards, step_index, step_end)`` of the batch; empty tensors when its groups carry no steps."""
    if batch.step_rewards is None or batch.step_index is None or batch.step_end is None:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return batch.step_rewards.float(), batch.step_index.long(), batch.step_end.long()


# algorithm.advantage.supervision -> what the advantages come from. An entry is a class with ``steps`` (whether it
# reads the batch's step rewards: their metrics are reported) and two static methods: ``advantages(batch, cfg)``,
# the advantages the loss uses without the KL in the reward (``[B]`` or ``[B, L]``), and ``token_rewards(batch, cfg,
# width)``, the ``[B, width]`` rewards p_t the KL in the reward is added to (shared.grpo.advantages).
SUPERVISIONS: Registry = Registry("advantage supervision")


@SUPERVISIONS.register("outcome")
class OutcomeSupervision:
    """One reward per completion, normalised by ``algorithm.advantage.estimator``; the same advantage on every token."""

    steps = False

    @staticmethod
    def advantages(batch: TrainBatch, cfg: AdvantageConfig) -> torch.Tensor:
        """``[B]``, one estimator call with the group index (verl's way); the loss broadcasts each over its tokens."""
        batch_std = global_std(batch.rewards) if cfg.scale == "batch" else None
        return compute_advantages(batch.rewards, batch.group_index, cfg.estimator, scale=cfg.scale, eps=cfg.eps,
                                  batch_std=batch_std)

    @staticmethod
    def token_rewards(batch: TrainBatch, cfg: AdvantageConfig, width: int) -> torch.Tensor:
        """The outcome advantage at each completion's last token."""
        return outcome_token_rewards(OutcomeSupervision.advantages(batch, cfg), batch.completion_lengths.long(),
                                     width=width)


@SUPERVISIONS.register("process")
class ProcessSupervision:
    """The step rewards (DeepSeekMath 4.1.3): a token's advantage sums the normalised rewards of the steps ending at
    or after it; rows without steps get 0."""

    steps = True

    @staticmethod
    def _steps(batch: TrainBatch, cfg: AdvantageConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]:
        """The batch's steps and the std ``scale: batch`` divides by; a warning when the batch has none (such a
        batch teaches nothing)."""
        rewards, index, end = batch_steps(batch)
        if not rewards.numel():
            log.warning("algorithm.advantage.supervision is 'process' but no completion of batch %r has step "
                        "rewards: every advantage is 0 and this batch teaches nothing (do the rewards score steps?)",
                        batch.batch_id)
        return rewards, index, end, global_std(rewards) if cfg.scale == "batch" else None

    @staticmethod
    def advantages(batch: TrainBatch, cfg: AdvantageConfig) -> torch.Tensor:
        """``[B, L]``: ``A_{i,t} = sum_{j: e_ij >= t} r~_ij`` (``process_advantages``)."""
        rewards, index, end, batch_std = ProcessSupervision._steps(batch, cfg)
        advantages = process_advantages(rewards, index, end, batch.group_index, batch.completion_lengths.long(),
                                        scale=cfg.scale, eps=cfg.eps, batch_std=batch_std)
        return torch.nn.functional.pad(advantages, (0, batch.behaviour_logprobs.shape[1] - advantages.shape[1]))

    @staticmethod
    def token_rewards(batch: TrainBatch, cfg: AdvantageConfig, width: int) -> torch.Tensor:
        """Each step's normalised reward r~ at its last token."""
        rewards, index, end, batch_std = ProcessSupervision._steps(batch, cfg)
        normalised = normalised_step_rewards(rewards, index, batch.group_index, scale=cfg.scale, eps=cfg.eps,
                                             batch_std=batch_std)
        return step_token_rewards(normalised, index, end, batch.completion_lengths.long(), width=width)


@SUPERVISIONS.register("none")
class NoSupervision:
    """No task reward: every advantage 0 but what the KL in the reward or on-policy distillation adds (pure
    distillation: ``algorithm.distill`` with ``supervision: none``)."""

    steps = False

    @staticmethod
    def advantages(batch: TrainBatch, cfg: AdvantageConfig) -> torch.Tensor:
        return torch.zeros(batch.batch_size)

    @staticmethod
    def token_rewards(batch: TrainBatch, cfg: AdvantageConfig, width: int) -> torch.Tensor:
        return torch.zeros(batch.batch_size, width)


def batch_advantages(batch: TrainBatch, cfg: AdvantageConfig, kl: KLConfig | None = None,
                     distill: DistillConfig | None = None, student: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages the loss uses: ``[B]`` or ``[B, L]`` (``L`` = the batch's completion width).

    * without the KL in the reward: the supervision's own (:data:`SUPERVISIONS`): ``outcome`` ``[B]``, ``process``
      ``[B, L]``, ``none`` zeros;
    * ``kl.in_reward``: ``r_t = -beta k(t) + p_t`` and ``A_t = sum_{s >= t} r_s`` (``kl_in_reward_advantages``),
      ``p`` = the supervision's token rewards (the outcome advantage at the completion's last token, or each step's
      r~ at its end); ``k`` from the behaviour (sampler's) logprobs and the reference logprobs;
    * ``distill``: plus, on each model token, ``-coef * (student - teacher)`` (``distill_token_rewards``) with
      ``student`` the ``[B, L]`` logprobs :func:`distill_student` chose, ``[B, L]``; no return to go (discount 0);
      with ``distill.baseline: mean`` less their mean over the batch's model tokens (``centred_token_rewards``);
      ``distill.mode: topk_forward_kl`` adds nothing here (a loss term instead, :mod:`learner.distill_topk`).
    """
    advantages = _task_advantages(batch, cfg, kl)
    if distill is not None and distill.mode == "topk_forward_kl":
        require_topk(batch)  # a loss term (learner.distill_topk), nothing in the advantages
    if distill is None or distill.mode != "reverse_kl":
        return advantages
    if batch.teacher_logprobs is None or student is None:
        raise ValueError(f"algorithm.distill needs the teacher's logprobs, but batch {batch.batch_id!r} has none: "
                         "the ref server must load ref_server.teacher_model (start it with the same config)")
    lengths = batch.completion_lengths.long()
    rewards = distill_token_rewards(student, batch.teacher_logprobs, lengths, coef=distill.coef,
                                    loss_mask=batch.completion_mask)
    if distill.baseline == "mean":
        rewards = centred_token_rewards(rewards, lengths, batch.completion_mask)
    if advantages.dim() == 1:
        advantages = torch.where(lengths_to_mask(lengths, rewards.shape[1]), advantages.unsqueeze(1), 0.0)
    return advantages + torch.nn.functional.pad(rewards, (0, advantages.shape[1] - rewards.shape[1]))


def learner_logprobs(model: torch.nn.Module, batch: TrainBatch, device: torch.device, config: GRPOConfig,
                     clock) -> torch.Tensor | None:
    """The logprobs the learner scores itself before the advantages: the reference under ``learner.lora.reference:
    learner`` (set on the batch: the base policy, this model with its adapters off) and on-policy distillation's
    student (returned: :func:`distill_student`; None without distillation)."""
    cfg, algorithm = config.learner, config.algorithm
    if algorithm.needs_reference and cfg.reference_in_learner:
        batch.ref_logprobs = reference_logprobs(model, batch, device, chunk_tokens=cfg.logprob_chunk_tokens)
        clock.lap("old_logprobs")  # a scoring forward like the recompute of pi_old: charged with it
    return distill_student(model, batch, device, algorithm.distill, cfg.logprob_chunk_tokens)


def distill_student(model: torch.nn.Module, batch: TrainBatch, device: torch.device, distill: DistillConfig | None,
                    chunk_tokens: int | None) -> torch.Tensor | None:
    """The student logprobs of ``algorithm.distill.student``: the sampler's (``behaviour``) or the learner's own
    before the update (``recompute``: one forward without gradient, adapters on); None without distillation."""
    if distill is None:
        return None
    if distill.student == "behaviour":
        return batch.behaviour_logprobs
    return reference_logprobs(model, batch, device, chunk_tokens=chunk_tokens, base=False)


def distill_metrics(batch: TrainBatch, student: torch.Tensor | None) -> dict[str, float]:
    """``distill_reverse_kl``: the mean over the model's tokens of ``student - teacher`` (the k1 estimate of
    KL(student || teacher), before coef); nothing without distillation."""
    if student is None or batch.teacher_logprobs is None:
        return {}
    return {"distill_reverse_kl": reverse_kl_mean(student, batch.teacher_logprobs, batch.completion_lengths,
                                                  batch.completion_mask)}


def _task_advantages(batch: TrainBatch, cfg: AdvantageConfig, kl: KLConfig | None) -> torch.Tensor:
    """The advantages of the task reward (and the KL in the reward): :func:`batch_advantages` without distillation."""
    supervision = SUPERVISIONS.get(cfg.supervision)
    if kl is None or not kl.in_reward:
        return supervision.advantages(batch, cfg)
    token_rewards = supervision.token_rewards(batch, cfg, batch.behaviour_logprobs.shape[1])
    if batch.ref_logprobs is None:
        raise ValueError(f"algorithm.kl.in_reward needs reference logprobs, but batch {batch.batch_id!r} has none: "
                         "the ref server must load the reference model (start it with the same config)")
    behaviour, ref = batch.behaviour_logprobs, batch.ref_logprobs
    if batch.completion_mask is not None:  # multi-turn: equal logprobs at environment tokens, so their KL is 0
        environment = ~batch.completion_mask.bool()
        behaviour, ref = behaviour.masked_fill(environment, 0.0), ref.masked_fill(environment, 0.0)
    return kl_in_reward_advantages(token_rewards, behaviour, ref, batch.completion_lengths.long(), beta=kl.beta,
                                   estimator=kl.estimator)


def advantage_metrics(batch: TrainBatch, advantages: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of the advantages: over the completions (``[B]``) or over their real tokens
    (``[B, L]``, padding left out)."""
    adv = advantages.float()
    if adv.dim() == 2:
        adv = adv[lengths_to_mask(batch.completion_lengths.long(), adv.shape[1])]
    if not adv.numel():
        return {"advantage_mean": 0.0, "advantage_std": 0.0, "advantage_min": 0.0, "advantage_max": 0.0}
    return {"advantage_mean": float(adv.mean()), "advantage_std": float(adv.std()) if adv.numel() > 1 else 0.0,
            "advantage_min": float(adv.min()), "advantage_max": float(adv.max())}


def step_metrics(batch: TrainBatch) -> dict[str, float]:
    """The batch's step rewards: their mean and std, steps per completion, and the fractions of rows and groups
    without any step (those get advantage 0 under process supervision)."""
    rewards, index, _ = batch_steps(batch)
    rows = batch.batch_size
    per_row = torch.bincount(index, minlength=rows)
    groups = int(batch.group_index.max()) + 1 if rows else 0
    per_group = torch.zeros(groups, dtype=torch.long).index_add_(0, batch.group_index.long(), per_row)
    return {
        "step_reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "step_reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "steps_per_completion": rewards.numel() / max(rows, 1),
        "rows_without_steps_frac": float((per_row == 0).sum()) / max(rows, 1),
        "groups_without_steps_frac": float((per_group == 0).sum()) / max(groups, 1),
    }


def kl_reward_metrics(batch: TrainBatch, advantages: torch.Tensor, kl: KLConfig) -> dict[str, float]:
    """With the KL in the reward: the mean per-token KL estimate ``k`` over the real tokens (before beta), and the
    range of the returns (the token advantages)."""
    if batch.ref_logprobs is None:
        return {}
    mask = lengths_to_mask(batch.completion_lengths.long(), batch.behaviour_logprobs.shape[1])
    zero = torch.zeros((), dtype=torch.float64)
    old = torch.where(mask, batch.behaviour_logprobs.double(), zero)
    ref = torch.where(mask, batch.ref_logprobs.double(), zero)
    low, high = masked_min_max(advantages.double(), mask)
    return {"kl_reward_mean": float(masked_mean(kl_penalty(old, ref, kl.estimator), mask)),
            "return_min": float(low), "return_max": float(high)}


def algorithm_metrics(batch: TrainBatch, advantages: torch.Tensor, algorithm: AlgorithmConfig) -> dict[str, float]:
    """The advantage metrics, plus the step-reward ones (process supervision, or a batch with steps) and the
    KL-in-reward ones."""
    metrics = advantage_metrics(batch, advantages)
    if SUPERVISIONS.get(algorithm.advantage.supervision).steps or batch.step_rewards is not None:
        metrics.update(step_metrics(batch))
    if algorithm.kl.in_reward:
        metrics.update(kl_reward_metrics(batch, advantages, algorithm.kl))
    return metrics


class AdvantageLog:
    """``learner.advantages_jsonl``: one JSON line per pulled batch with, per row, what identifies it, its steps
    and the token advantages the loss used (a debugging and testing aid; off by default).

    Rank 0 appends to ``path``; rank r > 0 to ``path + ".rank<r>"`` (each rank has its own part of the batch)."""

    def __init__(self, path: str, rank: int, algorithm: AlgorithmConfig, *, mask_truncated: bool) -> None:
        target = Path(path if rank == 0 else f"{path}.rank{rank}")
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(target, "a", buffering=1)
        self._rank, self._algorithm, self._mask_truncated = rank, algorithm, mask_truncated

    def write(self, step: int, batch: TrainBatch, advantages: torch.Tensor) -> None:
        self._file.write(json.dumps(advantage_record(step, batch, advantages, self._algorithm, rank=self._rank,
                                                     mask_truncated=self._mask_truncated)) + "\n")

    def close(self) -> None:
        self._file.close()


def _multi_turn_fields(batch: TrainBatch, row: int, length: int) -> dict:
    """A multi-turn row's completion tokens and mask (1 = the model wrote it); nothing for a single-turn batch."""
    if batch.completion_mask is None:
        return {}
    start = int(batch.prompt_lengths[row])
    return {"completion_ids": batch.input_ids[row, start:start + length].tolist(),
            "mask": batch.completion_mask[row, :length].int().tolist()}


def advantage_record(step: int, batch: TrainBatch, advantages: torch.Tensor, algorithm: AlgorithmConfig, *,
                     rank: int = 0, mask_truncated: bool = False, digits: int = 6) -> dict:
    """The JSON object :class:`AdvantageLog` writes for one batch (see the config field for its keys)."""
    lengths = batch.completion_lengths.tolist()
    values = advantages.double().tolist()
    rewards, index, end = batch_steps(batch)
    steps: list[list[tuple[int, float]]] = [[] for _ in lengths]
    for row, e, r in zip(index.tolist(), end.tolist(), rewards.tolist()):
        steps[row].append((e, r))
    group_of = batch.group_index.tolist()
    first_row: dict[int, int] = {}
    rows = []
    for row, length in enumerate(lengths):
        group = group_of[row]
        first_row.setdefault(group, row)
        token_values = values[row][:length] if advantages.dim() == 2 else [values[row]] * length
        rows.append({
            "row": row, "group_id": batch.group_ids[group], "group_index": group,
            "row_in_group": row - first_row[group], "completion_length": length, "reward": float(batch.rewards[row]),
            "truncated": bool(batch.truncated[row]), "in_loss": not (mask_truncated and bool(batch.truncated[row])),
            "step_ends": [e for e, _ in steps[row]], "step_rewards": [r for _, r in steps[row]],
            "advantages": [round(v, digits) for v in token_values],
            **_multi_turn_fields(batch, row, length),
        })
    return {"step": step, "rank": rank, "batch_id": batch.batch_id,
            "supervision": algorithm.advantage.supervision, "scale": algorithm.advantage.scale,
            "kl_in_reward": algorithm.kl.in_reward, "rows": rows}
