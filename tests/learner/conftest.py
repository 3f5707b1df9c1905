import pytest
import torch


@pytest.fixture(autouse=True)
def restore_functional_linear():
    """ZeRO-3 replaces torch.nn.functional.linear process-wide ("memory efficient linear", meant to last for a
    learner process); put it back so later tests in this pytest process run plain torch."""
    original = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = original
