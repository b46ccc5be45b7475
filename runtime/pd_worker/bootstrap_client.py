"""Async client of a prefill instance's bootstrap server (httpx).

Everything is `async`: a decode scheduler awaits these from its event loop
and is never blocked by a slow or absent server (docs/design.md §4: a synchronous
fetch once stalled decode for over a minute).

- `register(reg)` — a prefill rank announces itself; retried with
  exponential backoff while the server is unreachable or answers 5xx (rank
  0 may still be starting); a 4xx is final.
- `instance(wait_s)` — the instance info (`GET /route` with -1s), retried on
  503 until `wait_s`; cached. Concurrent callers share one fetch.
- `rank_endpoint(rank)` — a rank's control endpoint; answered from the
  cached instance info when present, else `GET /route` for that rank; cached.
- `invalidate()` — forget cached answers (heartbeat declared the instance
  dead; it may come back with new ports).
- `probe()` — the heartbeat probe: None when `/health` gave no 200 answer,
  else the answer's start id (`""`: the server names none); never raises.
  `health()` — the same as True/False.
- `register_dp_rank`, `query_dp_ranks` — the room → dp-group table.

Errors are typed (`BootstrapError` and subclasses); none leaks an httpx
exception. `BootstrapPool` keeps one client per prefill instance over one
shared connection pool.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from pdcluster.runtime.backoff import ExponentialBackoff
from pdcluster.runtime.pd.bootstrap_registry import InstanceInfo, RankAddress, RankRegistration
from pdcluster.runtime.pd.coords import RankCoord

# The longest start id a probe answer may name (ours are 16 hex digits).
MAX_START_CHARS = 64


class BootstrapError(Exception):
    """Base of every error this client raises."""


class BootstrapUnreachable(BootstrapError):
    """No usable answer after every retry (connection refused, timeouts, 5xx)."""


class BootstrapNotReady(BootstrapError):
    def __init__(self, registered: int, expected: int) -> None:
        super().__init__(f"prefill instance not ready: {registered}/{expected} ranks registered")
        self.registered = registered
        self.expected = expected


class BootstrapRejected(BootstrapError):
    """The server refused the request (4xx); `field` names the offending field if known."""

    def __init__(self, status: int, detail: str, field: str | None = None) -> None:
        super().__init__(f"bootstrap server answered {status}: {detail}")
        self.status = status
        self.detail = detail
        self.field = field


class BootstrapAuthError(BootstrapRejected):
    """401 (no token) or 403 (wrong token)."""


class BootstrapProtocolError(BootstrapError):
    """The server answered something that is not the expected JSON."""


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 6
    backoff: ExponentialBackoff = ExponentialBackoff()

    def delays(self) -> Iterator[float]:
        """Sleep before attempt 2, 3, ... (attempts - 1 values)."""
        return itertools.islice(self.backoff.delays(), max(0, self.attempts - 1))


def base_url(address: str) -> str:
    """'10.0.0.5:8998' or 'http://10.0.0.5:8998/' → 'http://10.0.0.5:8998'."""
    address = address.strip().rstrip("/")
    if not address:
        raise ValueError("bootstrap address is empty")
    return address if "://" in address else f"http://{address}"


class BootstrapClient:
    def __init__(
        self,
        address: str,
        token: str | None,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 2.0,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.url = base_url(address)
        self._headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        self._own_client = client is None
        self._http = client or httpx.AsyncClient()
        self._timeout = timeout_s
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._instance: InstanceInfo | None = None
        self._instance_fetch: asyncio.Future[InstanceInfo] | None = None
        self._endpoints: dict[RankCoord, str] = {}

    async def aclose(self) -> None:
        if self._own_client:
            await self._http.aclose()

    def invalidate(self) -> None:
        self._instance = None
        self._endpoints.clear()

    @property
    def cached_instance(self) -> InstanceInfo | None:
        return self._instance

    # ---------------------------------------------------------------- requests

    async def _request(
        self, method: str, path: str, *, json: Any = None, params: dict[str, int] | None = None
    ) -> httpx.Response:
        try:
            return await self._http.request(
                method,
                self.url + path,
                json=json,
                params=params,
                headers=self._headers,
                timeout=self._timeout,
            )
        except httpx.HTTPError as err:
            raise BootstrapUnreachable(f"{method} {self.url}{path}: {err!r}") from None

    @staticmethod
    def _raise_for(resp: httpx.Response) -> None:
        if resp.status_code < 400:
            return
        try:
            body = resp.json()
        except ValueError:
            body = {}
        detail = str(body.get("error") or resp.text[:200]) if isinstance(body, dict) else ""
        field = body.get("field") if isinstance(body, dict) else None
        if resp.status_code in (401, 403):
            raise BootstrapAuthError(resp.status_code, detail, field)
        if resp.status_code == 503 and isinstance(body, dict) and "registered" in body:
            raise BootstrapNotReady(int(body["registered"]), int(body["expected"]))
        if resp.status_code >= 500:
            raise BootstrapUnreachable(f"bootstrap server answered {resp.status_code}: {detail}")
        raise BootstrapRejected(resp.status_code, detail, field)

    async def _with_retry(self, call: Callable[[], Awaitable[httpx.Response]]) -> httpx.Response:
        delays = self.retry.delays()
        while True:
            try:
                resp = await call()
                self._raise_for(resp)
                return resp
            except BootstrapUnreachable:
                delay = next(delays, None)
                if delay is None:
                    raise
                await self._sleep(delay)

    @staticmethod
    def _decode(resp: httpx.Response, kind: type[Any]) -> Any:
        try:
            return msgspec.json.decode(resp.content, type=kind)
        except msgspec.MsgspecError as err:
            raise BootstrapProtocolError(
                f"unexpected answer from bootstrap server: {err}"
            ) from None

    # -------------------------------------------------------------------- API

    async def register(self, reg: RankRegistration) -> bool:
        """Register a prefill rank; True if the server had not seen it."""
        body = msgspec.to_builtins(reg)
        resp = await self._with_retry(lambda: self._request("PUT", "/route", json=body))
        answer = self._decode(resp, dict[str, Any])
        return bool(answer.get("new"))

    async def instance(self, wait_s: float = 30.0) -> InstanceInfo:
        """The instance info, waiting up to `wait_s` for every rank to register."""
        if self._instance is not None:
            return self._instance
        if self._instance_fetch is None or self._instance_fetch.done():
            self._instance_fetch = asyncio.ensure_future(self._fetch_instance(wait_s))
        # Shielded: one caller giving up must not cancel the fetch others wait on.
        return await asyncio.shield(self._instance_fetch)

    async def _fetch_instance(self, wait_s: float) -> InstanceInfo:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        params = {"dp": -1, "cp": -1, "tp": -1, "pp": -1}
        delays = self.retry.delays()
        delay = self.retry.backoff.base_s
        while True:
            try:
                resp = await self._with_retry(lambda: self._request("GET", "/route", params=params))
                info: InstanceInfo = self._decode(resp, InstanceInfo)
                break
            except BootstrapNotReady:
                delay = next(delays, delay)
                if loop.time() + delay > deadline:
                    raise
                await self._sleep(delay)
        self._instance = info
        for entry in info.ranks:
            self._endpoints[entry.rank] = entry.endpoint
        return info

    async def rank_endpoint(self, rank: RankCoord) -> str:
        cached = self._endpoints.get(rank)
        if cached is not None:
            return cached
        params = {"dp": rank.dp, "cp": rank.cp, "tp": rank.tp, "pp": rank.pp}
        resp = await self._with_retry(lambda: self._request("GET", "/route", params=params))
        entry: RankAddress = self._decode(resp, RankAddress)
        endpoint: str = entry.endpoint
        self._endpoints[rank] = endpoint
        return endpoint

    async def probe(self, timeout_s: float | None = None) -> str | None:
        """`GET /health`: None unless it answered 200, else the start id it names
        (`""` when none: an older server, or a body that is not ours)."""
        try:
            resp = await self._http.get(self.url + "/health", timeout=timeout_s or self._timeout)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            start = resp.json().get("start")
        except (ValueError, AttributeError):
            return ""
        return start if isinstance(start, str) and 0 < len(start) <= MAX_START_CHARS else ""

    async def health(self, timeout_s: float | None = None) -> bool:
        return await self.probe(timeout_s) is not None

    async def register_dp_rank(self, room: int, dp_rank: int) -> None:
        body = {"room": room, "dp_rank": dp_rank}
        await self._with_retry(lambda: self._request("POST", "/register_dp_rank", json=body))

    async def query_dp_ranks(self, rooms: list[int]) -> dict[int, int]:
        body = {"rooms": rooms}
        resp = await self._with_retry(lambda: self._request("POST", "/query_dp_ranks", json=body))
        answer = self._decode(resp, dict[str, dict[str, int]])
        try:
            return {int(room): dp for room, dp in answer.get("dp_ranks", {}).items()}
        except ValueError:
            raise BootstrapProtocolError("dp_ranks keys are not room numbers") from None


class BootstrapPool:
    """One `BootstrapClient` per prefill instance address, over one connection pool."""

    def __init__(
        self, token: str | None, *, timeout_s: float = 2.0, retry: RetryPolicy | None = None
    ):
        self._token = token
        self._timeout = timeout_s
        self._retry = retry
        self._http = httpx.AsyncClient()
        self._clients: dict[str, BootstrapClient] = {}

    def get(self, address: str) -> BootstrapClient:
        key = base_url(address)
        client = self._clients.get(key)
        if client is None:
            client = BootstrapClient(
                key, self._token, client=self._http, timeout_s=self._timeout, retry=self._retry
            )
            self._clients[key] = client
        return client

    def invalidate(self, address: str) -> None:
        client = self._clients.get(base_url(address))
        if client is not None:
            client.invalidate()

    def discard(self, address: str) -> bool:
        """Close and forget the client of `address` (its cached answers go with it).

        The next `get` makes a fresh one. True if there was one.
        """
        client = self._clients.pop(base_url(address), None)
        if client is None:
            return False
        client.invalidate()
        return True

    def __contains__(self, address: object) -> bool:
        return isinstance(address, str) and base_url(address) in self._clients

    async def aclose(self) -> None:
        await self._http.aclose()
