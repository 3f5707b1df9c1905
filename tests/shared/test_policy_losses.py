"""CISPO and SAPO (issue 40, item 4): each paper's worked example by hand, and by property what sets them apart from
PPO's clip: CISPO keeps every token's gradient with a bounded weight, SAPO fades it smoothly; all four losses agree
at pi_theta = pi_old."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.config.schema import GRPOConfig, LossConfig
from shared.grpo.losses import compute_policy_loss
from shared.grpo.policy_losses import POLICY_LOSSES


def cfg(policy_loss: str, **kw) -> LossConfig:
    return LossConfig(**{"policy_loss": policy_loss, "beta": 0.0, **kw})


def grad_wrt_logp(policy_loss: str, ratios: list[float], advantages: list[float], **kw):
    """Per-token loss and d loss / d log pi_theta, with pi_old = 0 (log) so that log pi_theta = log rho."""
    logp = torch.tensor([ratios], dtype=torch.float64).log().requires_grad_(True)
    terms = POLICY_LOSSES.get(policy_loss)(logp - torch.zeros_like(logp), torch.tensor([advantages],
                                           dtype=torch.float64), torch.ones_like(logp, dtype=torch.bool),
                                           cfg(policy_loss, **kw))
    (grad,) = torch.autograd.grad(terms.loss.sum(), logp)
    return terms, grad[0]


def test_cispo_worked_example_weights_every_token_with_its_clipped_ratio():
    terms, grad = grad_wrt_logp("cispo", [0.5, 1.0, 6.0], [1.0, -1.0, 2.0], cispo_eps_high=3.0)
    torch.testing.assert_close(terms.loss[0], torch.tensor([-0.5 * (1 + math.log(0.5)), 1.0, -8 * (1 + math.log(6))],
                                                          dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-0.5, 1.0, -8.0], dtype=torch.float64))
    assert terms.clipped_high[0].tolist() == [False, False, True] and not terms.clipped_low.any()


def test_cispo_lower_bound_when_set():
    terms, grad = grad_wrt_logp("cispo", [0.2, 0.9], [1.0, 1.0], cispo_eps_low=0.2, cispo_eps_high=3.0)
    torch.testing.assert_close(grad, torch.tensor([-0.8, -0.9], dtype=torch.float64))
    assert terms.clipped_low[0].tolist() == [True, False]


def test_sapo_worked_example_soft_gate_and_its_gradient():
    ratio = torch.tensor([[1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    terms = POLICY_LOSSES.get("sapo")(ratio.log(), torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                                      torch.ones(1, 2, dtype=torch.bool), cfg("sapo"))
    s = 1 / (1 + math.exp(-1.05))
    torch.testing.assert_close(terms.loss[0], torch.tensor([-1.0, 4 / 1.05 * s - 2 / 1.05 + 1], dtype=torch.float64))
    (grad,) = torch.autograd.grad(terms.loss.sum(), ratio)
    torch.testing.assert_close(grad[0], torch.tensor([-1.0, 4 * s * (1 - s)], dtype=torch.float64))
    assert not (terms.clipped_low.any() or terms.clipped_high.any() or terms.dual_clipped.any())


@settings(max_examples=60, deadline=None)
@given(advantages=st.lists(st.floats(-5, 5), min_size=1, max_size=6))
def test_every_policy_loss_is_minus_a_with_the_policy_gradient_on_policy(advantages):
    """At pi_theta = pi_old (old_logprobs None: one update per batch) the value is -A and the gradient -A / N for
    every registered loss, token-mean."""
    n = len(advantages)
    adv = torch.tensor([advantages], dtype=torch.float64)
    for name in POLICY_LOSSES.names():
        logp = torch.full((1, n), -1.3, dtype=torch.float64, requires_grad=True)
        out = compute_policy_loss(logp, adv, [n], cfg(name))
        assert out.loss.item() == pytest.approx(-sum(advantages) / n, abs=1e-9), name
        (grad,) = torch.autograd.grad(out.loss, logp)
        torch.testing.assert_close(grad, -adv / n, msg=name)


@settings(max_examples=80, deadline=None)
@given(log_ratio=st.floats(-3, 3), advantage=st.floats(0.1, 5) | st.floats(-5, -0.1))
def test_cispo_never_zeroes_a_gradient_and_sapo_fades_it(log_ratio, advantage):
    """Where PPO's clip cuts a token's gradient to 0, CISPO keeps it (a weight within its bounds) and SAPO's is
    non-zero, smaller in size than the unclipped policy gradient rho * A, and equal to it only at rho = 1."""
    rho = math.exp(log_ratio)
    _, ppo = grad_wrt_logp("grpo", [rho], [advantage])
    _, cispo = grad_wrt_logp("cispo", [rho], [advantage], cispo_eps_high=3.0)
    _, sapo = grad_wrt_logp("sapo", [rho], [advantage])
    assert cispo.item() == pytest.approx(-min(rho, 4.0) * advantage)
    assert cispo.item() != 0.0 and sapo.item() != 0.0
    outside = (advantage > 0 and rho > 1.2) or (advantage < 0 and rho < 0.8)
    assert (ppo.item() == 0.0) == outside
    assert abs(sapo.item()) <= abs(rho * advantage) * (1 + 1e-9)


def test_the_config_takes_both_losses_and_checks_their_settings():
    assert GRPOConfig.model_validate({"algorithm": {"loss": {"policy_loss": "cispo"}}}).algorithm.loss.cispo_eps_high == 3.0
    assert GRPOConfig.model_validate({"algorithm": {"loss": {"policy_loss": "sapo", "sapo_tau_neg": 2.0}}})
    with pytest.raises(ValueError, match="sapo_tau_pos"):
        GRPOConfig.model_validate({"algorithm": {"loss": {"sapo_tau_pos": 0}}})
    with pytest.raises(ValueError, match="cispo"):
        GRPOConfig.model_validate({"algorithm": {"loss": {"policy_loss": "cispoo"}}})
