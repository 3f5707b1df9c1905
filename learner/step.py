"""The GRPO step on one pulled batch: old logprobs, micro-batches, the loss with global normalisers, backward.

Normalisation: the loss of every micro-batch on every rank is divided by the token (and sequence) counts of the
*global* batch, all-reduced once per step. The sum of the pieces' losses is then the loss of the whole batch,
whatever the number of ranks or micro-batches. DeepSpeed averages gradients over data-parallel ranks, so each
rank backpropagates ``world_size x`` its piece to turn that average back into the sum. The same holds for
micro-batches cut by a token budget (any rows together) and for packed rows: only the pieces change, not the
normaliser.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from learner.distill_topk import add_forward_kl, micro_batch_topk
from shared.config.schema import LossConfig, OffPolicyConfig
from shared.forward.logprobs import sequence_logprobs
from shared.forward.packing import PackingMode, split_by_token_budget
from shared.forward.prefix_sharing import PrefixRows, shared_prefixes
from shared.grpo.losses import PolicyLossOutput, compute_policy_loss, loss_normalizers
from shared.grpo.off_policy import (
    MASKING_MODES,
    MISMATCH_MAX_KEY,
    MISMATCH_SUM_PREFIX,
    TOKEN_SPREAD_MAX_KEY,
    mismatch_metrics,
    mismatch_sums,
    off_policy_weights,
    version_lag_sums,
)
from shared.protocol.records import TrainBatch
from shared.tensors.masks import completion_mask
from shared.tensors.transfers import to_device

# How each metric combines over micro-batches and ranks: token-weighted mean, min or max.
_MIN_KEYS = {"ratio_min", "is_weight_min"}
_MAX_KEYS = {"ratio_max", "is_weight_max", "logprob_diff_max", MISMATCH_MAX_KEY, TOKEN_SPREAD_MAX_KEY}
# summed over micro-batches and ranks, then turned into means in _step_metrics
_SUM_KEYS = {"num_tokens", "pg_loss", "entropy_bonus", "logprob_diff_sum", "sampled_tokens"}


@dataclass
class MicroBatch:
    input_ids: torch.Tensor
    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor      # true lengths (what the logprobs are computed over)
    loss_lengths: torch.Tensor            # lengths that count in the loss (0 for masked truncated rows)
    advantages: torch.Tensor
    behaviour_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    # The same lengths as host values, taken when the micro-batch was cut (the batch is on the host then): every
    # size, maximum and index count of the step comes from these, so the step never reads a length back from the
    # device (on a GPU each such read waits until all queued kernels have run).
    host_prompt_lengths: list[int]        # = prompt_lengths
    host_completion_lengths: list[int]    # = completion_lengths
    host_loss_lengths: list[int]          # = loss_lengths
    old_logprobs: torch.Tensor | None = None
    # multi-turn: [b, width_c] bool, True where the model wrote the token (shared.tensors.masks); None: all
    loss_mask: torch.Tensor | None = None
    layout: PackingMode = "padded"        # how the forward lays the rows out (shared.forward.packing.choose_layout)
    prefix: PrefixRows | None = None      # rows sharing a prompt: one pass of it (shared.forward.prefix_sharing)
    normalizers: tuple[int, int] = (0, 0)  # (loss tokens, loss sequences), counted on the host before the copy
    lags: torch.Tensor | None = None      # [b] the learner's version minus the row's (None: all 0)
    token_lags: torch.Tensor | None = None  # [b, width_c] the same per token (batch.token_versions; None: the row's)
    # (weights, keep) of the off-policy correction (apply_off_policy; None: no correction), and with a masking mode
    # the (kept tokens, sequences with a kept token) on the device: the loss's normalisers then come from these
    correction: tuple[torch.Tensor, torch.Tensor] | None = None
    kept_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None  # [b, width_c, k] ids, logprobs (learner.distill_topk)


@dataclass
class StepOutcome:
    finite: bool
    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


def micro_batch_rows(batch: TrainBatch, parts: int, token_budget: int | None = None, packed: bool = False,
                     device: torch.device | None = None) -> list[torch.Tensor]:
    """Row indices of each micro-batch.

    Without a token budget: ``parts`` contiguous runs of whole groups. With one: rows (of any groups) packed
    into micro-batches of at most ``token_budget`` tokens (their sum when ``packed``, rows x longest row
    otherwise; a longer row goes alone), at least ``parts`` of them, and as many on every rank (the largest
    count is all-reduced: ranks must run the same number of backward passes)."""
    if token_budget is None:
        num_groups = int(batch.group_index.max()) + 1
        if parts > num_groups:
            raise ValueError(f"cannot split {num_groups} groups into {parts} micro-batches")
        bounds = [round(i * num_groups / parts) for i in range(parts + 1)]
        return [((batch.group_index >= start) & (batch.group_index < end)).nonzero().flatten()
                for start, end in zip(bounds[:-1], bounds[1:])]
    lengths = (batch.prompt_lengths + batch.completion_lengths).tolist()
    local = len(split_by_token_budget(lengths, token_budget, packed=packed, min_parts=parts))
    # one all-reduce: the most micro-batches any rank needs, and the fewest rows any rank has
    count, neg_rows = all_reduce(torch.tensor([float(local), -float(len(lengths))], device=device),
                                 dist.ReduceOp.MAX).tolist()
    if count > -neg_rows:  # raised on every rank alike, so none is left waiting in a collective
        raise ValueError(f"a rank needs {int(count)} micro-batches of at most {token_budget} tokens but another "
                         f"has only {int(-neg_rows)} rows: raise learner.micro_batch_tokens")
    count = int(count)
    return [torch.tensor(rows, dtype=torch.long)
            for rows in split_by_token_budget(lengths, token_budget, packed=packed, parts=count)]


def batch_tokens(batch: TrainBatch, world: int, device: torch.device) -> float:
    """Prompt and completion tokens of the global batch (this rank's, summed over ranks): from the host copies,
    no device round trip on one rank."""
    tokens = float((batch.prompt_lengths + batch.completion_lengths).sum())
    if world > 1:
        tokens = float(all_reduce(torch.tensor([tokens], device=device)).item())
    return tokens


def split_micro_batches(batch: TrainBatch, advantages: torch.Tensor, parts: int, mask_truncated: bool,
                        device: torch.device, *, token_budget: int | None = None,
                        packing: PackingMode = "padded", prefix_sharing: str = "off",
                        learner_version: int | None = None) -> list[MicroBatch]:
    """Split into micro-batches (:func:`micro_batch_rows`), each trimmed to its own widths.

    ``advantages`` is ``[B]``, one per completion (the loss broadcasts it over the completion's tokens), or
    ``[B, L]``, one per completion token (learner.advantages.batch_advantages): cut by rows like every per-row
    tensor and trimmed to the micro-batch's completion width like the logprobs.
    ``packing`` is how their forward lays the rows out (``learner.packing``); it also decides how the token
    budget counts a micro-batch. ``prefix_sharing`` (``learner.prefix_sharing``): rows of a micro-batch that
    continue one prompt share one pass of it. ``learner_version``: the version the learner holds, which makes each
    row's version lag (for the drift metrics by staleness) and, when the batch has token versions, each token's."""
    lags = None if learner_version is None else (learner_version - batch.policy_versions).clamp(min=0)
    token_lags = (None if learner_version is None or batch.token_versions is None
                  else (learner_version - batch.token_versions).clamp(min=0))
    loss_lengths = batch.completion_lengths.clone()
    if mask_truncated:
        loss_lengths[batch.truncated] = 0
    pieces = []
    for rows in micro_batch_rows(batch, parts, token_budget, packed=packing != "padded", device=device):
        completion = batch.completion_lengths[rows]
        width_c = max(int(completion.max()), 1)
        width = int((batch.prompt_lengths[rows] + completion).max())

        def take(t: torch.Tensor | None, cols: int | None = None, rows=rows) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[rows]
            return (t[:, :cols] if cols is not None and t.dim() == 2 else t).to(device)

        prefix = shared_prefixes(prefix_sharing, batch.input_ids[rows, :width], batch.prompt_lengths[rows], packing,
                                 batch.group_index[rows])
        pieces.append(MicroBatch(
            input_ids=take(batch.input_ids, width), prompt_lengths=take(batch.prompt_lengths),
            completion_lengths=take(batch.completion_lengths), loss_lengths=take(loss_lengths),
            advantages=take(advantages, width_c),
            behaviour_logprobs=take(batch.behaviour_logprobs, width_c),
            ref_logprobs=take(batch.ref_logprobs, width_c), layout=packing if prefix is None else "padded",
            prefix=prefix, normalizers=loss_normalizers(loss_lengths[rows], mask_rows(batch, rows, width_c)),
            host_prompt_lengths=batch.prompt_lengths[rows].tolist(), host_completion_lengths=completion.tolist(),
            host_loss_lengths=loss_lengths[rows].tolist(), loss_mask=take(batch.completion_mask, width_c),
            lags=take(lags), token_lags=take(token_lags, width_c),
            teacher_topk=micro_batch_topk(batch, rows, width_c, device)))
    return pieces


def mask_rows(batch: TrainBatch, rows: torch.Tensor, width: int) -> torch.Tensor | None:
    """The batch's model-token mask of ``rows``, ``width`` columns wide, on the host (None for a single-turn batch)."""
    return None if batch.completion_mask is None else batch.completion_mask[rows, :width]


def all_reduce(values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=op)
    return values


def ranks_agree(flag: bool, device: torch.device, op=dist.ReduceOp.MAX) -> bool:
    """Whether any rank (``op`` MAX; MIN: every rank) holds ``flag``."""
    if dist.get_world_size() == 1:  # nobody to agree with: no tensor, no device round trip
        return flag
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0], device=device), op).item() > 0.5)


def policy_logprobs(model, mb: MicroBatch, temperature: float, *, with_entropy: bool, chunk_tokens: int | None,
                    with_topk: bool = False):
    """``(logprobs, entropy or None, the student's logprobs at mb.teacher_topk's ids [b, w, k] with with_topk)``."""
    extra = mb.teacher_topk[0] if with_topk else None
    out = sequence_logprobs(model, mb.input_ids, mb.host_prompt_lengths, mb.host_completion_lengths,
                            temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                            layout=mb.layout, prefix=mb.prefix, extra_targets=extra)
    width = mb.behaviour_logprobs.shape[1]
    pad = width - out.logprobs.shape[1]  # a micro-batch of empty completions still has width >= 1
    logprobs = torch.nn.functional.pad(out.logprobs, (0, pad))
    entropy = torch.nn.functional.pad(out.entropy, (0, pad)) if out.entropy is not None else None
    return logprobs, entropy, torch.nn.functional.pad(out.extra_logprobs, (0, 0, 0, pad)) if with_topk else None


@torch.no_grad()
def recompute_old_logprobs(model, micro_batches: list[MicroBatch], temperature: float,
                           chunk_tokens: int | None) -> None:
    """pi_old from the current weights, before the first update of the batch (kept fixed for all mu updates)."""
    for mb in micro_batches:
        mb.old_logprobs, _, _ = policy_logprobs(model, mb, temperature, with_entropy=False, chunk_tokens=chunk_tokens)


def apply_off_policy(micro_batches: list[MicroBatch], cfg: OffPolicyConfig) -> None:
    """Each micro-batch's off-policy correction (:func:`shared.grpo.off_policy.off_policy_weights`) from its
    recomputed old logprobs and the behaviour logprobs, over the tokens in the loss; with a masking mode also the
    kept counts the loss's normalisers come from. Device arithmetic only (no host read)."""
    for mb in micro_batches:
        if mb.old_logprobs is None:
            raise ValueError("an off-policy correction needs the recomputed old logprobs (recompute_old_logprobs)")
        mb.correction = off_policy_weights(mb.old_logprobs, mb.behaviour_logprobs, mb.loss_lengths, mode=cfg.mode,
                                           low=cfg.low, high=cfg.high, loss_mask=mb.loss_mask)
        if cfg.mode in MASKING_MODES:
            keep = mb.correction[1]
            mb.kept_counts = (keep.sum().double(), keep.any(dim=1).sum().double())


def micro_batch_loss(model, mb: MicroBatch, loss_cfg: LossConfig, *, temperature: float, old_mode: str,
                     num_tokens: float | torch.Tensor, num_seqs: float | torch.Tensor, log_entropy: bool = False,
                     chunk_tokens: int | None = None, lag_buckets: int = 1,
                     entropy_coef: float = 0.0, distill_coef: float = 0.0) -> tuple[PolicyLossOutput, torch.Tensor | None]:
    """The loss of one micro-batch, normalised by the global counts. ``old_mode`` 'behaviour' (bypass): pi_old is
    the behaviour logprobs; 'recompute': the recomputed ones, with the micro-batch's off-policy correction
    (:func:`apply_off_policy`). The drift metrics (:func:`shared.grpo.off_policy.mismatch_sums`, ``lag_buckets``
    version lags) compare the behaviour logprobs with the recomputed old logprobs, or in bypass with this forward's
    (which are pi_old at the batch's only update). ``entropy_coef`` != 0: the entropy bonus is in the loss (the
    entropy is then computed with its gradient whatever ``log_entropy`` says). ``distill_coef`` > 0: plus top-k
    distillation's term (:func:`learner.distill_topk.add_forward_kl`; the micro-batch must carry the teacher's top-k)."""
    with_topk = distill_coef > 0
    if with_topk and mb.teacher_topk is None:
        raise ValueError("algorithm.distill.mode topk_forward_kl: this micro-batch has no teacher top-k")
    logprobs, entropy, topk = policy_logprobs(model, mb, temperature, with_entropy=log_entropy or entropy_coef != 0.0,
                                              chunk_tokens=chunk_tokens, with_topk=with_topk)
    if old_mode == "behaviour":
        old, learner_old = mb.behaviour_logprobs, logprobs.detach()
    else:
        if mb.old_logprobs is None:
            raise ValueError("old_logprobs='recompute' needs recompute_old_logprobs() before the first update")
        old, learner_old = mb.old_logprobs, mb.old_logprobs
    result = compute_policy_loss(logprobs, mb.advantages, mb.host_loss_lengths, loss_cfg, old_logprobs=old,
                                 correction=mb.correction if old_mode != "behaviour" else None,
                                 ref_logprobs=mb.ref_logprobs,
                                 num_tokens=num_tokens, num_seqs=num_seqs, token_mask=mb.loss_mask,
                                 entropy=entropy, entropy_coef=entropy_coef)
    if topk is not None:
        add_forward_kl(result, topk, mb.teacher_topk[1], mb.host_loss_lengths, mb.loss_mask, loss_cfg,
                       coef=distill_coef, num_tokens=num_tokens, num_seqs=num_seqs)
    result.metrics.update(behaviour_logprob_gap(logprobs, mb.behaviour_logprobs, mb.completion_lengths,
                                                mb.loss_mask))
    valid = completion_mask(mb.loss_lengths, logprobs.shape[1], mb.loss_mask)
    keep = valid if mb.correction is None or old_mode == "behaviour" else mb.correction[1]
    lags = mb.lags if mb.lags is not None else torch.zeros_like(mb.loss_lengths)
    result.metrics.update(mismatch_sums(learner_old, mb.behaviour_logprobs, valid, keep, lags, lag_buckets))
    result.metrics.update(version_lag_sums(valid, lags, mb.token_lags))
    return result, entropy


def behaviour_logprob_gap(logprobs: torch.Tensor, behaviour: torch.Tensor, completion_lengths: torch.Tensor,
                          token_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``|learner logprob - generator logprob|`` of every sampled token (truncated rows included): its sum,
    max and token count, from the logprobs the loss already has (no extra forward).

    At the first update of a batch whose groups are not stale this is the numerical gap between trainer and
    sampler (bf16, other kernels, vLLM vs transformers); the step reports it as ``logprob_diff_mean`` and
    ``logprob_diff_max``. The ``ratio`` metrics show it too, but mixed with the clipping.

    Masked arithmetic, no ``gap[mask]``: a boolean index has a data-dependent size, which a GPU must report back
    to the host (a wait for the device per micro-batch). ``token_mask`` (multi-turn): the environment's tokens were
    not sampled and have no behaviour logprob; only the model's count."""
    mask = completion_mask(completion_lengths, logprobs.shape[1], token_mask)
    # gaps are >= 0, so zeros in the masked-out places leave the maximum as it is (and make it 0 when empty)
    gap = torch.where(mask, (logprobs.detach() - behaviour).abs(), 0.0)
    largest = gap.amax() if gap.numel() else gap.new_zeros(())
    return {"logprob_diff_sum": gap.sum(), "sampled_tokens": mask.sum(), "logprob_diff_max": largest}


def grpo_step(engine, micro_batches: list[MicroBatch], loss_cfg: LossConfig, *, temperature: float,
              old_mode: str, world_size: int, log_entropy: bool, chunk_tokens: int | None,
              lag_buckets: int = 1, entropy_coef: float = 0.0, distill_coef: float = 0.0) -> StepOutcome:
    """Forward/backward over the micro-batches, then one optimizer step (skipped if any loss is not finite).

    One host synchronisation per step: losses, finiteness flags and metrics stay on the device while the
    micro-batches run (a non-finite loss is still backpropagated, and its gradients are dropped with the rest), and
    come back together, after at most two all-reduces, to decide the optimizer step. The forward takes every length,
    width and index count from the micro-batches' host copies (``host_*_lengths``) and the metrics use masked
    arithmetic, so nothing else waits for the device. DeepSpeed's and transformers' own code may synchronise too;
    tests/learner/test_host_syncs.py records both and lists theirs."""
    model = engine.module
    device = micro_batches[0].input_ids.device
    num_tokens, num_seqs = global_normalizers(micro_batches, world_size, device)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict[str, torch.Tensor] = {}
    mins: dict[str, torch.Tensor] = {}
    maxs: dict[str, torch.Tensor] = {}
    total_loss, nonfinite = zero, zero
    for mb in micro_batches:
        _start_zero3_micro_step(engine)
        result, entropy = micro_batch_loss(model, mb, loss_cfg, temperature=temperature, old_mode=old_mode,
                                           num_tokens=num_tokens, num_seqs=num_seqs, log_entropy=log_entropy,
                                           chunk_tokens=chunk_tokens, lag_buckets=lag_buckets,
                                           entropy_coef=entropy_coef, distill_coef=distill_coef)
        loss = result.loss.detach().double()
        nonfinite = nonfinite + (~torch.isfinite(loss)).double()
        engine.backward(result.loss * world_size, scale_wrt_gas=False)
        total_loss = total_loss + loss
        values = {key: torch.as_tensor(value, device=device).detach().double()
                  for key, value in result.metrics.items()}
        weight = values["num_tokens"]
        for key, value in values.items():
            if key in _MIN_KEYS:
                mins[key] = torch.minimum(mins[key], value) if key in mins else value
            elif key in _MAX_KEYS:
                maxs[key] = torch.maximum(maxs[key], value) if key in maxs else value
            elif key in _SUM_KEYS or key.startswith(MISMATCH_SUM_PREFIX):
                sums[key] = sums.get(key, zero) + value
            else:
                sums[key] = sums.get(key, zero) + value * weight
        if entropy is not None:
            mask = completion_mask(mb.completion_lengths, entropy.shape[1], mb.loss_mask)
            sums["entropy"] = sums.get("entropy", zero) + torch.where(mask, entropy.detach(), 0.0).double().sum()
            sums["entropy_tokens"] = sums.get("entropy_tokens", zero) + mask.sum().double()
    host = _gather_step_numbers(total_loss, nonfinite, sums, mins, maxs)  # the step's one synchronisation
    if host["nonfinite"] > 0:
        # drop whatever the micro-batches accumulated; no optimizer or scheduler step
        engine.optimizer.zero_grad()
        engine.zero_grad()
        return StepOutcome(False, math.nan)
    engine.step()
    return StepOutcome(True, host["loss"], _step_metrics(host, grad_norm=engine.get_global_grad_norm()))


def global_normalizers(micro_batches: list[MicroBatch], world_size: int,
                       device: torch.device) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(tokens, sequences) in the loss over every micro-batch and rank: host numbers for a world of one, else one
    small all-reduce whose result stays on the device (the loss divides by it there). With a masking off-policy
    correction the counts are the kept tokens, which the device decided: counted and kept there."""
    if any(mb.kept_counts is not None for mb in micro_batches):
        kept = torch.stack([torch.stack(mb.kept_counts) for mb in micro_batches]).sum(dim=0)
        tokens, seqs = (all_reduce(kept) if world_size > 1 else kept).unbind()
        return tokens, seqs
    local = [float(sum(mb.normalizers[i] for mb in micro_batches)) for i in (0, 1)]
    if world_size > 1:
        tokens, seqs = all_reduce(to_device(local, device, torch.float64)).unbind()
        return tokens, seqs
    return local[0], local[1]


def _gather_step_numbers(total_loss, nonfinite, sums, mins, maxs) -> dict:
    """Every rank's step numbers, reduced (sums and the non-finite count summed, maxima and minima taken), as
    host floats: one SUM and one MAX all-reduce (minima as negated maxima), one copy to the host."""
    sum_keys, min_keys, max_keys = sorted(sums), sorted(mins), sorted(maxs)
    summed = all_reduce(torch.stack([total_loss, nonfinite, *(sums[k] for k in sum_keys)]))
    extremes = [*(-mins[k] for k in min_keys), *(maxs[k] for k in max_keys)]
    if extremes:
        summed = torch.cat([summed, all_reduce(torch.stack(extremes), dist.ReduceOp.MAX)])
    values = summed.tolist()
    host = {"loss": values[0], "nonfinite": values[1], "sums": dict(zip(sum_keys, values[2:2 + len(sum_keys)]))}
    rest = values[2 + len(sum_keys):]
    host["mins"] = {k: -v for k, v in zip(min_keys, rest[:len(min_keys)])}
    host["maxs"] = dict(zip(max_keys, rest[len(min_keys):]))
    return host


def _start_zero3_micro_step(engine) -> None:
    """Tell ZeRO-3 that a new micro-batch begins, so its backward adds to the gradient buffer.

    DeepSpeed's stage-3 optimizer overwrites its partitioned gradient buffer while its micro-step counter is 0 and
    only ``DeepSpeedEngine.forward()`` advances that counter. The step calls the module's body and head directly
    (chunked logprobs), so without this every micro-batch would replace the previous one's gradient.
    """
    if engine.zero_optimization_stage() == 3:
        engine.optimizer.clear_backward_seen_flag()


def _step_metrics(host: dict, grad_norm) -> dict[str, float]:
    totals = host["sums"]
    tokens = max(totals.get("num_tokens", 0.0), 1.0)
    metrics = {k: v / tokens for k, v in totals.items()
               if k not in _SUM_KEYS | {"entropy", "entropy_tokens"} and not k.startswith(MISMATCH_SUM_PREFIX)}
    metrics.update(mismatch_metrics(totals))
    metrics["pg_loss"] = totals.get("pg_loss", 0.0)
    if "entropy_bonus" in totals:
        metrics["entropy_bonus"] = totals["entropy_bonus"]
    if "sampled_tokens" in totals:
        metrics["logprob_diff_mean"] = totals["logprob_diff_sum"] / max(totals["sampled_tokens"], 1.0)
    metrics["loss_tokens"] = totals.get("num_tokens", 0.0)
    if "entropy" in totals:
        metrics["entropy"] = totals["entropy"] / max(totals["entropy_tokens"], 1.0)
    metrics.update(host["mins"])
    metrics.update(host["maxs"])
    if grad_norm is not None:
        metrics["grad_norm"] = float(grad_norm)
    return metrics
