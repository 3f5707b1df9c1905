"""Per-token estimators of KL(pi_theta || pi_ref) from the sampled token's logprobs (Schulman's k1/k2/k3).

With ``log r = log pi_ref(o_t) - log pi_theta(o_t)`` for a token sampled from pi_theta:

* ``k1 = -log r``               unbiased, high variance, negative for half the tokens;
* ``k2 = (log r)^2 / 2``        biased, low variance, always >= 0;
* ``k3 = r - 1 - log r``        unbiased, low variance, always >= 0 (GRPO's choice, eq. 2 of DeepSeekMath).

Registered by name in :data:`KL_ESTIMATORS`; verl's names are accepted as aliases.
"""

from __future__ import annotations

import torch

from shared.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """``k1 = -log r``."""
    return -log_ratio


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    """``k2 = (log r)^2 / 2``."""
    return 0.5 * log_ratio.square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """``k3 = r - 1 - log r = exp(log r) - 1 - log r``."""
    return torch.expm1(log_ratio) - log_ratio


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    estimator: str = "k3",
    *,
    log_ratio_clamp: float | None = None,
    value_clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimate; ``log r = ref_logprobs - logprobs``.

    ``log_ratio_clamp`` (c) clamps ``log r`` to ``[-c, c]`` before the estimator, so a token the reference finds
    nearly impossible cannot blow k3 up (``exp`` of a large log-ratio); ``value_clamp`` (v) clamps the result
    to ``[-v, v]``. Both are off by default. Gradients flow into ``logprobs``; ``ref_logprobs`` is a constant.

    Example: logprobs ``[-1,-1,-1]``, ref ``[0,-15,-30]`` give k1 ``[-1,14,29]``, k2 ``[0.5,98,420.5]``,
    k3 ``[0.7183,13,28]``.
    """
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)} vs ref {tuple(ref_logprobs.shape)}")
    log_ratio = ref_logprobs.detach().to(logprobs.dtype) - logprobs
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    kl = KL_ESTIMATORS.get(estimator)(log_ratio)
    if value_clamp is not None:
        kl = kl.clamp(-value_clamp, value_clamp)
    return kl
