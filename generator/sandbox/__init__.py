"""The code sandbox: run model-written code against tests so that the policy cannot forge the verdict.

The package, by side of the process boundary (docs/reward-hacks.md explains the design):

* :mod:`generator.sandbox.run`: the parent: picks the isolation level, starts the launcher, reads the values
  back and counts the tests that pass (:func:`run_tests`);
* :mod:`generator.sandbox.verdict`: the parent's judge: splits each test into what the sandbox evaluates and
  what the parent checks, and decides from plain values only;
* :mod:`generator.sandbox.child`: the two programs that run in the child process (the trusted launcher and the
  runner), standard library only, started by path as ``python -I -S child.py``.
"""

from generator.sandbox.run import (
    LEVELS,
    STARTUP_GRACE_S,
    SandboxLimits,
    TestRun,
    describe,
    extract_code,
    isolation_level,
    run_tests,
)

__all__ = ["LEVELS", "STARTUP_GRACE_S", "SandboxLimits", "TestRun", "describe", "extract_code",
           "isolation_level", "run_tests"]
