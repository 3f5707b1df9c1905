"""Service start-up imports transformers' model classes without scikit-learn and scipy (and pandas with them),
which transformers would otherwise import whenever they are installed; a reward function can still import them."""

import importlib.util
import subprocess
import sys

import pytest

from deploy.startup import hidden_modules

CHECK = """
import sys
from deploy.startup import import_model_classes
import_model_classes()
import transformers.models.llama.modeling_llama  # a model class as the services load it
print(sorted(m for m in ("sklearn", "scipy", "pandas") if m in sys.modules))
import scipy.optimize, sklearn  # visible again
print("sklearn" in sys.modules and "scipy" in sys.modules)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="scikit-learn is not installed here")
def test_model_classes_import_without_sklearn_which_stays_importable():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_hidden_modules_hides_only_inside_the_block():
    name = "grpo_stack_surely_absent_module"
    with hidden_modules(("json", name)):
        assert importlib.util.find_spec(name) is None
        with pytest.raises(ImportError):
            __import__(name)
        import json  # already imported before the block: left alone

        assert json.dumps([1]) == "[1]"
    assert name not in sys.modules and sys.modules["json"] is not None
