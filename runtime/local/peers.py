"""What local mode's supervisor tells the rest of the cluster, over HTTP.

The same fast path as the operator's (operator/failover/fast_path.py), for
processes on 127.0.0.1 instead of pods:

    POST {decode}/admin/fail_peer {"peer": "127.0.0.1:<bootstrap port>", ...}
        a prefill instance is lost: every decode fails its rooms at once
    POST {router}/admin/hold_worker {"url", "reason"} / admit_worker {"url"}
        the router sends nothing to a lost instance until it is back
    GET  {worker}/health, {decode}/get_server_info (`peers_down`)
        readiness of a restarted instance

Every call carries the cluster token and never raises: a dead or slow peer
is logged and never delays telling the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import httpx

from pdcluster.runtime.http.auth import bearer_headers
from pdcluster.runtime.local.plan import HOST, ProcessSpec
from pdcluster.runtime.pd.peer_address import BootstrapAddress

log = logging.getLogger(__name__)

# The operator's reason for a lost prefill: a local process stands for a pod.
PREFILL_LOST_REASON = "prefill_pod_lost"
CALL_TIMEOUT_S = 1.0


def bootstrap_address(spec: ProcessSpec) -> BootstrapAddress | None:
    if spec.bootstrap_port is None:
        return None
    return BootstrapAddress(f"{HOST}:{spec.bootstrap_port}")


class PeerNotifier:
    def __init__(self, token: str, router_url: str) -> None:
        # Loopback only: a proxy from the environment must not sit in between.
        self._http = httpx.Client(
            timeout=CALL_TIMEOUT_S, trust_env=False, headers=bearer_headers(token)
        )
        self._router = router_url

    def close(self) -> None:
        self._http.close()

    def _post(self, url: str, body: dict[str, object]) -> bool:
        try:
            resp = self._http.post(url, json=body)
        except httpx.HTTPError as err:
            log.warning("POST %s failed: %s", url, err)
            return False
        if resp.status_code != 200:
            log.warning("POST %s answered %s: %s", url, resp.status_code, resp.text[:200])
            return False
        return True

    def fail_prefill(self, spec: ProcessSpec, decodes: Iterable[ProcessSpec]) -> int:
        """Every decode fails the rooms tied to this (dead) prefill; returns how many answered."""
        peer = bootstrap_address(spec)
        if peer is None:
            return 0
        body = {"peer": peer, "reason": PREFILL_LOST_REASON, "gone": True}
        return sum(self._post(d.admin_url + "/admin/fail_peer", body) for d in decodes)

    def hold(self, spec: ProcessSpec, reason: str) -> bool:
        return self._post(self._router + "/admin/hold_worker", {"url": spec.url, "reason": reason})

    def admit(self, spec: ProcessSpec) -> bool:
        return self._post(self._router + "/admin/admit_worker", {"url": spec.url})

    def is_healthy(self, spec: ProcessSpec) -> bool:
        try:
            return self._http.get(spec.url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def is_seen_answering(self, spec: ProcessSpec, decode: ProcessSpec) -> bool:
        """Whether `decode` no longer holds this prefill dead (its `peers_down`).

        A decode told that a prefill was lost refuses new rooms on it until
        its heartbeat sees it answer again; the router must not send it any
        before that. A decode that does not answer holds no verdict worth
        waiting for.
        """
        peer = bootstrap_address(spec)
        if peer is None:
            return True  # no bootstrap server (vLLM): no decode holds it down
        try:
            resp = self._http.get(decode.admin_url + "/get_server_info")
        except httpx.HTTPError:
            return True
        if resp.status_code != 200:
            return True
        try:
            down = resp.json().get("peers_down") or {}
        except ValueError:
            return True
        return peer not in down
