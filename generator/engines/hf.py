"""The transformers engine: ``model.generate`` on CPU (or one GPU), for machines without vLLM and for tests."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from generator.engines.base import SampledCompletion, SampledTurn
from shared.protocol.records import SamplingParams
from shared.weight_sync.adapter import AdapterApplier, AdapterError

log = logging.getLogger("grpo.generator.hf")


class WeightLoadError(RuntimeError):
    """A weights file that does not fit the model (unknown names, wrong shapes, missing tensors)."""


def load_safetensors_into(model: torch.nn.Module, path: str | Path) -> int:
    """Copy each tensor of ``path`` into the parameter/buffer of the same name, one tensor at a time (so memory
    never holds a second full state dict). Every parameter must be covered, except tied copies."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers()))
    seen: set[int] = set()
    with safe_open(str(path), framework="pt") as fh, torch.no_grad():
        names = list(fh.keys())
        unknown = [n for n in names if n not in state]
        if unknown:
            raise WeightLoadError(f"{path}: tensors not in the model: {unknown[:5]}")
        for name in names:
            target = state[name]
            tensor = fh.get_tensor(name)
            if tensor.shape != target.shape:
                raise WeightLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, model has {tuple(target.shape)}")
            target.copy_(tensor.to(dtype=target.dtype, device=target.device))
            seen.add(id(target))
    missing = [n for n, p in model.named_parameters() if id(p) not in seen]
    if missing:
        raise WeightLoadError(f"{path}: no values for {missing[:5]}")
    return len(names)


def stop_string_end(decode: Callable[[list[int]], str], ids: list[int], stops: list[str], start: int = 0) -> int | None:
    """The index of the first token (from ``start``) that completes one of ``stops`` in ``decode(ids)``, or None.
    Only a window of recent tokens is decoded at each position: a token holds at least one character of the text
    (the character tokenizer, byte-level BPE), so ``len(stop) + 4`` tokens always cover a stop string."""
    window = max(len(s) for s in stops) + 4
    for k in range(start, len(ids)):
        tail = decode(ids[max(0, k + 1 - window):k + 1])
        if any(s in tail for s in stops):
            return k
    return None


def _turn_stop_check(decode: Callable[[list[int]], str], stops: list[str]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``stopped`` for :func:`sample_with_logprobs`: rows whose newest token completes a stop string."""
    def stopped(tokens: torch.Tensor) -> torch.Tensor:
        last = tokens.shape[1] - 1
        rows = tokens.cpu().tolist()
        return torch.tensor([stop_string_end(decode, row, stops, start=last) is not None for row in rows],
                            dtype=torch.bool)
    return stopped


def left_padded(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id sequences as one batch [B, longest] padded on the left (generation continues right after each
    one) and its attention mask (0 on the padding); on the CPU."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, sequence in enumerate(sequences):
        input_ids[i, width - len(sequence):] = torch.tensor(sequence)
        attention[i, width - len(sequence):] = 1
    return input_ids, attention


class TurnSampling:
    """Multi-turn: one turn of many trajectories (generator/multiturn.py). A mixin of TransformersEngine."""

    def generate_turns(self, contexts: list[list[int]], sampling: SamplingParams, n: int, stops: list[str],
                       seed: int | None = None) -> list[list[SampledTurn]]:
        """For each context (a trajectory so far: prompt, model turns and observations as token ids), ``n`` turns,
        each ending at EOS (included), at the token that completes a stop string (included), or after
        ``sampling.max_tokens`` tokens; the contexts are decoded together as one batch per chunk."""
        if seed is not None:
            torch.manual_seed(seed)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        stopped = _turn_stop_check(decode, stops) if stops else None
        per_call = max(1, self.max_batch_sequences // max(n, 1))
        results: list[list[SampledTurn]] = []
        for start in range(0, len(contexts), per_call):
            chunk = contexts[start:start + per_call]
            input_ids, attention = left_padded(chunk, self.pad_id)
            with torch.no_grad():
                tokens, logprobs = sample_with_logprobs(self.model, input_ids.to(self.device),
                                                        attention.to(self.device), n, sampling,
                                                        sorted(self.eos_ids), self.pad_id, stopped)
            tokens, logprobs = tokens.cpu(), logprobs.cpu()
            for i in range(len(chunk)):
                turns = []
                for j in range(n):
                    ids = tokens[i * n + j].tolist()
                    eos = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
                    stop = stop_string_end(decode, ids[:eos], stops) if stops else None
                    if stop is not None:
                        end, ended = stop + 1, "stop_string"
                    elif eos is not None:
                        end, ended = eos + 1, "eos"
                    else:
                        end, ended = len(ids), "length"
                    turns.append(SampledTurn(ids[:end], logprobs[i * n + j, :end].tolist(), ended))
                results.append(turns)
        return results


class TransformersEngine(TurnSampling):
    name = "transformers"

    def __init__(self, model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 max_batch_sequences: int = 256) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None} or {self.tokenizer.eos_token_id}
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else next(iter(self.eos_ids))
        self._adapters = AdapterApplier(self.model, model_dir)  # learner.lora.publish: adapter

    @property
    def weights_dtype(self) -> torch.dtype:
        """What each received version is rounded to (shared/weight_sync/precision.py)."""
        return self.model.dtype

    def load_weights(self, path: Path) -> None:
        count = load_safetensors_into(self.model, path)
        self._adapters.full_weights_loaded()
        log.info("loaded %d tensors from %s", count, path)

    def apply_adapter(self, path: Path) -> None:
        """A LoRA adapter version: each adapted layer becomes base + scaling * B @ A (shared/weight_sync/adapter.py)."""
        try:
            count = self._adapters.apply(path)
        except AdapterError as exc:
            raise WeightLoadError(str(exc)) from None
        log.info("applied a LoRA adapter to %d layers from %s", count, path)

    # -- weight sync through a group with the learner (shared/weight_sync/receiver.py) ---------------------
    weight_sync_workers = 1
    weight_group_adapters = True  # applies LoRA adapter versions received over a group or CUDA IPC
    _weight_group = None

    def device_uuid(self) -> str | None:
        from shared.weight_sync.ipc import device_uuid

        return device_uuid(self.device)

    def connect_weight_group(self, offer: dict) -> None:
        """Join the learner's group as rank ``first_rank`` (after checking the offered layout fits the model)."""
        from shared.weight_sync.group_receiver import GroupReceiver, check_layout_fits
        from shared.weight_sync.layout import Layout

        problem = check_layout_fits(self.model, Layout.from_json(offer["layout"]), self._adapters)
        if problem is not None:
            raise WeightLoadError(f"the learner's weights do not fit this model: {problem}")
        self.disconnect_weight_group()
        self._weight_group = GroupReceiver(offer, offer["first_rank"], self.device)

    def receive_weight_version(self) -> int:
        """Take one version from the group straight into the model's parameters (one bucket at a time), or an
        adapter version onto the base (shared/weight_sync/adapter.py)."""
        from shared.weight_sync.group_receiver import copy_into_module

        if self._weight_group is None:
            raise RuntimeError("not connected to a weight-sync group")

        def load_full(tensors) -> None:
            self._adapters.full_weights_loaded()
            copy_into_module(self.model, tensors)

        return self._weight_group.receive(load_full, self._adapters.apply_tensors)

    def disconnect_weight_group(self) -> None:
        if self._weight_group is not None:
            self._weight_group.close()
            self._weight_group = None

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, n: int,
                 seed: int | None = None) -> list[list[SampledCompletion]]:
        if seed is not None:
            torch.manual_seed(seed)
        per_call = max(1, self.max_batch_sequences // max(n, 1))
        results: list[list[SampledCompletion]] = []
        for start in range(0, len(prompts), per_call):
            results += self._generate_chunk(prompts[start:start + per_call], sampling, n)
        return results

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], sampling: SamplingParams, n: int):
        input_ids, attention = left_padded(prompts, self.pad_id)
        tokens, token_logprobs = sample_with_logprobs(
            self.model, input_ids.to(self.device), attention.to(self.device), n, sampling, sorted(self.eos_ids),
            self.pad_id)
        tokens, token_logprobs = tokens.cpu(), token_logprobs.cpu()  # one copy per chunk, [B*n, steps] each
        results = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                row = i * n + j
                ids = tokens[row].tolist()
                stop = next((k for k, t in enumerate(ids) if t in self.eos_ids), None)
                length = stop + 1 if stop is not None else len(ids)
                group.append(SampledCompletion(ids[:length], token_logprobs[row, :length].tolist(),
                                               "stop" if stop is not None else "length"))
            results.append(group)
        return results


# How often (in decoding steps) the loop asks whether every row has stopped: on an accelerator each ask waits for
# the device, so it asks every few steps; on the CPU an ask costs nothing and every step past the last EOS is a
# whole forward of the batch, so it asks at every step.
STOP_CHECK_EVERY = 8


def stop_check_interval(device: torch.device) -> int:
    return 1 if device.type == "cpu" else STOP_CHECK_EVERY


def filter_logits(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``generate``'s sampling filters in its order (top-k, then top-p on what is left), on logits / temperature:
    removed tokens get -inf. At least one token always stays."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=False)
        drop_sorted = sorted_logits.softmax(-1).cumsum(-1) <= (1 - top_p)
        drop_sorted[..., -1:] = False
        scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scaled


@torch.no_grad()
def sample_with_logprobs(model, input_ids: torch.Tensor, attention: torch.Tensor, n: int, sampling: SamplingParams,
                         eos_ids: list[int], pad_id: int, stopped: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode ``n`` completions of each left-padded prompt with the KV cache; returns the tokens [B*n, steps] and
    each sampled token's logprob under log_softmax(logits / T) over the whole vocabulary (T = 1 when greedy).

    Memory is bounded by one step's logits ([B*n, V]), never [B*n, steps, V]: the logprob of the sampled token is
    gathered as soon as it is drawn. The prompt is encoded once and its cache repeated n times. Everything stays on
    the model's device; the host is asked whether all rows stopped every :func:`stop_check_interval` steps.
    Rows past their EOS get ``pad_id`` (logprob 0), as ``generate`` pads them. ``stopped`` (multi-turn stop
    strings): called with the tokens so far ``[B*n, step + 1]`` after every step, True for rows that must stop there
    (like an EOS; it reads the tokens back to the host at every step).
    """
    greedy = sampling.temperature == 0
    temperature = 1.0 if greedy else sampling.temperature
    device = input_ids.device
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    logits = out.logits[:, -1, :]
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
        attention = attention.repeat_interleave(n, dim=0)
        positions = positions.repeat_interleave(n, dim=0)
    rows = logits.shape[0]
    steps = sampling.max_tokens
    tokens = torch.full((rows, steps), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, steps), dtype=torch.float32, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    next_position = positions[:, -1:] + 1
    check_every = stop_check_interval(device)
    for step in range(steps):
        scaled = logits.float() / temperature
        log_probs = scaled.log_softmax(-1)
        if greedy:
            chosen = scaled.argmax(-1)
        else:
            probs = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)
            chosen = torch.multinomial(probs, 1).squeeze(-1)
        chosen = chosen.masked_fill(finished, pad_id)
        tokens[:, step] = chosen
        logprobs[:, step] = log_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).masked_fill(finished, 0.0)
        finished |= torch.isin(chosen, eos)
        if stopped is not None:
            finished |= stopped(tokens[:, :step + 1]).to(device)
        if step + 1 == steps or ((step + 1) % check_every == 0 and bool(finished.all())):
            break
        attention = torch.cat([attention, torch.ones((rows, 1), dtype=attention.dtype, device=device)], dim=-1)
        out = model(input_ids=chosen.unsqueeze(-1), attention_mask=attention, position_ids=next_position,
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        next_position = next_position + 1
    return tokens[:, :step + 1], logprobs[:, :step + 1]
