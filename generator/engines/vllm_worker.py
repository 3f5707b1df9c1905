"""A vLLM worker extension that loads new policy weights from a safetensors file on disk.

Passed to vLLM as ``worker_extension_cls="generator.engines.vllm_worker.WeightSyncExtension"`` and called with
``llm.collective_rpc("load_weights_from_path", args=(path,))``. Only a path crosses the process boundary, so it
works with vLLM V1's multiprocess engine, where tensors passed through collective_rpc do not survive.

This module is imported inside vLLM's worker processes; it must not import torch-heavy parts of grpo-stack.
"""

from __future__ import annotations

from collections.abc import Iterator

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

    def load_weights_from_path(self, path: str) -> int:
        tensors = list(_tensors(path))  # one worker's copy on CPU while loading; freed when this returns
        runner = self.model_runner
        if hasattr(runner, "reload_weights"):
            # CPU builds repack linear weights at load time; reload_weights re-runs that processing.
            runner.reload_weights(weights_iterator=iter(tensors))
        else:
            runner.model.load_weights(weights=iter(tensors))
        _refresh_embedding_kernels(self.get_model())
        return len(tensors)
