"""The learner's step waits for the device once: every op that would make the host wait for a GPU is recorded.

On a GPU, each ``.item()`` / ``int(t)`` / ``.tolist()`` / ``.cpu()`` of a device tensor, each ``nonzero`` (also hidden
in ``x[bool_mask]``), ``masked_select``, ``unique`` and ``repeat_interleave`` without ``output_size`` blocks the host
until the device's queue has drained, so no further kernels are queued while the GPU works. This machine has no GPU,
so the ops are caught where they are dispatched (a ``TorchDispatchMode``) and, for reads that do not dispatch an op
on a CPU tensor (``tolist``, ``numpy``, ``cpu``), by wrapping those methods. Each is attributed to the innermost stack
frame outside torch: this project's ``learner/`` or ``shared/``, DeepSpeed, or transformers.

What the step's own code may do: one copy to the host per step (``_gather_step_numbers``' ``tolist``). What the
libraries do in a recorded steady-state step (DeepSpeed 0.19.8 ZeRO-0 fp32 with torch's AdamW and ``grad_clip`` 1.0,
transformers 5.19 with SDPA attention, torch 2.13; the tiny Llama, 20 parameter tensors, two micro-batches; printed
with ``-s``), not ours to change and only reported here:

* DeepSpeed ``engine.step`` -> ``_take_model_step`` -> torch AdamW ``_get_value(step)``: one ``_local_scalar_dense``
  per parameter tensor (20). These step counters live on the CPU for this (non-fused) AdamW, so on a GPU they are
  host reads, not device waits; the GPU config uses fused AdamW, whose counters are not read back. DeepSpeed's fp32
  gradient clipping at ZeRO-0 reads nothing.
* transformers ``masking_utils._ignore_causal_mask_sdpa``: ``fast_all(padding_mask)`` to decide whether SDPA can
  skip the mask: 2 reads per padded forward with padding (4 per step here), 1 per micro-batch with prefix sharing
  (the prompt pass).
* transformers ``masking_utils.find_packed_sequence_indices``: reads whether the position ids hold several rows,
  1 per packed forward (4 per step with pi_old recomputed: two forwards per micro-batch).
"""

from __future__ import annotations

import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import shared.forward.packing
from learner.step import apply_off_policy, grpo_step, recompute_old_logprobs, split_micro_batches
from shared.config.schema import LossConfig, OffPolicyConfig

from .batches import advantages_of, batch_of, sampled_groups
from .test_step import CPU, make_engine

ROOT = Path(__file__).resolve().parents[2]
OURS = ("learner", "shared")
THIS_FILE = str(Path(__file__).resolve())

# ops whose CUDA kernels copy a data-dependent value (a scalar, a count, a size) to the host
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
               "unique_consecutive", "unique_dim_consecutive", "equal"}
BOOLEAN_INDEXING_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
HOST_READS = ("tolist", "numpy", "cpu")
# frames between an op's caller and the dispatch mode (not where the op came from)
DISPATCH_MACHINERY = ("/torch/_dynamo/", "/torch/_compile.py", "/torch/utils/_python_dispatch.py", "/torch/_ops.py")


def _owner() -> tuple[str, str]:
    """(``project`` | ``deepspeed`` | ``transformers`` | ``torch``, ``file:line``) of the innermost frame outside
    torch and this test that led to the current op."""
    frames = [f for f in traceback.extract_stack()[:-2]
              if f.filename != THIS_FILE and not any(part in f.filename for part in DISPATCH_MACHINERY)]
    innermost_torch = ""
    for frame in reversed(frames):
        path = Path(frame.filename)
        where = f"{frame.filename.split('/site-packages/')[-1]}:{frame.lineno} {frame.name}"
        via = f" (via {innermost_torch})" if innermost_torch else ""
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in OURS:
            return "project", f"{path.relative_to(ROOT)}:{frame.lineno} {frame.name}{via}"
        for library in ("deepspeed", "transformers"):
            if f"/{library}/" in frame.filename:
                return library, where + via
        if not innermost_torch and "/torch/" in frame.filename:
            innermost_torch = where
    return "torch", innermost_torch or "?"


class SyncRecorder(TorchDispatchMode):
    """Records every op that would wait for a CUDA device, with its owner (see :func:`_owner`)."""

    def __init__(self):
        super().__init__()
        self.events: list[tuple[str, str, str]] = []  # (owner, what, where)
        self.active = False

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def record(self, what: str) -> None:
        if self.active:
            owner, where = _owner()
            self.events.append((owner, what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.record(name)
        elif name in BOOLEAN_INDEXING_OPS and _has_boolean_index(args):
            self.record(f"{name} with a boolean mask (nonzero)")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and _has_tensor_repeats(func, args):
            self.record("repeat_interleave without output_size")
        return func(*args, **kwargs)

    def ours(self) -> list[tuple[str, str]]:
        return [(what, where) for owner, what, where in self.events if owner == "project"]

    def theirs(self) -> Counter:
        return Counter((owner, what, where) for owner, what, where in self.events if owner != "project")


def _has_boolean_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _has_tensor_repeats(func, args) -> bool:
    return func.overloadpacket.__name__ == "repeat_interleave" and any(isinstance(a, torch.Tensor) for a in args)


@pytest.fixture
def recorder(monkeypatch):
    """A :class:`SyncRecorder` whose events also get the host reads that dispatch no op on a CPU tensor."""
    rec = SyncRecorder()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _original=original, _name=name, **kwargs):
            rec.record(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, read)
    return rec


def _batch(tiny_model_dir):
    groups = sampled_groups(tiny_model_dir, [[1.0, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 1.0]], seed=1, max_tokens=8)
    batch = batch_of(groups)
    # mixed lengths, so that the packed layout has padding to remove
    batch.completion_lengths = torch.minimum(batch.completion_lengths, torch.tensor([8, 3, 6, 1, 7, 2, 8, 5]))
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("prefix_sharing, packing, old_mode", [
    ("off", "padded", "behaviour"),
    ("on", "padded", "behaviour"),
    ("off", "packed", "recompute"),
])
def test_the_step_waits_for_the_device_once(distributed, tiny_model_dir, recorder, monkeypatch, prefix_sharing,
                                            packing, old_mode):
    """Two micro-batches through ``grpo_step`` (entropy logged; the recompute case also recomputes pi_old and applies
    a masking off-policy correction, whose kept-token normalisers stay on the device; drift metrics by version lag,
    per-token version lags):
    exactly one read of a device value from learner/ and shared/ per step (the step's numbers),
    and no nonzero / masked_select / unique / boolean indexing from them. The first step warms up what is done once
    per process (the packing probe); the second is recorded."""
    batch = _batch(tiny_model_dir)
    engine = make_engine(tiny_model_dir, lr=1e-3, micro_batches=2, groups_per_step=2, grad_clip=1.0,
                         old_logprobs=old_mode)
    batch.policy_versions = torch.tensor([0, 1, 2, 2, 0, 1, 3, 3])
    # per-token versions (a continuous generator's): each row moves one version on after its second token
    batch.token_versions = (batch.policy_versions[:, None]
                            + (torch.arange(batch.behaviour_logprobs.shape[1]) >= 2).long()).clamp(max=3)
    micro = split_micro_batches(batch, advantages_of(batch), 2, False, CPU, packing=packing,
                                prefix_sharing=prefix_sharing, learner_version=3)
    assert all((mb.prefix is not None) == (prefix_sharing == "on") for mb in micro)
    packed_calls = []
    pack_rows = shared.forward.packing.pack_rows
    monkeypatch.setattr("shared.forward.logprobs.pack_rows", lambda *a, **k: packed_calls.append(1) or pack_rows(*a, **k))
    loss_cfg = LossConfig(beta=0.0)

    def step():
        if old_mode == "recompute":
            recompute_old_logprobs(engine.module, micro, 1.0, None)
            apply_off_policy(micro, OffPolicyConfig(mode="token_mask", low=0.9, high=1.1))
        return grpo_step(engine, micro, loss_cfg, temperature=1.0, old_mode=old_mode, world_size=1,
                         log_entropy=True, chunk_tokens=None, lag_buckets=4)

    assert step().finite
    with recorder:
        outcome = step()
    assert outcome.finite and outcome.metrics["entropy"] > 0 and "mismatch_kl/lag_3" in outcome.metrics
    assert outcome.metrics["token_version_spread_max"] == 1.0 and outcome.metrics["token_version_lag_mean"] > 0
    assert bool(packed_calls) == (packing == "packed")
    theirs = recorder.theirs()
    print(f"\n{prefix_sharing=} {packing=} {old_mode=}: outside the project, per step:")
    for (owner, what, where), count in sorted(theirs.items()):
        print(f"  {count:3d} x {owner:12s} {what:40s} {where}")
    ours = recorder.ours()
    print(f"  project: {ours}")
    assert [what for what, _ in ours] == ["tolist"], ours
    assert ours[0][1].startswith("learner/step.py") and "_gather_step_numbers" in ours[0][1], ours


def test_the_recorder_sees_each_kind_of_device_wait(recorder):
    """The detector itself: without this, a torch upgrade that renamed an op would let the step test pass blind."""
    from shared.tensors.masks import lengths_to_mask

    x, mask, counts = torch.arange(6.0), torch.arange(6) % 2 == 0, torch.tensor([1, 2])
    with recorder:
        _ = x[mask]
        x[mask] = 0.0
        _ = x.nonzero()
        _ = torch.masked_select(x, mask)
        _ = torch.unique(counts)
        _ = counts.repeat_interleave(counts)
        _ = counts.repeat_interleave(counts, output_size=3)  # the size given: no wait
        _ = float(x.sum()), x.tolist(), x.cpu()
        lengths_to_mask(counts)  # project code: reads the lengths to check them
    kinds = [what for _, what, _ in recorder.events]
    assert kinds[:8] == ["index with a boolean mask (nonzero)", "index_put_ with a boolean mask (nonzero)", "nonzero",
                         "masked_select", "_unique2", "repeat_interleave without output_size",
                         "_local_scalar_dense", "tolist"], kinds
    assert [what for what, _ in recorder.ours()] == ["_local_scalar_dense", "_local_scalar_dense"], recorder.events
