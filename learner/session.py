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
from learner.engine import LearnerSetupError
from shared.config.schema import GRPOConfig
from shared.errors import ServiceError
from shared.protocol.client import HubClient, HubError, HubUnavailable

log = logging.getLogger("grpo.learner")


class SessionRefusedError(ServiceError):
    """The hub refused the learner's registration: another learner's session is live."""


def check_hub(client: HubClient, config: GRPOConfig, *, resume: bool, version: int) -> tuple[int | None, int]:
    """Refuse a hub this run cannot train against (no reference model when one is needed, an earlier run's weights
    when not resuming); find the version to start from (registered with the hub once the publisher knows the
    layout). Returns (the relay's newest version, None before the first; the hub's newest weights version)."""
    algorithm = config.algorithm
    health = client.health()   # configured: a hub whose scorers join later scores the reference too
    if config.hub_scores_reference and not health.get("reference_model_configured",
                                                      health["reference_model_loaded"]):
        wants = (f"algorithm.loss.beta is {algorithm.loss.beta}" if algorithm.loss.beta > 0
                 else "algorithm.kl.in_reward is true")
        raise LearnerSetupError(
            f"{wants} but the ref server at {config.learner.hub_url} has no reference model loaded (its "
            "algorithm.loss.beta is 0?): start both with the same config")
    if algorithm.distill is not None and health.get("teacher_model") is None:
        raise LearnerSetupError(
            f"algorithm.distill is set but the ref server at {config.learner.hub_url} scores no teacher (no "
            "ref_server.teacher_model): start both with the same config")
    if algorithm.distill_top_k and health.get("teacher_top_k", 0) != algorithm.distill_top_k:
        raise LearnerSetupError(
            f"algorithm.distill.mode is topk_forward_kl with top_k {algorithm.distill_top_k}, but the ref server at "
            f"{config.learner.hub_url} sends the teacher's top {health.get('teacher_top_k', 0)} (0: none): start "
            "both with the same config")
    # the newest version the hub knows: on its relay, or reported by a learner (the relay may lag behind the
    # reports: weights reach it only when a generator needs them there)
    relay = client.weights_version()
    hub_version = max(relay or 0, client.hub_stats()["learner_version"])
    if hub_version > version and not resume:
        raise LearnerSetupError(
            f"the hub already holds weights version {hub_version} from an earlier run; a fresh learner would "
            "train against them. Continue that run (`grpo run --resume`, `grpo learner --resume`) or start over "
            "(`grpo run --fresh`, or a ref server with empty ref_server.weights_dir and spool_dir)")
    return relay, hub_version


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
