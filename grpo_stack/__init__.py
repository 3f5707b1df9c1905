"""grpo-stack's Python API: ``from grpo_stack import train`` (docs/python-api.md).

:func:`train` is ``grpo run`` called from Python: the same config, the same services started the same way, and the
run's result returned (:class:`RunResult`) or its failure raised (:class:`RunFailed`).
"""

from grpo_stack.api import RunFailed, RunResult, train

__all__ = ["RunFailed", "RunResult", "train"]
