"""The teacher of on-policy distillation (``ref_server.teacher_model``): checked against the student's tokenizer
before anything is loaded, then scored like the reference model (its own :class:`ScorerPool`, or the reference's
when the two are one folder: loaded and scored once)."""

from __future__ import annotations

import logging
from pathlib import Path

from shared.errors import UsageError

log = logging.getLogger("grpo.ref_server")


class TokenizerMismatch(UsageError):
    """The teacher and the student do not share a tokenizer; the message names both models."""


def _vocabulary(folder: str, key: str) -> dict[str, int]:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(Path(folder)).get_vocab()
    except (OSError, ValueError, TypeError) as exc:
        raise TokenizerMismatch(f"{key} {folder!r} has no tokenizer AutoTokenizer can load ({exc}): the teacher's "
                                "logprobs are only meaningful over the student's token ids") from None


def check_same_tokenizer(student: str, teacher: str, *, student_key: str = "ref_server.model") -> None:
    """Raise :class:`TokenizerMismatch` naming both models unless their tokenizers map the same strings to the same
    ids (the teacher scores the student's token ids: another vocabulary would score other text)."""
    if Path(student).resolve() == Path(teacher).resolve():
        return
    ours, theirs = _vocabulary(student, student_key), _vocabulary(teacher, "ref_server.teacher_model")
    if ours == theirs:
        return
    missing = sorted(set(ours) - set(theirs))
    moved = sorted(t for t in set(ours) & set(theirs) if ours[t] != theirs[t])
    example = (f"{missing[0]!r} (id {ours[missing[0]]}) is not in the teacher's" if missing else
               f"{moved[0]!r} is id {ours[moved[0]]} for the student and {theirs[moved[0]]} for the teacher" if moved
               else f"the teacher has {len(set(theirs) - set(ours))} tokens the student lacks")
    raise TokenizerMismatch(
        f"the teacher ref_server.teacher_model {teacher!r} ({len(theirs)} tokens) and the student {student_key} "
        f"{student!r} ({len(ours)} tokens) have different vocabularies: {example}. On-policy distillation needs a "
        "teacher sharing the student's tokenizer")


def teacher_student(config) -> tuple[str, str] | None:
    """``(key, folder)`` of the student the teacher is checked against: ref_server.model, else learner.model; None
    when neither is set (nothing to check against)."""
    for key, folder in (("ref_server.model", config.ref_server.model), ("learner.model", config.learner.model)):
        if folder is not None:
            return key, folder
    return None


def same_model(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()
