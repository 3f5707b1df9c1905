"""A vLLM worker extension that takes new policy weights: from a safetensors file, or from the learner's group.

Passed to vLLM as ``worker_extension_cls="generator.engines.vllm_worker.WeightSyncExtension"`` and called through
``llm.collective_rpc``. Only strings and numbers cross the process boundary (a path, an offer as JSON), so it
works with vLLM V1's multiprocess engine, where tensors passed through collective_rpc do not survive.

* ``load_weights_from_path(path)``: the HTTP relay's file;
* ``weight_sync_connect(offer_json)``: each worker joins the learner's group as rank ``first_rank + worker rank``,
  through vLLM's own ``stateless_init_torch_distributed_process_group`` (gloo on CPU, NCCL on GPU; the learner
  builds its side the same way, see shared/weight_sync/groups.py). vLLM 0.32's weight-transfer engines need vLLM
  on the trainer's side too (the learner's environment has no vLLM), so the group helper is what is shared;
* ``weight_sync_receive()``: one version, bucket by bucket, fed to the model's ``load_weights`` as tensors
  complete (each cloned out of the receive buffer: vLLM may hold a layer's tensors until the layer is whole).

This module is imported inside vLLM's worker processes; it must not import torch-heavy parts of grpo-stack.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
from safetensors import safe_open


def _tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    with safe_open(path, framework="pt", device="cpu") as fh:
        for name in fh.keys():
            yield name, fh.get_tensor(name)


def _refresh_embedding_kernels(model: torch.nn.Module) -> None:
    """Re-run post-load processing of (vocab-parallel) embeddings and LM heads.

    On CPU, vLLM repacks the LM head once at load time; with tied embeddings the packed copy is not rebuilt by a
    reload, so logits would silently keep the old weights. On GPU the call is a no-op.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, VocabParallelEmbedding) and method is not None and module.weight.numel() > 0:
            method.process_weights_after_loading(module)


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner``, ``self.get_model()``)."""

    _weight_receiver = None

    def _load_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            # CPU builds repack linear weights at load time; reload_weights re-runs that processing.
            runner.reload_weights(weights_iterator=iter(tensors))
        else:
            runner.model.load_weights(weights=iter(tensors))
        _refresh_embedding_kernels(self.get_model())

    def load_weights_from_path(self, path: str) -> int:
        tensors = list(_tensors(path))  # one worker's copy on CPU while loading; freed when this returns
        self._load_tensors(tensors)
        return len(tensors)

    def weight_sync_device_uuid(self) -> str | None:
        from shared.weight_sync.ipc import device_uuid

        return device_uuid(next(self.get_model().parameters()).device)

    def weight_sync_connect(self, offer_json: str) -> int:
        """Join the learner's group; returns this worker's rank in it."""
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        from shared.weight_sync.group_receiver import GroupReceiver

        offer = json.loads(offer_json)
        self.weight_sync_disconnect()
        rank = offer["first_rank"] + int(getattr(self, "rank", 0))
        group = stateless_init_torch_distributed_process_group(
            offer["host"], offer["port"], rank, offer["world_size"], offer["backend"],
            timeout=timedelta(seconds=offer["timeout_s"]))
        device = next(self.get_model().parameters()).device
        self._weight_receiver = GroupReceiver(offer, rank, device, group=group)
        return rank

    def weight_sync_receive(self) -> int:
        """Receive one version into the model; returns the version (raises if it could not be applied)."""
        if self._weight_receiver is None:
            raise RuntimeError("this worker has not joined a weight-sync group")
        return self._weight_receiver.receive(
            lambda tensors: self._load_tensors((name, tensor.clone()) for name, tensor in tensors))

    def weight_sync_disconnect(self) -> None:
        if self._weight_receiver is not None:
            self._weight_receiver.close()
            self._weight_receiver = None
