"""The wire form of a scoring job and its result, between the hub's scorer pool and a joined scorer (safetensors,
never pickle), and the checks a result passes where it enters the hub.

A job: the rows' token ids (flat int64), their lengths and prompt lengths, the temperature and ``top_k``. A result:
the rows' completion logprobs (flat float32, ``sum(row length - prompt length)`` entries) and, for a ``top_k`` job,
the top-k logprobs and ids at each completion token and after the last (``[sum(completion + 1), k]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ref_server.scoring.scorer import Row, TopRow
from shared.protocol.errors import ProtocolError
from shared.protocol.records import check_temperature
from shared.protocol.wire import WireError, decode, encode

JOB_KIND = "scoring_job/v1"
RESULT_KIND = "scoring_result/v1"


class BadResult(ValueError):
    """A scorer's result that does not fit its job (shape, dtype, values); the message says what (HTTP 422)."""


@dataclass
class JobSpec:
    """What a scorer needs to score a job: its id, rows, temperature and top-k."""

    job_id: str
    rows: list[Row]
    temperature: float
    top_k: int = 0


def _flat_ids(rows: list[Row]) -> torch.Tensor:
    return torch.cat([ids.reshape(-1).long() if isinstance(ids, torch.Tensor)
                      else torch.from_numpy(np.asarray(ids, dtype=np.int64)) for ids in (r.input_ids for r in rows)])


def encode_job(spec: JobSpec) -> bytes:
    rows = spec.rows
    return encode(JOB_KIND, {
        "input_ids": _flat_ids(rows),
        "row_lengths": torch.tensor([r.tokens for r in rows], dtype=torch.long),
        "prompt_lengths": torch.tensor([r.prompt_length for r in rows], dtype=torch.long),
    }, {"job_id": spec.job_id, "temperature": spec.temperature, "top_k": spec.top_k})


def decode_job(data: bytes) -> JobSpec:
    """The job a hub handed out, checked for shape and consistency (the scorer trusts its hub's token ids)."""
    tensors, fields = decode(data, JOB_KIND)
    try:
        flat, lengths, prompts = tensors["input_ids"], tensors["row_lengths"], tensors["prompt_lengths"]
    except KeyError as exc:
        raise WireError(f"scoring job is missing tensor {exc}") from None
    if flat.dtype != torch.int64 or lengths.dtype != torch.int64 or prompts.dtype != torch.int64:
        raise WireError("scoring job tensors must be int64")
    if lengths.dim() != 1 or prompts.shape != lengths.shape or int(lengths.sum()) != flat.numel():
        raise WireError("scoring job: row_lengths must add up to input_ids and match prompt_lengths")
    if bool(((prompts < 1) | (prompts > lengths)).any()):
        raise WireError("scoring job: a prompt length is outside [1, row length]")
    job_id, top_k = fields.get("job_id"), fields.get("top_k", 0)
    if not isinstance(job_id, str) or not isinstance(top_k, int) or top_k < 0:
        raise WireError("scoring job: job_id must be a string and top_k an integer >= 0")
    try:
        temperature = check_temperature(fields.get("temperature", 1.0))
    except ProtocolError as exc:
        raise WireError(str(exc)) from None
    rows = [Row(ids, int(p)) for ids, p in zip(torch.split(flat, lengths.tolist()), prompts.tolist())]
    return JobSpec(job_id, rows, temperature, top_k)


def encode_result(job_id: str, result: list[torch.Tensor] | list[TopRow]) -> bytes:
    """A scored job's rows, as the hub checks them (:func:`check_result`)."""
    if result and isinstance(result[0], TopRow):
        tensors = {"logprobs": torch.cat([r.logprobs for r in result]).float(),
                   "top_logprobs": torch.cat([r.top_logprobs for r in result]).float(),
                   "top_ids": torch.cat([r.top_ids for r in result]).long()}
    else:
        tensors = {"logprobs": torch.cat(list(result)).float() if result else torch.zeros(0)}
    return encode(RESULT_KIND, tensors, {"job_id": job_id})


def result_job_id(data: bytes) -> str:
    """The job id a result names (read from its header only: decoding the tensors waits for the job's checks)."""
    _, fields = decode(data, RESULT_KIND)
    job_id = fields.get("job_id")
    if not isinstance(job_id, str):
        raise WireError("scoring result: job_id must be a string")
    return job_id


def _check_logprobs(name: str, values: torch.Tensor, shape: tuple[int, ...]) -> None:
    if values.dtype != torch.float32:
        raise BadResult(f"{name} must be float32, got {values.dtype}")
    if tuple(values.shape) != shape:
        raise BadResult(f"{name} has shape {list(values.shape)}, the job needs {list(shape)}")
    if values.numel() and not bool(torch.isfinite(values).all()):
        raise BadResult(f"{name} holds values that are not finite")
    if values.numel() and float(values.max()) > 0.0:
        raise BadResult(f"{name} holds a value above 0 ({float(values.max()):.3g}): not a log-probability")


def check_result(data: bytes, completion_lengths: list[int], top_k: int,
                 vocab_size: int | None) -> list[torch.Tensor] | list[TopRow]:
    """The rows of a result for a job with these completion lengths, or :class:`BadResult` naming the problem:
    float32, finite, <= 0, exactly the job's shape (ids within the vocabulary for a ``top_k`` job)."""
    try:
        tensors, _ = decode(data, RESULT_KIND)
    except WireError as exc:
        raise BadResult(str(exc)) from None
    expected = {"logprobs", "top_logprobs", "top_ids"} if top_k else {"logprobs"}
    if set(tensors) != expected:
        raise BadResult(f"scoring result holds tensors {sorted(tensors)}, the job needs {sorted(expected)}")
    total = sum(completion_lengths)
    _check_logprobs("logprobs", tensors["logprobs"], (total,))
    rows = list(torch.split(tensors["logprobs"], completion_lengths))
    if not top_k:
        return rows
    after = [c + 1 for c in completion_lengths]
    _check_logprobs("top_logprobs", tensors["top_logprobs"], (sum(after), top_k))
    ids = tensors["top_ids"]
    if ids.dtype != torch.int64 or tuple(ids.shape) != (sum(after), top_k):
        raise BadResult(f"top_ids must be int64 of shape {[sum(after), top_k]}")
    if ids.numel() and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        raise BadResult(f"top_ids holds an id outside [0, {vocab_size})")
    tops, top_ids = torch.split(tensors["top_logprobs"], after), torch.split(ids, after)
    return [TopRow(lp, t, i) for lp, t, i in zip(rows, tops, top_ids)]


def model_identity(folder: str) -> dict:
    """What a scorer's model must share with the hub's: the folder's name and a digest of its config.json (keys
    sorted, without the fields that name where or with what it was saved)."""
    import hashlib
    import json
    from pathlib import Path

    path = Path(folder)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {"model": path.name, "config_digest": None}
    for volatile in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"model": path.name, "config_digest": digest}
