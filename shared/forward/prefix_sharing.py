"""One forward of each group's prompt for all G of its completions (exact, gradients included).

Every completion of a GRPO group continues the same prompt, so a padded forward over ``[prompt + completion]``
rows computes each prompt G times. Here each distinct prompt runs once (left-padded, with the KV cache on); its
keys/values are gathered to the rows that continue it (an index, so the backward sums the rows' gradients into the
one prompt pass) and the completions run on top of them::

    prompt pass:      P_g = body(prompt_g)                 one row per group, cache K_g, V_g
    completion pass:  H_r = body(completion_r | K_g(r), V_g(r))   row r of group g(r), positions after its prompt
    token t of row r is predicted by  P_g(r)[-1] (t = 0)  or  H_r[t - 1] (t >= 1)

The result equals the padded forward up to float rounding (tests/shared/test_prefix_sharing.py checks logprobs and
gradients), at ``(n_groups * prompt + rows * completion)`` token passes instead of ``rows * (prompt +
completion)``: with G = 16 and prompts as long as completions, about half the work. Attention still spans each
row's whole prefix. The ``prefix_rows`` helper finds which rows share a prompt (checked on the ids, not assumed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shared.forward.row_lengths import RowLengths
from shared.tensors.masks import completion_mask
from shared.tensors.transfers import to_device


@dataclass
class PrefixRows:
    """Which prompt each row continues: ``prompt_rows[k]`` is a row holding the k-th distinct prompt,
    ``row_prompt[r]`` the index k of row r's prompt."""

    prompt_rows: torch.Tensor
    row_prompt: torch.Tensor

    @property
    def num_prompts(self) -> int:
        return int(self.prompt_rows.numel())


def prefix_rows(input_ids: torch.Tensor, prompt_lengths: torch.Tensor,
                group_index: torch.Tensor | None = None) -> PrefixRows:
    """Rows with identical prompts (same length, same ids) share one prompt pass.

    With ``group_index`` (the rows of a group continue one prompt) the rows are checked against their group's first
    row in one comparison; if any row differs (or without it), prompts are matched by their ids row by row."""
    rows, width = input_ids.shape
    if group_index is not None and rows:
        group = group_index.to(input_ids.device)
        # the first row of each group (groups need not be contiguous): the smallest row index per group id
        first_of = torch.full((int(group.max()) + 1,), rows, dtype=torch.long, device=group.device)
        first_of = first_of.scatter_reduce(0, group, torch.arange(rows, device=group.device), reduce="amin")
        lead = first_of[group]
        in_prompt = completion_mask(prompt_lengths.to(input_ids.device), width)
        same = (prompt_lengths == prompt_lengths[lead]) & ((input_ids == input_ids[lead]) | ~in_prompt).all(1)
        if bool(same.all()):
            leads, row_prompt = torch.unique(lead, return_inverse=True)
            return PrefixRows(leads.cpu(), row_prompt.cpu())
    keys: dict[tuple[int, ...], int] = {}
    prompt_rows: list[int] = []
    row_prompt = torch.empty(rows, dtype=torch.long)
    lengths = prompt_lengths.tolist()
    ids = input_ids.cpu()
    for r in range(rows):
        k = keys.setdefault(tuple(ids[r, :lengths[r]].tolist()), len(prompt_rows))
        if k == len(prompt_rows):
            prompt_rows.append(r)
        row_prompt[r] = k
    return PrefixRows(torch.tensor(prompt_rows, dtype=torch.long), row_prompt)


def use_prefix_sharing(mode: str, prefix: PrefixRows, rows: int, packing: str) -> bool:
    """The ``prefix_sharing`` setting for one micro-batch: 'auto' shares when rows average two or more per prompt
    (and packed rows were not asked for explicitly), 'on' whenever any two rows share a prompt."""
    if mode == "off" or prefix.num_prompts == rows:
        return False
    return mode == "on" or (packing != "packed" and 2 * prefix.num_prompts <= rows)


def shared_prefixes(mode: str, input_ids: torch.Tensor, prompt_lengths: torch.Tensor, packing: str,
                    group_index: torch.Tensor | None = None) -> PrefixRows | None:
    """The rows' shared prompts when the ``prefix_sharing`` setting ``mode`` uses them for this micro-batch
    (:func:`use_prefix_sharing`), else None (the padded or packed forward). Nothing is looked at when 'off'."""
    if mode == "off":
        return None
    prefix = prefix_rows(input_ids, prompt_lengths, group_index)
    return prefix if use_prefix_sharing(mode, prefix, input_ids.shape[0], packing) else None


@dataclass
class SharedPrefixHidden:
    """The hidden states a logprob needs, by (row, position) like ``shared.forward.logprobs._Backbone``."""

    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor
    last_prompt: torch.Tensor      # [rows, H]: the hidden state at each row's last prompt token
    completion: torch.Tensor       # [rows, C, H]: at each completion token
    head: nn.Module

    def hidden_at(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden state of ``rows`` at absolute ``positions`` (each >= its prompt length - 1)."""
        offset = positions - self.prompt_lengths[rows]          # -1 at the last prompt token
        stacked = torch.cat([self.last_prompt.unsqueeze(1), self.completion], dim=1)
        return stacked[rows, offset + 1]


def _gather_cache(cache, index: torch.Tensor) -> None:
    """Each layer's keys/values, row ``index[r]`` for row r (differentiable: gradients add up per prompt)."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)


def shared_prefix_hidden(body: nn.Module, head: nn.Module, input_ids: torch.Tensor, lengths: RowLengths,
                         prefix: PrefixRows) -> SharedPrefixHidden:
    """Run each distinct prompt once and every completion on its cached keys/values (see the module docstring).

    ``input_ids`` are the usual right-padded ``[prompt + completion]`` rows, ``lengths`` their checked lengths
    (:func:`shared.forward.row_lengths.row_lengths`): widths come from its host lists and indices from its device tensors,
    so nothing here reads a value back from the device."""
    from transformers import DynamicCache

    device = input_ids.device
    lengths_on_device = lengths.prompt_on_device
    p_max = max(lengths.prompt, default=0)  # every row's prompt is one of the distinct prompts
    c_max = max(max(lengths.completion, default=0), 1)
    # the distinct prompts, left-padded so that every one ends at column p_max - 1
    source = to_device(prefix.prompt_rows, device)
    p_len = lengths_on_device[source]
    cols = torch.arange(p_max, device=device)
    start = (p_max - p_len).unsqueeze(1)
    take = (cols.unsqueeze(0) - start).clamp(min=0)
    prompt_mask = cols.unsqueeze(0) >= start
    prompt_ids = input_ids[source].gather(1, take).masked_fill(~prompt_mask, 0)
    prompt_positions = take.masked_fill(~prompt_mask, 0)
    cache = DynamicCache()
    prompt_out = body(input_ids=prompt_ids, attention_mask=prompt_mask.long(), position_ids=prompt_positions,
                      past_key_values=cache, use_cache=True)
    row_prompt = to_device(prefix.row_prompt, device)
    last_prompt = prompt_out.last_hidden_state[:, -1][row_prompt]
    _gather_cache(prompt_out.past_key_values, row_prompt)
    # the completions, right after each row's prompt (right-padded; padding is masked out and never read)
    c_cols = torch.arange(c_max, device=device)
    c_take = (lengths_on_device.unsqueeze(1) + c_cols.unsqueeze(0)).clamp(max=input_ids.shape[1] - 1)
    in_completion = completion_mask(lengths.completion_on_device, c_max)
    completion_ids = input_ids.gather(1, c_take).masked_fill(~in_completion, 0)
    attention = torch.cat([prompt_mask[row_prompt], in_completion], dim=1).long()
    completion_out = body(input_ids=completion_ids, attention_mask=attention,
                          position_ids=lengths_on_device.unsqueeze(1) + c_cols.unsqueeze(0),
                          past_key_values=prompt_out.past_key_values, use_cache=True)
    return SharedPrefixHidden(lengths_on_device, lengths.completion_on_device, last_prompt,
                              completion_out.last_hidden_state, head)
