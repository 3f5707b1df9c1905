"""One base class for the errors a person can act on; the ``grpo`` CLI prints them without a traceback.

``exit_code`` says whose move it is: 2 for a problem with what was asked (a config key, a missing folder, a bad
flag), 1 for a service that had to give up (the hub stayed unreachable, the loss kept being NaN).
"""

from __future__ import annotations


class GrpoError(Exception):
    """A failure with a message fit for the user; the CLI exits with ``exit_code``."""

    exit_code = 1


class UsageError(GrpoError):
    """What the user asked for cannot work as given (the message names the setting, flag or file)."""

    exit_code = 2


class ServiceError(GrpoError):
    """A service that had to give up; the message says what it waited for."""

    exit_code = 1
