"""shared/weight_sync/engine_load.py: the one load step of the receiver and the evaluator, by kind and poison."""

import pytest
import torch
from safetensors.torch import save_file

from shared.weight_sync.engine_load import NonFiniteWeights, WeightSyncError, load_version_file
from shared.weight_sync.layout import KIND_ADAPTER, KIND_FULL, KIND_KEY


class RecordingEngine:
    name = "recording"

    def __init__(self, adapters: bool = True) -> None:
        self.calls: list[tuple[str, str]] = []
        if adapters:
            self.apply_adapter = lambda path: self.calls.append(("adapter", str(path)))

    def load_weights(self, path) -> None:
        self.calls.append(("full", str(path)))


def write(path, kind: str | None, value: float = 1.0):
    tensors = {"a.weight": torch.full((2, 3), 0.5), "b.weight": torch.tensor([0.0, value])}
    save_file(tensors, str(path), metadata=None if kind is None else {KIND_KEY: kind})
    return path


@pytest.mark.parametrize("kind, expected", [(None, "full"), (KIND_FULL, "full"), (KIND_ADAPTER, "adapter")])
def test_a_version_is_loaded_as_what_its_metadata_says(tmp_path, kind, expected):
    engine = RecordingEngine()
    path = write(tmp_path / "v3.safetensors", kind)
    assert load_version_file(engine, path, 3) is (expected == "adapter")
    assert engine.calls == [(expected, str(path))]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", [KIND_FULL, KIND_ADAPTER])
def test_a_poisoned_version_reaches_no_engine_and_names_its_tensor(tmp_path, bad, kind):
    engine = RecordingEngine()
    with pytest.raises(NonFiniteWeights, match=r"weights version 7 holds NaN/inf \(tensor b.weight\)") as caught:
        load_version_file(engine, write(tmp_path / "v7.safetensors", kind, bad), 7)
    assert (caught.value.version, caught.value.tensor) == (7, "b.weight") and engine.calls == []


def test_an_adapter_for_an_engine_without_adapters_is_refused_with_the_way_out(tmp_path):
    engine = RecordingEngine(adapters=False)
    with pytest.raises(WeightSyncError, match=r"version 2 is a LoRA adapter .*recording engine cannot apply "
                       r"adapters: set learner.lora.publish: merged"):
        load_version_file(engine, write(tmp_path / "v2.safetensors", KIND_ADAPTER), 2)
    assert engine.calls == []
