"""bench/rollout_schedule.py's agent workload: :func:`tool_agent` drives the trajectories of the multi-turn
workload's ToolStandIn (a call ending at the stop string is a tool call answered ``(ok)``, another end is the
answer), within the turn limit; the workload builds the same length model as multi_turn."""

from types import SimpleNamespace

from bench.rollout_schedule import MULTI_TURN_STOP, WORKLOADS, tool_agent


class Completions:
    """What the endpoint answers each call: (text, stop_reason); the prompts it was sent."""

    def __init__(self, answers):
        self.answers, self.prompts = list(answers), []

    def create(self, *, model, prompt, max_tokens, stop):
        assert stop == [MULTI_TURN_STOP] and model == "policy"
        self.prompts.append(prompt)
        text, reason = self.answers.pop(0)
        return SimpleNamespace(choices=[SimpleNamespace(text=text, stop_reason=reason)])


def run(answers, turns, monkeypatch):
    monkeypatch.setenv("GRPO_BENCH_TOOL_LATENCY_S", "0")
    monkeypatch.setenv("GRPO_BENCH_TURNS", str(turns))
    completions = Completions(answers)
    assert tool_agent(SimpleNamespace(completions=completions), {"question": "1+2="}) is None
    return completions.prompts


def test_tool_calls_are_answered_and_the_answer_ends_the_episode(monkeypatch):
    prompts = run([("ab", MULTI_TURN_STOP), ("c", MULTI_TURN_STOP), ("3", None), ("never", None)], 4, monkeypatch)
    assert prompts == ["1+2=", "1+2=ab!(ok)", "1+2=ab!(ok)c!(ok)"]


def test_the_turn_limit_ends_an_episode_of_tool_calls(monkeypatch):
    prompts = run([("x", MULTI_TURN_STOP)] * 5, 2, monkeypatch)
    assert prompts == ["1+2=", "1+2=x!(ok)"]


def test_the_agent_workload_samples_like_the_multi_turn_one():
    assert WORKLOADS["agent"] is WORKLOADS["multi_turn"] is None   # EOS and the stop string at --eos/--stop-prob


def test_the_engine_alone_samples_every_token_of_the_uniform_workload_on_both_schedules(tiny_model_dir, tmp_path):
    """``--engine-only``: with EOS never sampled every completion runs to the cap, so both schedules count exactly
    groups x G x max_tokens tokens (the continuous one stops at as many finished sequences, aborting the rest)."""
    from bench.rollout_engines import engine_only_arm
    from bench.rollout_schedule import build_length_model, parse_args

    model = build_length_model(tiny_model_dir, tmp_path / "uniform", WORKLOADS["uniform"], hidden=64, layers=1)
    args = parse_args(["--model", str(tiny_model_dir), "--groups", "4", "--prompts-per-batch", "2",
                       "--group-size", "2", "--max-tokens", "8", "--engine-only"])
    for schedule in ("batch", "continuous"):
        arm = engine_only_arm(args, schedule, model)
        assert arm["sequences"] == 8 and arm["completion_tokens"] == 4 * 2 * 8, arm


def test_repeats_report_each_arms_median_run_and_the_median_of_the_paired_ratios():
    from bench.rollout_report import summarize

    runs = {"batch": [{"tokens_per_s": 100.0, "k": 1}, {"tokens_per_s": 200.0, "k": 2}, {"tokens_per_s": 150.0, "k": 3}],
            "continuous": [{"tokens_per_s": 300.0}, {"tokens_per_s": 260.0}, {"tokens_per_s": 150.0}]}
    out = summarize(runs)
    assert out["batch"]["k"] == 3 and out["batch"]["tokens_per_s_runs"] == [100.0, 200.0, 150.0]
    assert out["continuous"]["tokens_per_s"] == 260.0
    # each repeat's own ratio (3.0, 1.3, 1.0), not the ratio of the medians (260 / 150 = 1.73)
    assert out["tokens_per_s_continuous_over_batch"] == 1.3
    assert out["tokens_per_s_continuous_over_batch_range"] == [1.0, 3.0]
    single = summarize({"batch": [{"tokens_per_s": 80.0}], "continuous": [{"tokens_per_s": 100.0}]})
    assert single == {"batch": {"tokens_per_s": 80.0}, "continuous": {"tokens_per_s": 100.0},
                      "tokens_per_s_continuous_over_batch": 1.25}   # one run: the format of before
