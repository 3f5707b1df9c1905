"""The process-group variables a learner built in-process writes into os.environ, and a way to put them back."""

import os
from contextlib import contextmanager

# what learner.engine.ensure_single_process_env sets for a world of one
PROCESS_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextmanager
def process_group_env_restored():
    """Restore the process-group variables on exit: a `grpo learner` subprocess started later inherits os.environ,
    and with a leaked RANK/WORLD_SIZE it would reuse a MASTER_PORT this process's own store still listens on
    (EADDRINUSE) instead of picking a free one."""
    saved = {key: os.environ.get(key) for key in PROCESS_GROUP_ENV}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
