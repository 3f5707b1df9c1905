"""The entropy bonus's coefficient, step by step (``algorithm.entropy``; issue 40, item 3).

The loss gets ``-coef * H_t`` on every token in it (shared.grpo.losses.compute_policy_loss), so a larger coef pushes
the policy's next-token distributions wider. Fixed, or adaptive: after each step, with ``H`` the step's mean token
entropy (the ``entropy`` metric),

    coef <- clip(coef + adapt_rate * (target - H), min_coef, max_coef)

an integral controller (as SAC tunes its temperature): while the entropy sits below the target the bonus grows,
above it the bonus shrinks back to ``min_coef``. The coefficient travels in checkpoints, so ``--resume`` goes on
with the one it had.
"""

from __future__ import annotations

import math

from shared.config.schema.algorithm import EntropyConfig


def next_coef(coef: float, entropy: float, cfg: EntropyConfig) -> float:
    """One controller update (the module docstring); a non-finite entropy leaves coef as it is."""
    if cfg.target is None or not math.isfinite(entropy):
        return coef
    return min(max(coef + cfg.adapt_rate * (cfg.target - entropy), cfg.min_coef), cfg.max_coef)


class EntropyControl:
    def __init__(self, cfg: EntropyConfig, saved: dict | None = None) -> None:
        """``saved``: :meth:`state` from a checkpoint (None: start from ``cfg.coef``)."""
        self.cfg = cfg
        self.coef = float(saved["coef"]) if saved and "coef" in saved else cfg.coef

    @property
    def active(self) -> bool:
        """The loss needs the entropy (with its gradient) at all."""
        return self.cfg.active

    def after_step(self, metrics: dict[str, float]) -> None:
        """Record the coefficient the step used as ``entropy_coef`` and move it for the next step."""
        if not self.active:
            return
        metrics["entropy_coef"] = self.coef
        self.coef = next_coef(self.coef, metrics.get("entropy", math.nan), self.cfg)

    def state(self) -> dict[str, float]:
        return {"coef": self.coef}
