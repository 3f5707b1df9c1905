"""The feedback game (generator/environments/guess.py): a policy that uses the hints wins every game in <= 10
guesses; one that ignores them almost never does. Played through the environment directly, and through the
multi-turn rollouts with a scripted policy that sees only its context tokens (the observations as the model would)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deploy.demo.tiny_model import build_char_tokenizer
from generator.engines.base import SampledTurn
from generator.environments.base import environment_factory
from generator.environments.guess import DigitGuess, guess_examples, hint, write_guess_dataset
from generator.multiturn import MultiTurnRollouts
from shared.config.schema.generator import EnvironmentConfig
from shared.protocol.records import SamplingParams

PAIRS = re.compile(r"<guess>(\d+)</guess><hint>([\d.]+|invalid)</hint>")


def next_guess(context: str, digits: int, use_hints: bool) -> str:
    """Guess ``t`` (0-based) tries digit ``t`` at every position not yet known; known ones come from the hints of
    earlier turns (when ``use_hints``), which is the only place they appear."""
    pairs = PAIRS.findall(context)
    known = [None] * digits
    if use_hints:
        for _, shown in pairs:
            for i, ch in enumerate(shown):
                if ch != ".":
                    known[i] = ch
    turn = len(pairs)
    return "".join(k if k is not None else str(turn % 10) for k in known)


def play(secret: str, use_hints: bool, max_guesses: int = 10) -> int | None:
    """Guesses to win, or None."""
    env = DigitGuess(digits=len(secret))
    assert env.reset({"answer": secret}) is None
    context = ""
    for guesses in range(1, max_guesses + 1):
        guess = next_guess(context, len(secret), use_hints)
        result = env.step(f"<guess>{guess}</guess>")
        if result.done:
            assert result.reward == 1.0 and guess == secret
            return guesses
        assert result.reward == 0.0 and result.observation == f"<hint>{hint(guess, secret)}</hint>"
        context += f"<guess>{guess}</guess>{result.observation}"
    return None


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 999).map(lambda v: f"{v:03d}"))
def test_a_policy_using_the_hints_wins_every_game_in_ten_guesses(secret):
    guesses = play(secret, use_hints=True)
    assert guesses is not None and guesses <= 10
    assert guesses == max(int(d) for d in secret) + 1   # digit d is found at guess d + 1


def test_a_policy_ignoring_the_hints_loses_nearly_every_game():
    secrets = [e["answer"] for e in guess_examples(300, seed=1)]
    wins = [play(s, use_hints=False) for s in secrets]
    assert sum(w is not None for w in wins) == sum(len(set(s)) == 1 for s in secrets) <= 6  # only 'ddd' secrets
    assert all(play(s, use_hints=True) is not None for s in secrets)


def test_hints_bad_guesses_and_bad_secrets():
    env = DigitGuess()
    env.reset({"answer": "305"})
    assert hint("395", "305") == "3.5"
    assert env.step("<guess>12</guess>").observation == "<hint>invalid</hint>"
    assert env.step("<guess>3a5</guess>").observation == "<hint>invalid</hint>"
    assert env.step("I give up") is None
    assert env.step("<guess>111</guess> <guess>305</guess>").done   # the last guess of a turn counts
    with pytest.raises(ValueError, match="'answer' must be 3 digits"):
        DigitGuess().reset({"answer": "12"})
    with pytest.raises(ValueError, match="digits must be"):
        DigitGuess(digits=0)
    assert environment_factory(EnvironmentConfig(name="guess")) is DigitGuess


class ScriptedPolicy:
    """An engine whose 'model' reads its whole context (prompt, its guesses, the hints as tokens) and guesses."""

    name = "scripted"

    def __init__(self, tokenizer, use_hints: bool) -> None:
        self.tokenizer, self.use_hints = tokenizer, use_hints

    def generate_turns(self, contexts, sampling, n, stops, seed=None):
        turns = []
        for context in contexts:
            text = self.tokenizer.decode(context, skip_special_tokens=True)
            ids = self.tokenizer(f"<guess>{next_guess(text, 3, self.use_hints)}</guess>",
                                 add_special_tokens=False)["input_ids"]
            turns.append([SampledTurn(ids, [0.0] * len(ids), "stop_string") for _ in range(n)])
        return turns


def test_rollouts_of_the_game_win_only_when_the_policy_reads_the_observation_tokens(tmp_path):
    tokenizer = build_char_tokenizer()
    path = write_guess_dataset(tmp_path / "games.jsonl", 6, seed=3)
    examples = [__import__("json").loads(line) for line in path.read_text().splitlines()]
    assert all(len(e["answer"]) == 3 and e["answer"].isdigit() for e in examples)
    cfg = EnvironmentConfig(name="guess", max_turns=10, reward="environment", max_total_tokens=512)
    prompts = [tokenizer(e["question"], add_special_tokens=False)["input_ids"] for e in examples]
    results = {}
    for use_hints in (True, False):
        runner = MultiTurnRollouts(ScriptedPolicy(tokenizer, use_hints), tokenizer, cfg)
        _, groups = runner.generate(examples, prompts, SamplingParams(temperature=1.0, max_tokens=16), 2, seed=0)
        results[use_hints] = (runner.stats, groups)
    stats, groups = results[True]
    for example, group in zip(examples, groups):
        for sample in group:
            text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
            assert sample.env_reward == 1.0 and text.endswith(f"<guess>{example['answer']}</guess>")
            assert 0 in sample.mask or example["answer"] == "000"
    turns_needed = sum(2 * (max(int(d) for d in e["answer"]) + 1) for e in examples)
    assert stats.turns == turns_needed and stats.env_errors == 0
    assert stats.trajectories == 12 and stats.trajectories_with_calls == 2 * sum(e["answer"] != "000" for e in examples)
    assert stats.env_calls == turns_needed - 12   # every guess but the winning one was answered with a hint
    assert 0 < stats.masked_fraction < 1 and stats.env_time_s > 0
    blind_stats, blind = results[False]
    blind_wins = sum(s.env_reward == 1.0 for g in blind for s in g)
    assert blind_wins == 2 * sum(len(set(e["answer"])) == 1 for e in examples) and blind_stats.turns > stats.turns
    assert blind_stats.trajectories_with_calls == 2 * sum(e["answer"] != "000" for e in examples)
