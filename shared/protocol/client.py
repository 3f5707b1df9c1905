"""HTTP clients of the reference server / hub: :class:`HubClient`, used by generators, the learner and any other
tool, and (:mod:`shared.protocol.scorer_client`) the client of a joined reference scorer. Every call to the hub goes
through one of them; both share :class:`ServiceClient`'s transport:

* one ``requests.Session`` (connection reuse), a timeout on every call;
* retries with exponential backoff (honouring ``Retry-After``) on connection errors, responses cut short after
  their headers, 429 and 5xx, within a wall-clock budget that a shutting-down service can end at once (``abort``).
  urllib3's ``Retry`` counts attempts, cannot retry a body truncated after its headers and knows no abort flag,
  so the loop is ours;
* a server that stays unreachable raises :class:`HubUnavailable` after ``max_retry_s`` — it never looks like an
  empty queue; an empty queue is ``None`` from :meth:`HubClient.lease_batch` (HTTP 204);
* any other 4xx raises :class:`HubError` carrying the server's ``detail``.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from shared.errors import GrpoError, ServiceError
from shared.protocol.curriculum_messages import CurriculumAnswer, CurriculumReport
from shared.protocol.logprob_messages import decode_logprob_response, encode_logprob_request
from shared.protocol.records import RolloutGroup, TrainBatch
from shared.protocol.weight_sync_messages import (
    Announcement,
    JoinRequest,
    MemberAnswer,
    MemberPoll,
    MemberReport,
    OfferPost,
    SenderInfo,
    SenderWork,
    SyncStatus,
)
from shared.protocol.wire import encode_messages

log = logging.getLogger("grpo.client")
OCTET = "application/octet-stream"
RETRY_STATUSES = {429, 500, 502, 503, 504}
# names the learner session a version report or a weights upload comes from (POST /v1/learner/session)
LEARNER_SESSION_HEADER = "X-Learner-Session"


class HubError(GrpoError):
    """The server answered with an error that retrying will not fix (4xx other than 429)."""

    def __init__(self, status: int, detail: object, url: str) -> None:
        super().__init__(f"{url} answered {status}: {detail}")
        self.status, self.detail, self.url = status, detail, url


class HubUnavailable(ServiceError, ConnectionError):
    """The server could not be reached (or kept answering 429/5xx) for longer than the retry budget."""


class LearnerSession:
    """The learner's registration with the hub, shared by every client of the learner (one per thread): once set,
    each request names the session, and the hub takes version reports and weights uploads only from it."""

    def __init__(self) -> None:
        self.id: str | None = None


@dataclass
class RetryPolicy:
    max_retry_s: float = 60.0     # give up after retrying this long
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0


class ServiceClient:
    """The transport every client of the hub shares: a session, the token, retries within a budget."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 60.0,
                 retry: RetryPolicy | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.session = requests.Session()
        # Set by a service that is shutting down: calls in flight finish, but failures are no longer retried.
        self.abort = threading.Event()
        self.learner: LearnerSession | None = None  # set on the learner's clients: requests name its session
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sibling(self, *, timeout_s: float | None = None, retry: RetryPolicy | None = None):
        """A new client of the same server, with the same credentials and learner session, and its own HTTP
        session (for another thread: a ``requests.Session`` is not meant to be shared between threads)."""
        other = type(self)(self.base_url, timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                           retry=retry or self.retry)
        other.session.headers.update(self.session.headers)
        other.learner = self.learner
        return other

    # -- transport ----------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, ok: tuple[int, ...] = (200,), timeout_s: float | None = None,
                 rewind: Callable[[], None] | None = None, **kwargs) -> requests.Response:
        url = f"{self.base_url}{path}"
        deadline = time.monotonic() + self.retry.max_retry_s
        backoff = self.retry.initial_backoff_s
        attempt = 0
        while True:
            attempt += 1
            problem: str
            wait = backoff
            if rewind is not None:
                rewind()  # a streamed body must start from its beginning on every attempt
            if self.learner is not None and self.learner.id is not None:
                kwargs["headers"] = {**kwargs.get("headers", {}), LEARNER_SESSION_HEADER: self.learner.id}
            try:
                response = self.session.request(method, url, timeout=timeout_s or self.timeout_s, **kwargs)
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                    requests.exceptions.ContentDecodingError) as exc:
                problem = f"cannot reach {url}: {type(exc).__name__}"
            else:
                if response.status_code in ok:
                    return response
                if response.status_code not in RETRY_STATUSES:
                    raise HubError(response.status_code, _detail(response), url)
                problem = f"{url} answered {response.status_code}: {_detail(response)}"
                retry_after = response.headers.get("Retry-After", "")
                if retry_after.replace(".", "", 1).isdigit():
                    wait = max(wait, float(retry_after))
            if self.abort.is_set():
                raise HubUnavailable(f"{problem} (not retried: shutting down)")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HubUnavailable(f"{problem} (the hub stayed unreachable: gave up after {attempt} attempts, "
                                     f"{self.retry.max_retry_s:.0f}s)")
            wait = min(wait * (0.75 + 0.5 * random.random()), remaining)
            log.warning("%s; retrying in %.1fs", problem, wait)
            time.sleep(wait)
            backoff = min(backoff * 2, self.retry.max_backoff_s)


class HubClient(ServiceClient):
    """The hub's API for generators, the learner and tools (reference logprobs, rollouts, batches, the learner
    session, weights and the weight-sync rendezvous)."""

    def __init__(self, base_url: str, **kwargs) -> None:
        super().__init__(base_url, **kwargs)
        self._batch_upload = True  # False once the hub answered 404 to POST /v1/rollouts/batch

    # -- reference logprobs ---------------------------------------------------------------------------------
    def health(self) -> dict:
        return self._request("GET", "/healthz").json()

    def logprobs(self, input_ids: list[list[int]], prompt_lengths: list[int], *, temperature: float = 1.0,
                 binary: bool = True) -> list[list[float]]:
        """Reference logprobs of each row's completion tokens (see the /v1/logprobs contract)."""
        if binary:
            body = encode_logprob_request(input_ids, prompt_lengths, temperature)
            response = self._request("POST", "/v1/logprobs", data=body, headers={"Content-Type": OCTET})
            return [row.tolist() for row in decode_logprob_response(response.content)]
        payload = {"input_ids": input_ids, "prompt_lengths": prompt_lengths, "temperature": temperature}
        return self._request("POST", "/v1/logprobs", json=payload).json()["logprobs"]

    # -- hub ----------------------------------------------------------------------------------------------
    def upload_group(self, group: RolloutGroup) -> dict:
        """Queue a group; retried (with backoff) while the hub is full. Answer includes ``queue_depth``."""
        response = self._request("POST", "/v1/rollouts", data=group.to_bytes(), headers={"Content-Type": OCTET})
        return response.json()

    def upload_groups(self, groups: list[RolloutGroup]) -> list[dict]:
        """Queue several groups in one request (``POST /v1/rollouts/batch``): one answer per group, in order; the
        whole request is retried while the hub is full (groups it already took are answered as duplicates). A hub
        without that endpoint (an older ref server) gets one request per group."""
        if not groups:
            return []
        if not self._batch_upload:
            return [self.upload_group(group) for group in groups]
        body = encode_messages([group.to_bytes() for group in groups])
        try:
            response = self._request("POST", "/v1/rollouts/batch", data=body, headers={"Content-Type": OCTET})
        except HubError as exc:
            if exc.status != 404:
                raise
            log.warning("the hub has no POST /v1/rollouts/batch (an older ref server): one request per group")
            self._batch_upload = False
            return [self.upload_group(group) for group in groups]
        return response.json()["answers"]

    def lease_batch(self, num_groups: int, *, wait_s: float = 0.0, min_version: int | None = None,
                    request_id: str | None = None) -> bytes | None:
        """An encoded :class:`TrainBatch` of ``num_groups`` groups leased to us, or None if the hub did not have them
        within ``wait_s``. The bytes, not the batch: the learner times their decoding apart from the transfer.
        ``min_version``: groups older than this are stale for this batch (the hub drops them). ``request_id``: names
        this call, so that :meth:`release_batches` can hand back what it grants even before its answer arrives.

        Acknowledge it with :meth:`ack_batches` once trained on (or hand it back with :meth:`release_batches`), or
        its groups return to the queue after the hub's lease timeout."""
        params = {"num_groups": num_groups, "timeout": wait_s}
        if min_version is not None:
            params["min_version"] = min_version
        if request_id is not None:
            params["request_id"] = request_id
        response = self._request("GET", "/v1/batch", params=params, ok=(200, 204), timeout_s=self.timeout_s + wait_s)
        return None if response.status_code == 204 else response.content

    def get_batch(self, num_groups: int, *, wait_s: float = 0.0, min_version: int | None = None) -> TrainBatch | None:
        """:meth:`lease_batch`, decoded (tools, benchmarks and tests: the learner decodes apart, to time it)."""
        data = self.lease_batch(num_groups, wait_s=wait_s, min_version=min_version)
        return None if data is None else TrainBatch.from_bytes(data)

    def release_batches(self, batch_ids: Sequence[str], request_ids: Sequence[str] = ()) -> dict[str, str]:
        """Hand back leases that will not be trained: by batch id, and by the ``request_id`` of a
        :meth:`lease_batch` call (whatever it was or will be granted). Per id ``released``, ``cancelled`` (a
        request granted nothing yet) or ``unknown``."""
        return self._request("POST", "/v1/batch/release", json={"batch_ids": list(batch_ids),
                                                                "request_ids": list(request_ids)}).json()["batches"]

    def ack_batches(self, batch_ids: list[str]) -> dict[str, str]:
        """Tell the hub these batches are applied; per id ``acked``, ``already``, ``late`` or ``unknown``."""
        return self._request("POST", "/v1/batch/ack", json={"batch_ids": batch_ids}).json()["batches"]

    def renew_batches(self, batch_ids: list[str], *, trained: bool = False) -> dict[str, str]:
        """Keep these leases for another lease timeout (per id ``renewed`` or ``unknown``); ``trained``: they are
        trained and held only for a checkpoint (the hub then paces generators without them)."""
        body = {"batch_ids": batch_ids, "trained": True} if trained else {"batch_ids": batch_ids}
        return self._request("POST", "/v1/batch/renew", json=body).json()["batches"]

    def report_version(self, version: int, groups_per_step: int | None = None) -> dict:
        body = {"version": version} if groups_per_step is None else {"version": version,
                                                                     "groups_per_step": groups_per_step}
        return self._request("POST", "/v1/learner/version", json=body).json()

    def register_learner(self, version: int, groups_per_step: int | None = None,
                         layout: list[list] | None = None, *, resume_session: str | None = None,
                         trained_batches: list[str] = ()) -> dict:
        """Register as the hub's learner at ``version`` (it may move the hub's version back), with the model's
        layout (weights uploads must match it); the session id goes into ``self.learner`` (created if None), which
        the learner's other clients share. ``resume_session``: the session a resumed learner takes back (a new
        registration is refused, 409, while another session is live), with ``trained_batches``, the leases its
        checkpoint holds (kept; every other lease of the earlier session is released at once)."""
        body = {"version": version, "groups_per_step": groups_per_step, "layout": layout}
        if resume_session is not None:
            body |= {"resume_session": resume_session, "trained_batches": list(trained_batches)}
        answer = self._request("POST", "/v1/learner/session", json=body).json()
        if self.learner is None:
            self.learner = LearnerSession()
        self.learner.id = answer["session"]
        return answer

    def renew_learner_session(self) -> None:
        """The learner's heartbeat: its session stays live (nothing to do before it registered)."""
        if self.learner is not None and self.learner.id is not None:
            self._request("POST", "/v1/learner/session/renew")

    def end_learner_session(self) -> None:
        """The learner exits: another learner may register at once."""
        if self.learner is not None and self.learner.id is not None:
            self._request("DELETE", "/v1/learner/session")

    def rollout_budget(self, policy_version: int, *, wait_s: float = 0.0) -> dict:
        """``{"wanted": n or None, ...}``: groups at ``policy_version`` the learner can still train (long-polls up to
        ``wait_s`` while 0)."""
        return self._request("GET", "/v1/rollouts/budget", params={"policy_version": policy_version,
                                                                   "wait_s": wait_s},
                             timeout_s=self.timeout_s + wait_s).json()

    def hub_stats(self) -> dict:
        return self._request("GET", "/v1/hub/stats").json()

    def curriculum_report(self, report: CurriculumReport) -> CurriculumAnswer | None:
        """Add solved shares and draws to the hub's pass-rate table (``POST /v1/curriculum``) and read its settled
        prompts; None when the hub has no such route (an older hub: the generator keeps its own table)."""
        try:
            response = self._request("POST", "/v1/curriculum", json=report.model_dump(mode="json"))
        except HubError as exc:
            if exc.status != 404:
                raise
            return None
        return CurriculumAnswer.model_validate(response.json())

    # -- weights ------------------------------------------------------------------------------------------
    def weights_version(self) -> int | None:
        return self._request("GET", "/v1/weights").json()["version"]

    def upload_weights(self, version: int, path: str | Path) -> dict:
        """Stream a safetensors file to the relay as ``version`` (bounded memory: one chunk at a time)."""
        with open(path, "rb") as fh:
            # requests streams a file object in blocks and sends its size as Content-Length.
            return self._request("PUT", f"/v1/weights/{version}", data=fh, rewind=lambda: fh.seek(0),
                                 headers={"Content-Type": OCTET}, timeout_s=max(self.timeout_s, 600.0)).json()

    def upload_weights_stream(self, version: int, stream) -> dict:
        """Upload a safetensors stream (``read``, ``seek``, ``__len__``: e.g. the learner's send buffer)."""
        return self._request("PUT", f"/v1/weights/{version}", data=stream, rewind=lambda: stream.seek(0),
                             headers={"Content-Type": OCTET}, timeout_s=max(self.timeout_s, 600.0)).json()

    def download_weights(self, version: int, dest: str | Path, chunk_bytes: int = 8 * 2**20) -> Path:
        """Stream a published version to ``dest``: written to a temporary name of its own (another process may be
        downloading to the same folder), then renamed."""
        dest = Path(dest)
        response = self._request("GET", f"/v1/weights/{version}", stream=True, timeout_s=max(self.timeout_s, 600.0))
        fd, name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".partial")
        partial = Path(name)
        try:
            with os.fdopen(fd, "wb") as fh:
                for block in response.iter_content(chunk_bytes):
                    fh.write(block)
            partial.replace(dest)
        finally:
            response.close()
            partial.unlink(missing_ok=True)
        return dest

    # -- weight-sync rendezvous (shared/protocol/weight_sync_messages.py) -----------------------------------
    def sync_status(self) -> SyncStatus:
        """The registered sender (or None), the announced version, members per state, the relay's version."""
        return SyncStatus.model_validate(self._request("GET", "/v1/weights/sync").json())

    def sync_register_sender(self, info: SenderInfo) -> None:
        self._request("PUT", "/v1/weights/sync/sender", json=info.model_dump(mode="json"))

    def sync_unregister_sender(self, sender_id: str) -> None:
        self._request("DELETE", f"/v1/weights/sync/sender/{sender_id}")

    def sync_announce(self, announcement: Announcement) -> None:
        self._request("POST", "/v1/weights/sync/announce", json=announcement.model_dump(mode="json"))

    def sync_work(self, sender_id: str, wait_s: float) -> SenderWork:
        """The sender's long poll: join requests to answer, silent members, how many members use HTTP only."""
        response = self._request("GET", "/v1/weights/sync/work", params={"sender_id": sender_id, "wait_s": wait_s},
                                 timeout_s=self.timeout_s + wait_s)
        return SenderWork.model_validate(response.json())

    def sync_offer(self, post: OfferPost) -> None:
        self._request("POST", "/v1/weights/sync/offers", json=post.model_dump(mode="json"))

    def sync_member_state(self, member_id: str, report: MemberReport) -> None:
        self._request("POST", f"/v1/weights/sync/members/{member_id}/state", json=report.model_dump(mode="json"))

    def sync_join(self, request: JoinRequest) -> str:
        """Ask to join; returns the member id the hub gave us (the offer comes through :meth:`sync_poll`)."""
        return self._request("POST", "/v1/weights/sync/members", json=request.model_dump(mode="json")).json()[
            "member_id"]

    def sync_poll(self, member_id: str, poll: MemberPoll) -> MemberAnswer:
        """What a member does now: wait, connect (with the offer), receive, idle or rejoin."""
        response = self._request("POST", f"/v1/weights/sync/members/{member_id}/poll",
                                 json=poll.model_dump(mode="json"), timeout_s=self.timeout_s + poll.wait_s)
        return MemberAnswer.model_validate(response.json())

    def sync_leave(self, member_id: str) -> None:
        self._request("DELETE", f"/v1/weights/sync/members/{member_id}")


def _detail(response: requests.Response) -> object:
    try:
        return response.json().get("detail", response.text[:500])
    except ValueError:
        return response.text[:500]


def service_client(url: str, token: str | None, retry_max_s: float, kind: type[ServiceClient] = HubClient):
    """The client (a :class:`HubClient` unless ``kind`` says otherwise) a service uses: the config's token or
    GRPO_TOKEN, and its retry budget."""
    return kind(url, token=token or os.environ.get("GRPO_TOKEN"), retry=RetryPolicy(max_retry_s=retry_max_s))


def stop_on_signals(stop: threading.Event, client: ServiceClient, what_happens: str) -> None:
    """SIGINT/SIGTERM (main thread only) set ``stop`` and make ``client`` stop retrying a dead hub, so a service
    finishes what it is doing and exits instead of waiting out its retry budget."""
    if threading.current_thread() is not threading.main_thread():
        return

    def request_stop(signum, frame):
        log.info("%s received: %s", signal.Signals(signum).name, what_happens)
        stop.set()
        client.abort.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
