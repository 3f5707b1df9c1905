import pytest
import torch

from learner.engine import ensure_single_process_env, init_distributed
from tests.process_env import process_group_env_restored


@pytest.fixture(autouse=True)
def restore_functional_linear():
    """ZeRO-3 replaces torch.nn.functional.linear process-wide ("memory efficient linear", meant to last for a
    learner process); put it back so later tests in this pytest process run plain torch."""
    original = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = original


@pytest.fixture(scope="module")
def distributed():
    """A process group of one; the RANK/MASTER_PORT variables it needs are removed afterwards, so that learners
    started as subprocesses by later test modules do not inherit a port this process holds."""
    with process_group_env_restored():
        ensure_single_process_env()
        init_distributed(torch.device("cpu"))
        yield
