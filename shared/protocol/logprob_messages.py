"""The binary (safetensors) form of ``POST /v1/logprobs``: flat token ids and per-row lengths, one copy each way.

The JSON form is the contract other tools call; this one is for high-throughput clients (the learner's prefetch,
benchmarks). Shapes and consistency are checked here; the ids' range is the server's business.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from shared.protocol.errors import ProtocolError
from shared.protocol.records import check_temperature
from shared.protocol.wire import WireError, decode, encode


def encode_logprob_request(input_ids: list[list[int]] | list[torch.Tensor], prompt_lengths: list[int],
                           temperature: float) -> bytes:
    """Binary form of ``POST /v1/logprobs``: flat ids + per-row lengths (rows may differ in length).

    Rows may be lists of ints or 1-D integer tensors; either way they are flattened without a Python loop per token.
    """
    if input_ids and isinstance(input_ids[0], torch.Tensor):
        flat = torch.cat([row.reshape(-1).long() for row in input_ids])
    else:
        total = sum(len(row) for row in input_ids)
        flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(input_ids), dtype=np.int64, count=total))
    return encode("logprob_request/v1", {
        "input_ids": flat, "row_lengths": torch.tensor([len(r) for r in input_ids], dtype=torch.long),
        "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long),
    }, {"temperature": temperature})


def decode_logprob_request_tensors(data: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(flat int64 input_ids, row_lengths, prompt_lengths, temperature)`` of a binary logprob request, checked
    for shape and consistency (the ids' range is the server's business); nothing is converted to Python lists."""
    tensors, fields = decode(data, "logprob_request/v1")
    try:
        flat, row_lengths, prompt_lengths = tensors["input_ids"], tensors["row_lengths"], tensors["prompt_lengths"]
    except KeyError as exc:
        raise WireError(f"logprob request is missing tensor {exc}") from None
    if flat.dim() != 1 or row_lengths.dim() != 1 or prompt_lengths.dim() != 1:
        raise WireError("input_ids, row_lengths and prompt_lengths must be 1-D")
    for name, tensor in (("input_ids", flat), ("row_lengths", row_lengths), ("prompt_lengths", prompt_lengths)):
        if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
            raise WireError(f"{name} must be an integer tensor, got {tensor.dtype}")
    if row_lengths.numel() and (int(row_lengths.min()) < 0 or int(row_lengths.sum()) != flat.numel()):
        raise WireError("row_lengths must be >= 0 and add up to the number of input_ids")
    try:
        temperature = check_temperature(fields.get("temperature", 1.0))
    except ProtocolError as exc:
        raise WireError(str(exc)) from None
    return flat.long(), row_lengths.long(), prompt_lengths.long(), temperature


def decode_logprob_request(data: bytes) -> tuple[list[list[int]], list[int], float]:
    """:func:`decode_logprob_request_tensors` as Python lists."""
    flat, row_lengths, prompt_lengths, temperature = decode_logprob_request_tensors(data)
    rows = [r.tolist() for r in torch.split(flat, row_lengths.tolist())] if row_lengths.numel() else []
    return rows, prompt_lengths.tolist(), temperature


def encode_logprob_response(logprobs: list[list[float]] | list[torch.Tensor]) -> bytes:
    """One flat float32 tensor of every row's logprobs plus ``row_lengths`` (one copy, no per-value loop)."""
    rows = [torch.as_tensor(r, dtype=torch.float32) for r in logprobs]
    flat = torch.cat(rows) if rows else torch.zeros(0)
    return encode("logprob_response/v1", {
        "logprobs": flat, "row_lengths": torch.tensor([r.numel() for r in rows], dtype=torch.long),
    }, {})


def decode_logprob_response(data: bytes) -> list[torch.Tensor]:
    tensors, _ = decode(data, "logprob_response/v1")
    return list(torch.split(tensors["logprobs"], tensors["row_lengths"].tolist()))
