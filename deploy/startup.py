"""Service start-up: importing transformers' model classes without the optional packages no service uses.

transformers imports scikit-learn whenever it is installed (for assisted decoding's confidence threshold, which no
service uses), and with it scipy and pandas, and scipy itself for object-detection losses: ~1.9 s of CPU in every
process that loads a model, paid by the learner and each generator at once on the same cores while a run starts.
(lm-evaluation-harness, a dev dependency, brings both into the environment.) The services therefore import the model classes once, at start, with those
packages hidden; they are visible again afterwards, so a user's reward function that imports scikit-learn still
gets it. ``python -X importtime -m deploy.cli generator ...`` shows what is left.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

# imported by transformers only if installed; never needed by the services
OPTIONAL_FOR_SERVICES = ("sklearn", "scipy")


@contextmanager
def hidden_modules(names: tuple[str, ...]) -> Iterator[None]:
    """Make ``import name`` fail (and ``importlib.util.find_spec(name)`` return None) inside the block, for
    modules not imported yet; restored afterwards."""
    hidden = [name for name in names if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's own "not available" marker
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]


def import_model_classes() -> None:
    """Import transformers' auto model classes (and everything they pull in) without OPTIONAL_FOR_SERVICES."""
    with hidden_modules(OPTIONAL_FOR_SERVICES):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
