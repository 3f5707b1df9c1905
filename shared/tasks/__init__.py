"""Task registry: a config names a task (``task: arithmetic``) and its keyword arguments.

A task factory takes keyword arguments straight from the config and returns a task object with ``sample``,
``split_of`` and ``score``; an unknown name fails with the list of known ones (see ``shared.registry``).
"""

from __future__ import annotations

from shared.registry import Registry
from shared.tasks.arithmetic import ArithmeticTask

TASKS = Registry("task")


@TASKS.register("arithmetic")
def make_arithmetic(**kwargs: object) -> ArithmeticTask:
    return ArithmeticTask(**kwargs)


__all__ = ["TASKS", "ArithmeticTask", "make_arithmetic"]
