"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, bounded so that an error body names
the problem and never echoes a big input back. One home for every server that speaks OpenAI's API: the ref server's
OpenAI-style routes (ref_server/http.py) and the generator's agent endpoint (generator/agent/)."""

from __future__ import annotations

from typing import Any

MAX_ERROR_TEXT = 300  # characters of any one string in an error body
MAX_ERROR_ITEMS = 10  # items of any one list or object in an error body


def bounded(value: Any, depth: int = 0) -> Any:
    """``value`` cut to a few hundred characters per string and a few items per list, 4 levels deep: an error body
    names the problem and never echoes a big input back."""
    if isinstance(value, str):
        return value if len(value) <= MAX_ERROR_TEXT else value[:MAX_ERROR_TEXT] + f"... ({len(value)} chars)"
    if depth >= 4:
        return "..."
    if isinstance(value, (list, tuple)):
        items = [bounded(v, depth + 1) for v in value[:MAX_ERROR_ITEMS]]
        return items + [f"... ({len(value) - MAX_ERROR_ITEMS} more)"] if len(value) > MAX_ERROR_ITEMS else items
    if isinstance(value, dict):
        return {bounded(str(k), depth + 1): bounded(v, depth + 1)
                for k, v in list(value.items())[:MAX_ERROR_ITEMS]}
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return bounded(str(value), depth)


# OpenAI's "type" per status (https://platform.openai.com/docs/guides/error-codes); unlisted 4xx: a bad request
OPENAI_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                      404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                      409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error",
                      429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


def openai_error(status: int, message: Any, *, param: Any = None, code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``, bounded: what OpenAI answers and its clients read."""
    text = message if isinstance(message, str) else "; ".join(_problem_text(m) for m in _as_list(message))
    kind = OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": bounded(text), "type": kind, "param": bounded(param), "code": code}}


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _problem_text(problem: Any) -> str:
    """One validation problem (``{"loc", "msg"}``) as ``where: what``."""
    if isinstance(problem, dict) and "msg" in problem:
        where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
        return f"{where or 'body'}: {problem['msg']}"
    return str(problem)
