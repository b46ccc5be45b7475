"""Calls to the workers' admin API (the operator's side of the failover fast path).

    POST {worker}/admin/fail_peer {"peer", "reason", "gone"}     fail the peer's rooms now
    GET  {worker}/admin/failures                                 cumulative failure counts
    GET  {worker}/health                                         200, or 503 {status, reason}
    PUT  {decode}/admin/prefill_peers {"peers": [...]}           bootstrap servers it may contact
    GET  {worker}/get_server_info                                kv_transport: what UCX negotiated

The admin calls carry `Authorization: Bearer <cluster token>` (/health is
open). Calls never raise on a worker's failure: the result says what
happened, so one dead or slow worker never delays telling the others. A
worker's answer is read up to `MAX_RESPONSE_BYTES` and no further: a larger
one counts as no answer, so a misbehaving (or hostile) pod cannot make the
operator buffer without bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from pdcluster.operator.failover.failure_counts import parse_failures
from pdcluster.runtime.pd.peer_address import BootstrapAddress, PeerRef
from pdcluster.runtime.pd_worker.admin_body import FailPeerRequest

# /admin/failures of a large instance is a few KiB; 1 MiB is far above it.
MAX_RESPONSE_BYTES = 1 << 20
ERROR_TEXT_CHARS = 200


class ResponseTooLarge(Exception):
    pass


async def read_capped(resp: httpx.Response, limit: int = MAX_RESPONSE_BYTES) -> bytes:
    """The body of a streamed response; raises ResponseTooLarge past `limit` bytes."""
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ResponseTooLarge(f"{declared} bytes declared (limit {limit})")
    body = bytearray()
    async for chunk in resp.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise ResponseTooLarge(f"more than {limit} bytes")
    return bytes(body)


@dataclass(frozen=True)
class AdminResult:
    url: str
    ok: bool
    # HTTP status (0: no answer) and what went wrong, for logs.
    status: int = 0
    error: str = ""


class AdminClient:
    def __init__(
        self,
        timeout_s: float = 2.0,
        *,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        # Workers are addressed by pod IP; a proxy from the environment must not
        # sit between the operator and them.
        self._http = httpx.AsyncClient(timeout=timeout_s, trust_env=False, transport=transport)
        self._max_bytes = max_response_bytes

    async def aclose(self) -> None:
        await self._http.aclose()

    @staticmethod
    def _headers(token: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"} if token else {}

    async def fail_peer(
        self,
        base_url: str,
        token: str | None,
        peer: PeerRef,
        reason: str,
        *,
        gone: bool = True,
        incarnation: str | None = None,
    ) -> AdminResult:
        """`gone`: the peer's processes can no longer run (False: it may be hung);
        `incarnation`: which start of the peer (a pod uid)."""
        url = f"{base_url}/admin/fail_peer"
        body = FailPeerRequest(peer, reason, gone, incarnation).to_json()
        try:
            async with self._http.stream(
                "POST", url, json=body, headers=self._headers(token)
            ) as resp:
                if resp.status_code < 400:
                    return AdminResult(base_url, True, resp.status_code)
                text = await read_capped(resp, self._max_bytes)
        except httpx.HTTPError as err:
            return AdminResult(base_url, False, 0, f"{type(err).__name__}: {err}")
        except ResponseTooLarge as err:
            return AdminResult(base_url, False, resp.status_code, f"error body: {err}")
        error = text.decode("utf-8", "replace")[:ERROR_TEXT_CHARS]
        return AdminResult(base_url, False, resp.status_code, error)

    async def prefill_peers(
        self, base_url: str, token: str | None, peers: list[BootstrapAddress]
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
        """Reason -> count, or None when the worker did not answer sensibly
        (an error, not JSON, or larger than the response limit)."""
        answered, body = await self._get_json(base_url, "/admin/failures", token)
        return parse_failures(body) if answered else None

    async def server_info(self, base_url: str, token: str | None) -> dict[str, Any] | None:
        """The worker's `/get_server_info`, or None when it did not answer sensibly."""
        answered, info = await self._get_json(base_url, "/get_server_info", token)
        return info if answered and isinstance(info, dict) else None

    async def _get_json(self, base_url: str, path: str, token: str | None) -> tuple[bool, Any]:
        """(True, the decoded body) of a 200 to GET `path`; (False, None) on an error, another
        status, a body that is not JSON or one larger than the response limit."""
        try:
            async with self._http.stream(
                "GET", f"{base_url}{path}", headers=self._headers(token)
            ) as resp:
                if resp.status_code != 200:
                    return False, None
                data = await read_capped(resp, self._max_bytes)
            return True, json.loads(data)
        except (httpx.HTTPError, ValueError, ResponseTooLarge):
            return False, None

    async def health(self, base_url: str) -> tuple[bool, str | None]:
        """(answered, reason): reason None when healthy, the worker's 503 reason otherwise."""
        try:
            resp = await self._http.get(f"{base_url}/health")
        except httpx.HTTPError:
            return False, None
        if resp.status_code == 200:
            return True, None
        try:
            body = resp.json()
        except ValueError:
            body = None
        reason = body.get("reason") if isinstance(body, dict) else None
        return True, str(reason) if reason else f"http_{resp.status_code}"
