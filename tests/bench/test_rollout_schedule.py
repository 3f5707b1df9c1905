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
