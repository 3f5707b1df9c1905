"""The request guard's settings (:mod:`ref_server.limits`): each route's body limit, the body deadline."""

from __future__ import annotations

from dataclasses import dataclass

# routes whose bodies are bulk data, by (method, path template): the BodyLimits field that bounds them
LARGE_BODIES: dict[tuple[str, str], str] = {
    ("POST", "/v1/rollouts"): "request_bytes", ("POST", "/v1/rollouts/batch"): "request_bytes",
    ("POST", "/v1/logprobs"): "request_bytes", ("POST", "/v1/completions"): "request_bytes",
    ("POST", "/tokenize"): "request_bytes", ("POST", "/detokenize"): "request_bytes",
    ("PUT", "/v1/weights/{version}"): "weight_bytes",
    # an offer carries the model's layout, [name, dtype, shape] per tensor: megabytes for a large MoE
    ("POST", "/v1/weights/sync/offers"): "request_bytes",
    # a learner registers its layout with its session: the same tensor list
    ("POST", "/v1/learner/session"): "request_bytes",
}


@dataclass(frozen=True)
class BodyLimits:
    """The guard's settings (``ref_server.max_*`` and ``body_timeout_s`` in the config)."""

    json_bytes: int = 2**20
    request_bytes: int = 64 * 2**20
    weight_bytes: int = 256 * 2**30
    timeout_s: float = 30.0
    min_bytes_per_s: float = 256 * 1024

    def for_route(self, method: str, path_template: str | None) -> int:
        return getattr(self, LARGE_BODIES.get((method, path_template or ""), "json_bytes"))
