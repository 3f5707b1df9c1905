import pytest
import torch

from shared.grpo.kl import KL_ESTIMATORS, kl_penalty

LOGP = torch.tensor([-1.0, -1.0, -1.0])
REF = torch.tensor([0.0, -15.0, -30.0])


@pytest.mark.parametrize(
    "name, expected",
    [("k1", [-1.0, 14.0, 29.0]), ("k2", [0.5, 98.0, 420.5]), ("k3", [0.7183, 13.0, 28.0])],
)
def test_issue_values(name, expected):
    torch.testing.assert_close(kl_penalty(LOGP, REF, name), torch.tensor(expected), atol=1e-4, rtol=0)


def test_aliases_match_verl_names():
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert KL_ESTIMATORS.get(alias) is KL_ESTIMATORS.get(name)


def test_identical_policies_give_zero_and_k2_k3_nonnegative():
    logp = torch.randn(50)
    for name in ("k1", "k2", "k3"):
        assert torch.equal(kl_penalty(logp, logp.clone(), name), torch.zeros(50))
    ref = torch.randn(50) * 3
    assert (kl_penalty(logp, ref, "k2") >= 0).all() and (kl_penalty(logp, ref, "k3") >= 0).all()


def test_k1_and_k3_are_unbiased_estimates_of_true_kl():
    # KL(q || p) for two categorical distributions, estimated from samples of q.
    gen = torch.Generator().manual_seed(0)
    q = torch.tensor([0.5, 0.3, 0.2]).log()
    p = torch.tensor([0.2, 0.3, 0.5]).log()
    true_kl = (q.exp() * (q - p)).sum()
    samples = torch.multinomial(q.exp(), 200_000, replacement=True, generator=gen)
    for name in ("k1", "k3"):
        estimate = kl_penalty(q[samples], p[samples], name).mean()
        assert abs(estimate - true_kl) < 0.01, (name, estimate, true_kl)


def test_clamps():
    log_ratio_clamped = kl_penalty(LOGP, REF, "k1", log_ratio_clamp=10.0)
    torch.testing.assert_close(log_ratio_clamped, torch.tensor([-1.0, 10.0, 10.0]))
    k3 = kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3", log_ratio_clamp=5.0)
    torch.testing.assert_close(k3, torch.tensor([torch.e**5 - 1 - 5]))
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2", value_clamp=50.0), torch.tensor([0.5, 50.0, 50.0]))


def test_gradient_flows_to_policy_not_reference():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], requires_grad=True)
    kl_penalty(logp, ref, "k3").sum().backward()
    # d/dlogp (r - 1 - log r) with log r = ref - logp: -r + 1
    torch.testing.assert_close(logp.grad, 1 - torch.exp(torch.tensor([-0.5, 1.0])))
    assert ref.grad is None


def test_unknown_estimator_and_shape_mismatch():
    with pytest.raises(KeyError, match="unknown KL estimator 'k4'"):
        kl_penalty(LOGP, REF, "k4")
    with pytest.raises(ValueError, match="shape mismatch"):
        kl_penalty(LOGP, REF[:2])
