"""A user environment (loaded as 'tests/generator/long_reset_env.py:LongReset') whose reset() text is ``length``
characters: its own per trajectory (appended as environment tokens), or, ``shared``, the same for every
trajectory of a group (joined to the prompt)."""

import itertools

_numbers = itertools.count()


class LongReset:
    stop = []

    def __init__(self, length: int = 300, shared: bool = False) -> None:
        self.length, self.shared = length, shared

    def reset(self, sample):
        head = "" if self.shared else f"{next(_numbers):08d}"
        return (head + "1+2=3 " * self.length)[:self.length]

    def step(self, text):
        return None
