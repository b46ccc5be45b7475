"""Calls to the workers' admin API (the operator's side of the failover fast path).

    POST {worker}/admin/fail_peer {"peer", "reason", "gone"}     fail the peer's rooms now
    GET  {worker}/admin/failures                                 cumulative failure counts
    PUT  {decode}/admin/prefill_peers {"peers": [...]}           bootstrap servers it may contact

Each carries `Authorization: Bearer <cluster token>`. Calls never raise on a
worker's failure: the result says what happened, so one dead or slow worker
never delays telling the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from pdcluster.operator.failure_counts import parse_failures
from pdcluster.runtime.pd_worker.admin_body import FailPeerRequest


@dataclass(frozen=True)
class AdminResult:
    url: str
    ok: bool
    # HTTP status (0: no answer) and what went wrong, for logs.
    status: int = 0
    error: str = ""


class AdminClient:
    def __init__(self, timeout_s: float = 2.0) -> None:
        # Workers are addressed by pod IP; a proxy from the environment must not
        # sit between the operator and them.
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False)

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _headers(token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def fail_peer(
        self, base_url: str, token: str | None, peer: str, reason: str, *, gone: bool = True
    ) -> AdminResult:
        """`gone`: the peer's processes can no longer run (False: it may be hung)."""
        url = f"{base_url}/admin/fail_peer"
        body = FailPeerRequest(peer, reason, gone).to_json()
        try:
            resp = await self._http.post(url, json=body, headers=self._headers(token))
        except httpx.HTTPError as err:
            return AdminResult(base_url, False, 0, f"{type(err).__name__}: {err}")
        if resp.status_code >= 400:
            return AdminResult(base_url, False, resp.status_code, resp.text[:200])
        return AdminResult(base_url, True, resp.status_code)

    async def prefill_peers(
        self, base_url: str, token: str | None, peers: list[str]
    ) -> AdminResult:
        """Replace the set of prefill bootstrap servers a decode worker may contact."""
        try:
            resp = await self._http.put(
                f"{base_url}/admin/prefill_peers",
                json={"peers": peers},
                headers=self._headers(token),
            )
        except httpx.HTTPError as err:
            return AdminResult(base_url, False, 0, f"{type(err).__name__}: {err}")
        if resp.status_code >= 400:
            return AdminResult(base_url, False, resp.status_code, resp.text[:200])
        return AdminResult(base_url, True, resp.status_code)

    async def failures(self, base_url: str, token: str | None) -> dict[str, int] | None:
        """Reason -> count, or None when the worker did not answer sensibly."""
        try:
            resp = await self._http.get(f"{base_url}/admin/failures", headers=self._headers(token))
            if resp.status_code != 200:
                return None
            return parse_failures(resp.json())
        except (httpx.HTTPError, ValueError):
            return None
