"""The client of a reference scorer that joins a hub (``grpo scorer --hub URL``): the ``/v1/scorers/*`` routes
(ref_server/scorer_pool/routes.py), over :class:`shared.protocol.client.ServiceClient`'s transport (its session,
token and retries). The jobs and results are bytes here: ``ref_server.scorer_pool.job_wire`` encodes and decodes
them."""

from __future__ import annotations

from shared.protocol.client import OCTET, ServiceClient


class ScorerClient(ServiceClient):
    def register(self, name: str, vocab_size: int, identity: dict) -> dict:
        """Join the hub: ``{"scorer_id", "lease_s", "hub_instance"}``. 409: another model than the hub's; 403: this
        scorer is quarantined; 404: the hub scores no reference."""
        return self._request("POST", "/v1/scorers", json={"name": name, "vocab_size": vocab_size,
                                                          **identity}).json()

    def heartbeat(self, scorer_id: str) -> None:
        """Renew the leases of the jobs this scorer holds (404: the hub does not know it any more)."""
        self._request("POST", f"/v1/scorers/{scorer_id}/heartbeat")

    def next_job(self, scorer_id: str, wait_s: float) -> bytes | None:
        """An encoded scoring job leased to this scorer, or None if none came within ``wait_s``."""
        response = self._request("GET", f"/v1/scorers/{scorer_id}/work", ok=(200, 204), params={"wait_s": wait_s},
                                 timeout_s=self.timeout_s + wait_s)
        return None if response.status_code == 204 else response.content

    def post_result(self, scorer_id: str, job_id: str, body: bytes) -> dict:
        """An encoded job result; the answer's ``status`` says what the hub made of it."""
        return self._request("POST", f"/v1/scorers/{scorer_id}/results/{job_id}", data=body,
                             headers={"Content-Type": OCTET}).json()

    def fail_job(self, scorer_id: str, job_id: str, reason: str) -> str:
        """This scorer could not score a job it holds: back to the queue at once (``requeued``, or ``unknown``)."""
        return self._request("POST", f"/v1/scorers/{scorer_id}/jobs/{job_id}/failed",
                             json={"reason": reason[:2000]}).json()["status"]

    def leave(self, scorer_id: str) -> None:
        """Leave the hub: the jobs still held go back to the queue at once."""
        self._request("DELETE", f"/v1/scorers/{scorer_id}")
