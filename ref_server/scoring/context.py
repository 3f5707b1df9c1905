"""The model's context, one rule for every entry: a row (prompt + completion tokens) longer than the model's
``max_position_embeddings`` is refused, by ``/v1/logprobs`` (422) and by the hub's intake at upload (422) alike, so
that no group the reference server could not score (and the learner could not train) is ever queued."""

from __future__ import annotations

from collections.abc import Sequence

from shared.protocol.records import RolloutGroup


class ContextTooLong(ValueError):
    """A row longer than the model's context; the message names the row, its length and the context."""


def row_fits(max_context: int | None, length: int) -> bool:
    """Whether a row of ``length`` tokens fits the model's context (an unknown context fits everything)."""
    return max_context is None or length <= max_context


def check_rows(max_context: int | None, row_lengths: Sequence[int], what: str = "row") -> None:
    """:class:`ContextTooLong` for the first of ``row_lengths`` the context cannot hold."""
    for i, length in enumerate(row_lengths):
        if not row_fits(max_context, int(length)):
            raise ContextTooLong(f"{what} {i}: {int(length)} tokens exceed the model's context of {max_context}")


def check_group(max_context: int | None, group: RolloutGroup) -> None:
    """:class:`ContextTooLong` when a completion of ``group``, after its prompt, is longer than the context (the
    rows the hub scores and the learner trains: prompt + completion ``i``)."""
    if max_context is None:
        return
    prompt = int(group.prompt_ids.numel())
    check_rows(max_context, [prompt + int(n) for n in group.completion_lengths], what="completion")
