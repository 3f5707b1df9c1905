"""bench/process_vs_outcome.py's argument parsing and curve bookkeeping on tiny hand-made curves (no run)."""

import pytest

from bench.process_vs_outcome import (
    VARIANTS,
    comparison,
    final_accuracy,
    mean_curve,
    parse_args,
    steps_to,
    variant_changes,
)


def test_arguments_and_their_defaults():
    args = parse_args(["--steps", "40", "--eval-every", "5", "--seeds", "3", "4", "--beta", "0.1", "x.y=1"])
    assert (args.steps, args.eval_every, args.seeds, args.beta, args.overrides) == (40, 5, [3, 4], 0.1, ["x.y=1"])
    defaults = parse_args([])
    assert defaults.variants == list(VARIANTS) and defaults.config == "deploy/configs/tiny-chain-cpu.yaml"
    with pytest.raises(SystemExit):
        parse_args(["--eval-every", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--variants", "outcome+kl_nowhere"])


def test_variants_put_the_kl_in_exactly_one_place():
    loss = variant_changes("process+kl_loss", 0.04)
    assert loss["algorithm__loss__beta"] == 0.04 and loss["algorithm__kl"] == {"in_reward": False}
    assert loss["algorithm__advantage__supervision"] == "process"
    assert loss["generator__step_rewards"] == {"outcome": "none"}
    assert [r["name"] for r in loss["generator__rewards"]] == ["chain_steps", "chain"]
    reward = variant_changes("outcome+kl_reward", 0.04)
    assert reward["algorithm__loss__beta"] == 0.0
    assert reward["algorithm__kl"] == {"in_reward": True, "beta": 0.04, "estimator": "k1"}
    assert [r["name"] for r in reward["generator__rewards"]] == ["chain"] and "generator__step_rewards" not in reward
    with pytest.raises(ValueError, match="unknown variant"):
        variant_changes("process", 0.04)


def test_mean_curve_averages_the_seeds_that_have_a_point():
    per_seed = {0: {0: 0.5, 10: 0.6, 20: 0.8}, 1: {0: 0.5, 10: None, 20: 0.7}}
    assert mean_curve(per_seed) == pytest.approx({0: 0.5, 10: 0.6, 20: 0.75})
    assert mean_curve({0: {5: None}}) == {5: None}


def test_steps_to_the_outcome_runs_final_accuracy_and_the_ratio():
    outcome = {0: 0.5, 10: 0.6, 20: 0.7, 30: 0.8, 40: 0.8}
    process = {0: 0.5, 10: 0.7, 20: 0.85, 30: 0.9, 40: 0.9}
    assert final_accuracy(outcome) == 0.8
    assert steps_to(0.8, outcome) == 30 and steps_to(0.8, process) == 20 and steps_to(0.95, process) is None
    assert steps_to(None, process) is None
    cmp = comparison({"outcome+kl_loss": outcome, "process+kl_loss": process})
    assert cmp["kl_loss"] == {"target": 0.8, "steps_outcome": 30, "steps_process": 20, "budget": 40,
                              "ratio": pytest.approx(2 / 3), "final_outcome": 0.8, "final_process": 0.9}
    assert "kl_reward" not in cmp  # no curves for it
    slower = comparison({"outcome+kl_reward": outcome, "process+kl_reward": {0: 0.5, 40: 0.75}})
    assert slower["kl_reward"]["steps_process"] is None and slower["kl_reward"]["ratio"] is None
