"""What the reference server serves: built by ``ref_server.server`` from config (or by tests with a tiny model)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import anyio

from ref_server.body_limits import BodyLimits
from ref_server.hub.curriculum import SharedCurriculum
from ref_server.hub.rollout_hub import RolloutHub
from ref_server.scorer_pool.pool import ScorerPool
from ref_server.session import LearnerSessionStore
from ref_server.tool_api.prm import PRMScorer
from ref_server.tool_api.tokenizer import ServedTokenizer
from shared.weight_sync.relay_store import WeightStore
from shared.weight_sync.rendezvous import SyncRendezvous

# Long polls (a generator's budget wait, a learner's batch, a scorer's next job) hold a thread for their wait; in
# anyio's one shared pool of 40 threads, 40 of them (40 generators at a full hub) stalled every short piece of work
# (an upload's decode, an ack) until their waits ended. They get this many threads of their own.
LONG_POLL_THREADS = 1024


@dataclass
class ServerState:
    # reference scoring: the hub's own model and/or joined scorers (ref_server/scorer_pool/pool.py); None: none
    scorer: ScorerPool | None
    hub: RolloutHub
    weights: WeightStore
    # the registered learner (ref_server/session.py): whose reports and uploads the hub and the relay take
    session: LearnerSessionStore
    model_name: str | None
    vocab_size: int | None
    max_context: int | None
    max_request_bytes: int
    max_request_tokens: int
    max_long_poll_s: float
    token: str | None = None
    # the API docs (/docs, /redoc, /openapi.json) answer without the token (ref_server.public_docs)
    public_docs: bool = True
    max_version_ahead: int = 1000
    # the model folder's tokenizer (text prompts of /v1/completions, /tokenize); None without a model
    tokenizer: ServedTokenizer | None = None
    # the weight-sync rendezvous between the learner's sender and the generators (/v1/weights/sync/...)
    sync: SyncRendezvous = field(default_factory=SyncRendezvous)
    # the process reward model stand-in behind vLLM's /pooling (ref_server.prm_model); None when not set
    prm: PRMScorer | None = None
    # every request body's size limit and deadline (ref_server/limits.py)
    limits: BodyLimits = field(default_factory=BodyLimits)
    # this hub process (a scorer that sees it change re-registers); the model a joined scorer must load
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    model_identity: dict | None = None
    # on-policy distillation's teacher (ref_server.teacher_model; ref_server/scoring/teacher.py): its scorer pool
    # (the reference's own when they are one model) and what a joined `grpo scorer --teacher` must load
    teacher: ScorerPool | None = None
    teacher_identity: dict | None = None
    # the curriculum's pass-rate table every generator shares (ref_server/hub/curriculum.py; the spool's folder)
    curriculum: SharedCurriculum = field(default_factory=SharedCurriculum)
    # the long polls' own threads (LONG_POLL_THREADS above), used through ref_server.http.long_poll
    long_polls: anyio.CapacityLimiter = field(default_factory=lambda: anyio.CapacityLimiter(LONG_POLL_THREADS))

    def pools(self) -> dict[str, ScorerPool]:
        """The scorer pools by the model they score, ``reference`` and ``teacher`` (one pool under both names when
        they are one model); a model this hub does not score is absent."""
        return {role: pool for role, pool in (("reference", self.scorer), ("teacher", self.teacher)) if pool is not None}

    def scoring_health(self) -> dict[str, dict]:
        """Per model scored: who scores it, its jobs waiting and for how long, since when nobody can
        (:meth:`ScorerPool.health`), and ``groups``: the hub's groups waiting for its logprobs (unready meanwhile)."""
        unscored = self.hub.unscored()
        return {role: {**pool.health(), "groups": unscored[role]} for role, pool in self.pools().items()}
