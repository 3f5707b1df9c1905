"""The transformers engine: ``model.generate`` on CPU (or one GPU), for machines without vLLM and for tests."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open

from generator.engines.base import SampledCompletion
from shared.protocol import SamplingParams

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


class TransformersEngine:
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

    def load_weights(self, path: Path) -> None:
        count = load_safetensors_into(self.model, path)
        log.info("loaded %d tensors from %s", count, path)

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
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, prompt in enumerate(prompts):  # left padding: generation continues right after each prompt
            input_ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        greedy = sampling.temperature == 0
        kwargs = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else None)
        # each prompt repeated n times (rather than num_return_sequences, which greedy decoding refuses)
        input_ids, attention = input_ids.repeat_interleave(n, dim=0), attention.repeat_interleave(n, dim=0)
        out = self.model.generate(
            input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
            max_new_tokens=sampling.max_tokens, output_logits=True,
            return_dict_in_generate=True, pad_token_id=self.pad_id, eos_token_id=sorted(self.eos_ids), **kwargs)
        generated = out.sequences[:, width:].cpu()
        # raw logits of each step -> the sampled token's logprob under logits / temperature
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [B*n, steps, V]
        scale = 1.0 if greedy else sampling.temperature
        token_logprobs = (logits / scale).log_softmax(-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        results = []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                row = i * n + j
                tokens = generated[row].tolist()
                stop = next((k for k, t in enumerate(tokens) if t in self.eos_ids), None)
                length = stop + 1 if stop is not None else len(tokens)
                group.append(SampledCompletion(tokens[:length], token_logprobs[row, :length].tolist(),
                                               "stop" if stop is not None else "length"))
            results.append(group)
        return results
