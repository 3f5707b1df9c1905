"""The reference server section (ref_server/)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from shared.config.schema.base import StrictModel
from shared.config.schema.paths import template_help


class RefServerConfig(StrictModel):
    """The reference server: reference logprobs, the rollout hub and the weight relay (ref_server/)."""

    model: str | None = Field(
        None, description="Folder of the reference model (any AutoModelForCausalLM). Not loaded when "
        "algorithm.loss.beta is 0 and algorithm.kl.in_reward is false; the hub and weight relay work without it.")
    teacher_model: str | None = Field(
        None, description="Folder of a teacher model for on-policy distillation (algorithm.distill; any "
        "AutoModelForCausalLM sharing the student's tokenizer, checked at start against ref_server.model). The hub "
        "scores every group with it as it scores the reference (same micro-batching, joined scorers: `grpo scorer "
        "--teacher`) and answers POST /v1/logprobs with it for a request naming it (\"model\": \"teacher\"). "
        "The same folder as ref_server.model is loaded once. Off when null (docs/distillation.md).")
    prm_model: str | None = Field(
        None, description="Folder of a process reward model (any AutoModelForTokenClassification with 2 labels whose "
        "tokenizer has the step tag `<extra_0>` as one token) to serve at POST /pooling in vLLM's schema, a local "
        "stand-in for `vllm serve Qwen/Qwen2.5-Math-PRM-7B` (the 'prm' reward; docs/process-rewards.md). Off when null.")
    host: str = Field("127.0.0.1", description="Address to bind. Keep 127.0.0.1 unless a token is set.")
    port: int = Field(8470, ge=1, le=65535, description="TCP port; every other process is told this address.")
    token: str | None = Field(
        None, description="Bearer token required on every endpoint except /healthz and the API docs (see "
        "public_docs) (or set GRPO_TOKEN). Off when null.")
    public_docs: bool = Field(
        True, description="Serve the API docs (/docs, /redoc, /openapi.json) without the token, so a browser can "
        "open them; they describe the endpoints, never the server's data. false: the docs need the token too.")
    device: str = Field("auto", description="'auto' (first visible GPU, else CPU), 'cpu', or 'cuda:N' (N indexes "
                        "the node's visible GPUs).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Reference model dtype; 'auto' is bfloat16 on GPU and float32 on CPU.")
    batch_tokens: int = Field(8192, ge=1, description="Token budget of one scoring micro-batch: rows x longest "
                              "row when padded, the rows' tokens summed when packed (see packing).")
    packing: Literal["auto", "packed", "padded"] = Field(
        "auto", description="Padding-free scoring: a micro-batch's rows concatenated into one sequence with per-row "
        "position ids. 'packed': whenever the model passes a one-time probe; 'auto': packed when that is estimated "
        "cheaper (flash/flex attention: always; SDPA/eager: for rows of mixed lengths); 'padded': never.")
    prefix_sharing: Literal["auto", "on", "off"] = Field(
        "auto", description="Score rows that continue the same prompt (a group's completions) with one pass of the "
        "prompt and the completions on its cached keys/values (exact; shared/forward/prefix_sharing.py). 'auto': when a "
        "micro-batch holds at least two rows per distinct prompt and packing is not 'packed'; 'on': whenever rows "
        "share a prompt; 'off': never.")
    max_request_bytes: int = Field(
        64 * 2**20, ge=1024, description="Largest body of the bulk endpoints (rollout uploads, /v1/logprobs, "
        "/v1/completions, /tokenize, /detokenize, weight-sync offers); 413 above, refused as soon as it passes the limit.")
    max_json_body_bytes: int = Field(
        2**20, ge=1024, description="Largest body of every other endpoint (acknowledgements, renewals, version "
        "reports, the weight-sync rendezvous); 413 above, refused as soon as it passes the limit.")
    body_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="A request body must arrive within this many seconds plus one "
        "second per min_body_bytes_per_s bytes received, else 408: a client trickling its body cannot hold a "
        "connection.")
    header_timeout_s: float = Field(
        10.0, gt=0, allow_inf_nan=False, description="A request's line and headers must arrive within this many "
        "seconds of its connection opening (or of the connection's previous answer), else 408 and the connection is "
        "closed: a client trickling its headers cannot hold a connection (uvicorn itself has no header timeout).")
    min_body_bytes_per_s: float = Field(
        256 * 1024, gt=0, allow_inf_nan=False, description="The slowest upload rate a big body may keep up beyond "
        "body_timeout_s (see there), in bytes per second.")
    max_request_tokens: int = Field(262144, ge=1, description="Most tokens one logprob request may hold (413 above).")
    queue_capacity: int = Field(256, ge=1, description="Rollout groups the hub holds; uploads get 429 when full.")
    max_staleness: int = Field(
        4, ge=0, description="Drop groups sampled more than this many policy versions before the learner's.")
    spool_dir: str | None = Field(
        "<run_dir>/ref_server/spool", description=template_help(
            "Where accepted groups are spooled until consumed, so a restart (`grpo run --resume`) loses none",
            "<run_dir>/ref_server/spool", "kept in memory only (a ref server started on its own, e.g. for scoring, "
            "touches no run's spool)"))
    weights_dir: str | None = Field(
        "<run_dir>/ref_server/relay", description=template_help(
            "Where the weight relay stores published weight versions", "<run_dir>/ref_server/relay",
            "a temporary folder removed when the server exits"))
    max_version_ahead: int = Field(
        1000, ge=1, description="Refuse a weights upload, a learner version report or a learner registration whose "
        "version is more than this ahead of the newest the hub knows (the learner's reported version, the relay's "
        "newest weights): a runaway version would make every queued group look stale.")
    learner_session_ttl_s: float = Field(
        60.0, gt=0, description="A registered learner session counts as live while the learner was heard from "
        "(reports, uploads, its heartbeat every third of this or of lease_timeout_s) within this many seconds: "
        "meanwhile a new learner registration is refused (409) unless it presents the session id (a learner "
        "started with --resume), so no other local process can take the hub from the running learner. A learner "
        "that crashed and will not resume can be replaced once its session has been quiet this long.")
    keep_weight_versions: int = Field(2, ge=1, description="How many newest weight versions to keep on disk.")
    max_weight_bytes: int = Field(
        256 * 2**30, ge=1024, description="Largest weights upload accepted (one safetensors file per version).")
    max_long_poll_s: float = Field(30.0, ge=0, description="Longest wait a batch request may ask for.")
    lease_timeout_s: float = Field(
        300.0, gt=0, description="A batch handed to the learner and not acknowledged (or renewed) within this many "
        "seconds goes back to the queue, so a learner killed mid-step loses no groups.")
    max_deliveries: int = Field(
        3, ge=1, description="Failed deliveries before a group is quarantined: a lease that expires before the learner "
        "trained or acknowledged it counts against each of its groups (a learner that crashes on a group never "
        "acknowledges it), and so does a lease still held untrained when the hub shuts down cleanly; the counts are "
        "kept beside the spool files across restarts. A group one failure short of this is leased alone, so the good groups it was batched with "
        "train; at this many it moves to the spool's quarantine/ folder with the reason, is counted (quarantined in "
        "/metrics and /v1/hub/stats) and is never delivered again. 1: the first failure quarantines every group of "
        "the lease.")
    local_scoring: bool | None = Field(
        None, description="Score reference logprobs in the hub's own process (it loads ref_server.model). Null: "
        "whenever the hub scores the reference at all (algorithm.loss.beta > 0 or algorithm.kl.in_reward, and not "
        "learner.lora.reference: learner), today's behaviour. false: the hub loads no model and scorers that join "
        "(`grpo scorer --hub URL`) score the groups it holds; with none registered, groups wait (healthz: "
        "scoring 'no scorer'). docs/scale-out.md.")
    scorer_lease_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="A scoring job handed to a joined scorer and not answered within "
        "this many seconds (renewed by the scorer's heartbeat, every third of it) goes back to the queue for another "
        "scorer: a scorer killed, hung or gone loses no group.")
    scorer_wait_s: float = Field(
        60.0, gt=0, allow_inf_nan=False, description="Without local scoring: how long /v1/logprobs and "
        "/v1/completions wait for a joined scorer to answer before replying 503 with Retry-After and the reason "
        "(never hanging forever when no scorer is registered); while jobs wait with no scorer to take them (the "
        "reference's or the teacher's), the hub logs a warning this often.")
    scorer_max_bad_results: int = Field(
        3, ge=1, le=1000, description="Bad results a joined scorer may send (a result of the wrong shape or dtype, "
        "not finite, above 0, or for a job it does not hold) before the hub quarantines it: it is dropped from the "
        "pool, the jobs it holds go to the other scorers at once, and its next call (and a new registration under "
        "its name) is refused 403 with the reason; counted as scorers_quarantined in /metrics. A few, not 1: one bad "
        "result can be a transient fault, and each is refused and its job scored elsewhere anyway.")
    scoring_job_max_failures: int = Field(
        4, ge=1, le=1000, description="Failed attempts at one scoring job on joined scorers (bad results, leases "
        "that expired: a scorer killed or hung on it) before the hub gives up on it instead of handing it round "
        "forever: a group is dropped with the reasons in the log (dropped_ref_failure in /v1/hub/stats), a "
        "/v1/logprobs or /v1/completions request answers 503 with them; counted as jobs_given_up in /metrics.")
    max_scoring_jobs: int = Field(
        1024, ge=1, description="Scoring jobs (a group, or a /v1/logprobs request) the scorer pool holds waiting or "
        "leased; /v1/logprobs answers 503 with Retry-After above.")
    cpu_cores: list[int] | None = Field(
        None, min_length=1, description="CPU cores (as the kernel numbers them, e.g. [0]) the ref server's process "
        "and all its threads run on, set at start (sched_setaffinity) and logged. Null: no pinning, the process may "
        "run on any core it was given. The hub's threads share one interpreter lock: on a small machine one core "
        "serves more groups with less upload latency than threads floating over all cores (docs/hub-capacity.md). "
        "A reference model scored in this process (local_scoring) is limited to these cores too. A core this "
        "process may not use is an error before the server starts.")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Server log level.")
    access_log: bool = Field(False, description="Log one line per HTTP request (uvicorn's access log; "
                             "`grpo ref-server --access-log`). Off by default: a training run makes several "
                             "requests per step, and they drowned everything else in the log.")

    @field_validator("cpu_cores")
    @classmethod
    def _cores_valid(cls, cores: list[int] | None) -> list[int] | None:
        if cores is None:
            return None
        negative = [c for c in cores if c < 0]
        if negative:
            raise ValueError(f"core numbers are >= 0, got {negative[0]}")
        repeated = sorted({c for c in cores if cores.count(c) > 1})
        if repeated:
            raise ValueError(f"core {repeated[0]} is listed more than once")
        return cores

    @property
    def url(self) -> str:
        """The address other processes reach it at (a wildcard bind address is reached on the loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    def resolved_token(self) -> str | None:
        """The hub's bearer token: ``token``, else the GRPO_TOKEN environment variable, else None (no auth)."""
        return self.token or os.environ.get("GRPO_TOKEN") or None
