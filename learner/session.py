"""The learner's session with the hub (rank 0): registered at start, taken back when resumed, ended at exit.

The hub takes version reports and weights uploads only from the registered session, and refuses a new registration
while that session is live (``ref_server.learner_session_ttl_s``; the learner's lease timer sends its heartbeat). So
rank 0 keeps its session id beside the checkpoints (``learner-session.json``, :mod:`learner.checkpoint`): a learner
started with ``--resume`` presents it and takes its session back, with the batches its checkpoint holds (the hub
keeps their leases, the learner acknowledges them now; every other lease of the earlier process is released at
once). A refusal is an error the learner stops on (exit 1 with the hub's reason), never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from learner.checkpoint import load_session, save_session
from shared.errors import ServiceError
from shared.protocol.client import HubClient, HubError, HubUnavailable

log = logging.getLogger("grpo.learner")


class SessionRefusedError(ServiceError):
    """The hub refused the learner's registration: another learner's session is live."""


def register_session(client: HubClient, checkpoint_dir: str, version: int, groups_per_step: int,
                     layout: list[list], *, resume: bool, unacked: list[str],
                     submit: Callable[[Callable[[HubClient], object]], None]) -> str | None:
    """Register (rank 0): its version and its model's layout (the relay refuses weights that differ); resumed,
    with the session id kept in ``checkpoint_dir`` and the checkpoint's unacknowledged batches (acknowledged through
    ``submit`` once the hub kept them). Returns None, or the hub's reason for refusing (409)."""
    session = load_session(checkpoint_dir) if resume else None
    try:
        answer = client.register_learner(version, groups_per_step, layout, resume_session=session,
                                         trained_batches=unacked)
    except HubError as exc:
        if exc.status != 409:
            raise
        return str(exc.detail)
    save_session(checkpoint_dir, answer["session"])
    if answer.get("resumed") and unacked:
        submit(lambda hub, ids=list(unacked): hub.ack_batches(ids))
    return None


def end_session(client: HubClient) -> None:
    """At exit: a new learner may register at once (one attempt: a hub that is gone lets the session go quiet)."""
    client.abort.set()
    try:
        client.end_learner_session()
    except (HubError, HubUnavailable) as exc:
        log.info("could not end the learner session on the hub: %s", exc)
