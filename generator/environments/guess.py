"""The feedback game: guess a hidden number; after each guess the environment shows which digits are right in place.

The model writes ``<guess>385</guess>``; the environment answers ``<hint>3.5</hint>`` (the right digits where they
stand, ``.`` elsewhere). The hint says nothing about the digits it hides, so a policy that wins quickly must keep
what earlier hints revealed and change only the other positions: later turns have to use earlier observations.
A right guess ends the trajectory with reward 1 (``reward: environment``); a turn without a guess ends it with 0;
a malformed guess is answered ``<hint>invalid</hint>`` (the model sees it). With ``digits`` digits the informed
policy needs at most 10 guesses, blind guessing wins a turn with probability ``10 ** -digits``.

Prompts come from :func:`guess_examples` (a JSONL dataset: ``write_guess_dataset``); the secret is the example's
``answer`` field (``args.secret_field``).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from generator.environments.base import ENVIRONMENTS, StepResult

_GUESS = re.compile(r"<guess>(.*?)</guess>", re.DOTALL)
PROMPT = "Guess the {digits}-digit number. Write <guess>{example}</guess>, each hint shows the right digits.\n"


def hint(guess: str, secret: str) -> str:
    """The right digits of ``guess`` where they stand, ``.`` elsewhere (same lengths; characters the tiny
    model's tokenizer has, which lacks ``_``)."""
    return "".join(g if g == s else "." for g, s in zip(guess, secret))


@ENVIRONMENTS.register("guess")
class DigitGuess:
    """One trajectory's game. ``args``: ``digits`` (length of the secret), ``secret_field`` (the example's key)."""

    stop = ["</guess>"]

    def __init__(self, digits: int = 3, secret_field: str = "answer") -> None:
        if not isinstance(digits, int) or not 1 <= digits <= 12:
            raise ValueError(f"digits must be an integer from 1 to 12, got {digits!r}")
        self.digits, self.secret_field = digits, secret_field
        self.secret = ""
        self.guesses = 0

    def reset(self, sample: dict[str, Any]) -> str | None:
        secret = str(sample.get(self.secret_field, ""))
        if len(secret) != self.digits or not secret.isdigit():
            raise ValueError(f"the example's {self.secret_field!r} must be {self.digits} digits, got {secret!r}")
        self.secret = secret
        return None

    def step(self, model_turn_text: str) -> StepResult | None:
        guesses = _GUESS.findall(model_turn_text)
        if not guesses:
            return None   # no guess: the model gave up; the trajectory ends with no reward
        guess = guesses[-1].strip()
        self.guesses += 1
        if len(guess) != self.digits or not guess.isdigit():
            return StepResult(observation="<hint>invalid</hint>", reward=0.0)
        if guess == self.secret:
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=f"<hint>{hint(guess, self.secret)}</hint>", reward=0.0)


def guess_examples(count: int, digits: int = 3, seed: int = 0) -> list[dict[str, str]]:
    """``count`` games: the prompt as ``question``, a random secret (leading zeros allowed) as ``answer``."""
    rng = random.Random(seed)
    example = "".join(str(d) for d in range(1, digits + 1))[:digits].rjust(digits, "0")
    return [{"question": PROMPT.format(digits=digits, example=example),
             "answer": "".join(rng.choice("0123456789") for _ in range(digits))} for _ in range(count)]


def write_guess_dataset(path: str | Path, count: int, digits: int = 3, seed: int = 0) -> Path:
    """A JSONL dataset of games for ``generator.dataset: {kind: jsonl, path: ...}``."""
    path = Path(path)
    path.write_text("".join(json.dumps(e) + "\n" for e in guess_examples(count, digits, seed)))
    return path
