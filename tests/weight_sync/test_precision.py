"""An engine that holds the learner's weights in fewer bits is told so, once, with the numbers and the way out
(shared/weight_sync/precision.py); a real hub, a float32 learner's publisher and bfloat16 / float32 transformers
engines over the group and the HTTP relay."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from generator.engines.hf import TransformersEngine
from shared.config.schema import WeightSyncConfig
from shared.protocol.client import HubClient
from shared.weight_sync.precision import SIGNIFICANT_BITS, file_dtype, rounding_note
from shared.weight_sync.receiver import WeightReceiver
from tests.live_server import LiveServer, make_config
from tests.weight_sync.test_weight_sync import CFG, client, make_publisher, perturb, publish

FLOATS = list(SIGNIFICANT_BITS)


@pytest.mark.parametrize("published, held", list(itertools.product(FLOATS, FLOATS)))
def test_a_note_exactly_when_the_engine_keeps_fewer_significant_bits(published, held):
    note = rounding_note(published, held)
    assert (note is not None) == (SIGNIFICANT_BITS[held] < SIGNIFICANT_BITS[published])


def test_the_note_names_both_dtypes_the_bits_and_the_settings_that_fix_it():
    note = rounding_note(torch.float32, torch.bfloat16)
    assert note.startswith("the learner publishes float32 weights and this engine holds bfloat16: every version "
                           "is rounded to 8 significant bits (steps of 0.78% of a weight's size)")
    assert "generator.dtype float32" in note and "learner.precision: bf16" in note
    assert "docs/off-policy.md#precision" in note
    fp16 = rounding_note(torch.float32, torch.float16)
    assert "11 significant bits" in fp16 and "learner.precision" not in fp16  # no float16 learner to point to


@given(st.sampled_from([None, torch.int64, torch.uint8, torch.bool]), st.sampled_from(FLOATS + [None]))
def test_unknown_or_non_float_dtypes_give_no_note(odd, other):
    assert rounding_note(odd, other) is None and rounding_note(other, odd) is None


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_version_files_dtype_is_read_from_its_header(tmp_path, dtype):
    path = tmp_path / "v.safetensors"
    save_file({"steps": torch.zeros(1, dtype=torch.int64), "w": torch.ones(3, dtype=dtype)}, str(path))
    assert file_dtype(path) == dtype


def test_a_small_update_is_lost_on_the_bfloat16_grid_and_carried_by_a_few_whole_steps_off_it():
    """Why the note exists, in numbers: an Adam-sized step (lr * sign(g)) at lr 1e-5. Weights bfloat16 holds
    exactly (RMSNorm weights, any model shipped in bfloat16) keep their bfloat16 copy unchanged: the step is lost.
    Typical matrix weights (0.01-0.02) off the grid: the copy moves on average by the step, but in bfloat16 by a
    few weights jumping a whole rounding step (6e-5 to 1.2e-4) each, where float16 (7.6e-6 to 1.5e-5) moves most."""
    signs = torch.sign(torch.randn(4097, generator=torch.Generator().manual_seed(0)))
    on_grid = torch.linspace(0.5, 1.5, 4097).to(torch.bfloat16).float()
    assert torch.equal((on_grid + 1e-5 * signs).to(torch.bfloat16), on_grid.to(torch.bfloat16))
    weights = torch.linspace(0.01, 0.02, 4097)
    moved = weights + 1e-5 * signs
    for dtype, changed_range in ((torch.bfloat16, (0.05, 0.3)), (torch.float16, (0.7, 1.0))):
        step = moved.to(dtype).float() - weights.to(dtype).float()
        changed = float((step != 0).float().mean())
        assert changed_range[0] < changed <= changed_range[1], (dtype, changed)
        kept = float((step * signs).mean() / 1e-5)  # the update's share the copy keeps, on average
        assert 0.8 < kept < 1.2, (dtype, kept)


class Generator:
    def __init__(self, model_dir, url, tmp_path, dtype, **overrides):
        self.engine = TransformersEngine(model_dir, dtype=dtype)
        self.receiver = WeightReceiver(self.engine, client(url), WeightSyncConfig(**{**CFG, **overrides}),
                                       f"gen-{dtype}", tmp_path / f"w-{dtype}")

    def sync_until(self, version, have=0, tries=1500):
        import time
        for _ in range(tries):
            latest = self.receiver.sync(have)
            have = latest if latest is not None else have
            if have >= version:
                return have
            time.sleep(0.02)
        raise AssertionError(f"never reached version {version}")


@pytest.mark.slow
def test_a_bfloat16_engine_is_warned_once_over_the_group_and_holds_the_rounded_weights(
        tiny_model_dir, tmp_path, caplog):
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with LiveServer(make_config(tmp_path)) as live:
        publisher = make_publisher(learner, live.url)
        try:
            gens = [Generator(tiny_model_dir, live.url, tmp_path, dtype) for dtype in (torch.bfloat16, torch.float32)]
            with caplog.at_level("WARNING", logger="grpo.generator.weights"):
                for version in (1, 2):
                    perturb(learner, version)
                    publish(publisher, version)
                    for gen in gens:
                        gen.sync_until(version, have=version - 1)
            notes = [r.getMessage() for r in caplog.records if "significant bits" in r.getMessage()]
            assert notes == ["weight sync: " + rounding_note(torch.float32, torch.bfloat16)]  # once, bf16 only
            assert [g.receiver.transport for g in gens] == ["collective", "collective"]
            held = dict(gens[0].engine.model.named_parameters())
            for name, param in learner.named_parameters():  # round to nearest: what the note describes
                assert torch.equal(held[name], param.detach().to(torch.bfloat16)), name
        finally:
            publisher.close()


@pytest.mark.slow
def test_a_bfloat16_engine_loading_a_float32_version_from_the_relay_is_warned(tiny_model_dir, tmp_path, caplog):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "v1.safetensors"))
    with LiveServer(make_config(tmp_path)) as live:
        HubClient(live.url).upload_weights(1, tmp_path / "v1.safetensors")
        gens = [Generator(tiny_model_dir, live.url, tmp_path, dtype, transport="http")
                for dtype in (torch.bfloat16, torch.float32)]
        with caplog.at_level("WARNING", logger="grpo.generator.weights"):
            assert [g.sync_until(1) for g in gens] == [1, 1]
    notes = [r.getMessage() for r in caplog.records if "significant bits" in r.getMessage()]
    assert notes == ["weight sync: " + rounding_note(torch.float32, torch.bfloat16)]
