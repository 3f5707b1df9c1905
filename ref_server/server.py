"""Building the server's state from config (loading the model) and running it under uvicorn."""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import signal
import tempfile
from pathlib import Path

from ref_server.app import create_app
from ref_server.body_limits import BodyLimits
from ref_server.cpu_cores import pin_process
from ref_server.header_deadline import header_deadline_protocol
from ref_server.hub.curriculum import SharedCurriculum
from ref_server.hub.rollout_hub import RolloutHub
from ref_server.scorer_pool.job_wire import model_identity
from ref_server.scorer_pool.pool import ScorerPool
from ref_server.scoring.loading import ModelLoadError, load_reference_model, load_reference_scorer
from ref_server.scoring.teacher import check_same_tokenizer, same_model, teacher_student
from ref_server.session import LearnerSessionStore
from ref_server.state import ServerState
from ref_server.tool_api.prm import PRMScorer
from ref_server.tool_api.tokenizer import ServedTokenizer
from shared.config.schema import GRPOConfig, RefServerConfig
from shared.devices import default_dtype, resolve_device
from shared.errors import ServiceError, UsageError
from shared.ports import bind_port, token_problem
from shared.progress import READY, startup_phase
from shared.weight_sync.relay_store import WeightStore

log = logging.getLogger("grpo.ref_server")
# the model loading moved to ref_server.scoring.loading (a joined scorer needs it without the server)
__all__ = ["ModelLoadError", "build_state", "load_reference_model", "serve"]


def model_limits(model_dir: str) -> tuple[int | None, int | None]:
    """(vocab_size, max_context) from a model folder's config.json, without loading weights."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None, None
    config = config.get("text_config", config)
    return config.get("vocab_size"), config.get("max_position_embeddings")


def scratch_relay() -> str:
    """The relay's folder when the config names none (no run folder: a ref server on its own): removed at exit."""
    folder = tempfile.mkdtemp(prefix="grpo-relay-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    log.info("no ref_server.weights_dir (no run.run_dir): the weight relay uses %s, removed at exit", folder)
    return folder


def _scorer_pool(cfg: RefServerConfig, local, vocab_size: int | None, role: str = "reference") -> ScorerPool:
    """The reference's pool or the teacher's: one class, one config, one rule for scorers that fail or go away."""
    return ScorerPool(local=local, vocab_size=vocab_size, lease_s=cfg.scorer_lease_s, wait_s=cfg.scorer_wait_s,
                      max_jobs=cfg.max_scoring_jobs, max_bad_results=cfg.scorer_max_bad_results,
                      job_max_failures=cfg.scoring_job_max_failures, role=role)


def build_teacher(config: GRPOConfig, reference: ScorerPool | None) -> tuple[ScorerPool | None, dict | None]:
    """The teacher's scorer pool (ref_server.teacher_model; None without one) and its model identity (what a joined
    ``grpo scorer --teacher`` must load). Its tokenizer is checked against the student's first; the reference's own
    pool when the two are one folder (one model loaded, each group scored once)."""
    cfg = config.ref_server
    if cfg.teacher_model is None:
        return None, None
    student = teacher_student(config)
    if student is not None:
        check_same_tokenizer(student[1], cfg.teacher_model, student_key=student[0])
    identity = model_identity(cfg.teacher_model)
    if reference is not None and same_model(cfg.model, cfg.teacher_model):
        return reference, identity
    local, vocab_size = None, model_limits(cfg.teacher_model)[0]
    if cfg.local_scoring is not False:
        local, _ = load_reference_scorer(cfg, model_dir=cfg.teacher_model)
        vocab_size = local.vocab_size
    elif vocab_size is None:
        raise ModelLoadError(f"teacher model folder {cfg.teacher_model!r} has no readable config.json with a "
                             "vocab_size (joined teacher scorers must match it)")
    log.info("teacher %s: scored %s", cfg.teacher_model, "here" if local is not None else "by joined scorers")
    return _scorer_pool(cfg, local, vocab_size, role="teacher"), identity


def build_state(config: GRPOConfig) -> ServerState:
    cfg: RefServerConfig = config.ref_server
    scorer = tokenizer = None
    vocab_size = max_context = None
    if cfg.model is not None:
        vocab_size, max_context = model_limits(cfg.model)
    if config.hub_scores_reference:  # not under learner.lora.reference 'learner': the learner scores it itself
        if cfg.model is None:
            raise ModelLoadError("algorithm.loss.beta > 0 or algorithm.kl.in_reward needs ref_server.model (or "
                                 "--model)")
        local = None
        if cfg.local_scoring is not False:  # null: the hub scores with its own model, as it always did
            local, max_context = load_reference_scorer(cfg)
            vocab_size = local.vocab_size
        elif vocab_size is None:
            raise ModelLoadError(f"reference model folder {cfg.model!r} has no readable config.json with a "
                                 "vocab_size (ref_server.local_scoring false still reads it: joined scorers must "
                                 "match it)")
        scorer = _scorer_pool(cfg, local, vocab_size)
        tokenizer = ServedTokenizer.load(cfg.model, vocab_size, max_context)
    teacher, teacher_identity = build_teacher(config, scorer)
    vocab_size = vocab_size if vocab_size is not None or teacher is None else teacher.vocab_size
    prm = None
    if cfg.prm_model is not None:
        device = resolve_device(cfg.device)
        prm = PRMScorer.load(cfg.prm_model, device, default_dtype(cfg.dtype, device),
                             max_tokens=cfg.max_request_tokens, max_request_bytes=cfg.max_request_bytes)
    relay_dir = cfg.weights_dir or scratch_relay()
    session = LearnerSessionStore(relay_dir, ttl_s=cfg.learner_session_ttl_s)  # learner.json beside the versions
    weights = WeightStore(relay_dir, keep=cfg.keep_weight_versions, max_bytes=cfg.max_weight_bytes,
                          layout=lambda: session.layout)
    if cfg.spool_dir is None:
        log.info("no ref_server.spool_dir (no run.run_dir): queued groups are kept in memory only")
    temperature = config.generator.sampling.temperature
    hub = RolloutHub(capacity=cfg.queue_capacity, max_staleness=cfg.max_staleness, scorer=scorer,
                     vocab_size=vocab_size, spool_dir=cfg.spool_dir, lease_timeout_s=cfg.lease_timeout_s,
                     max_deliveries=cfg.max_deliveries,
                     # 0 is greedy decoding, for evaluation only: no training group is sampled that way
                     temperature=temperature if temperature > 0 else None,
                     published_version=lambda: weights.current, max_context=max_context, teacher=teacher,
                     # top-k distillation: the hub learns it from the config it is started with (grpo run hands the
                     # learner and the ref server the same one; learner/session.py checks /health agrees)
                     teacher_top_k=config.algorithm.distill_top_k)
    if session.learner_version is not None:  # the registered learner's last version survives a hub restart
        hub.report_version(session.learner_version)
    return ServerState(
        curriculum=SharedCurriculum(cfg.spool_dir), scorer=scorer, hub=hub, weights=weights, session=session, model_name=cfg.model, vocab_size=vocab_size,
        max_context=max_context, max_request_bytes=cfg.max_request_bytes,
        max_request_tokens=cfg.max_request_tokens, max_long_poll_s=cfg.max_long_poll_s,
        token=cfg.resolved_token(), public_docs=cfg.public_docs,
        max_version_ahead=cfg.max_version_ahead,
        model_identity=model_identity(cfg.model) if cfg.model is not None else None,
        tokenizer=tokenizer, prm=prm, teacher=teacher, teacher_identity=teacher_identity, limits=BodyLimits(
            json_bytes=cfg.max_json_body_bytes, request_bytes=cfg.max_request_bytes,
            weight_bytes=cfg.max_weight_bytes, timeout_s=cfg.body_timeout_s,
            min_bytes_per_s=cfg.min_body_bytes_per_s),
    )


def serve(config: GRPOConfig) -> None:
    import uvicorn

    cfg = config.ref_server
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    pin_process(cfg.cpu_cores)  # before the model loads and uvicorn starts: every thread started later inherits it
    # bound before the model loads and before "ready" is logged: a port in use fails at once, naming its holder
    problem = token_problem(cfg.host, cfg.resolved_token())
    if problem:
        raise UsageError(problem)
    sock = bind_port(cfg.host, cfg.port, "ref_server.port")
    models = [m for m in (cfg.model if config.hub_scores_reference and cfg.local_scoring is not False else None,
                          cfg.teacher_model if cfg.local_scoring is not False else None, cfg.prm_model) if m]
    startup_phase(log, f"loading {' and '.join(models)}" if models else "opening the hub")
    try:
        state = build_state(config)
    except BaseException:
        sock.close()
        raise

    def on_ready() -> None:
        log.info("ref-server ready on http://%s:%d (model: %s, beta=%s, hub capacity %d)", cfg.host, cfg.port,
                 cfg.model or "none", config.algorithm.loss.beta, cfg.queue_capacity)
        startup_phase(log, READY)

    app = create_app(state, on_ready=on_ready)

    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then re-raises the signal to the handler that was
    # installed before it; this one turns that into a normal return, so a requested stop exits with status 0.
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda num, frame: log.info("ref-server stopped (%s)", signal.Signals(num).name))
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level, access_log=cfg.access_log, timeout_graceful_shutdown=5,
        http=header_deadline_protocol(cfg.header_timeout_s)))
    try:
        server.run(sockets=[sock])
        if not server.started:
            raise ServiceError("the ref server did not start (see the log above)")
    finally:
        sock.close()
        state.hub.close()  # leases still held untrained count as failed deliveries (poison pills across restarts)
        state.curriculum.close()  # the reports since its last write
        state.weights.keep_newest()  # no download in flight any more: one copy of the weights on disk is enough
        for pool in {id(p): p for p in (state.scorer, state.teacher) if p is not None}.values():
            pool.close()
