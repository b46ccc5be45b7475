"""One client request through vLLM's disaggregated flow (`LegFlow.kv_params`).

The prefill leg goes first (one token, not streamed, `kv_transfer_params`
asking for a remote decode, vllm_legs.py); the decode leg follows with the
`kv_transfer_params` the prefill answered and is the client's answer. A
request depends on its prefill until the decode has read the KV, which the
router sees as the decode's first event (streamed) or its whole answer (not
streamed): until then the relay watches the prefill (`ctx.prefills`).

Rules:
- the prefill is lost while the request depends on it (a refused or broken
  prefill connection, or `ctx.prefills.lost`: a failed probe, its
  supervisor, discovery) → the request starts again at once on another
  healthy prefill of the decode's revision, each prefill tried at most once;
  the decode leg, if sent, is closed first (closing a leg is vLLM's abort:
  it frees the request's blocks). With no prefill left the client gets 502
  naming the lost worker and why. Nothing was streamed yet, so a retry
  changes nothing the client saw;
- once the first event went to the client, the prefill no longer matters:
  a later failure is the decode's, relayed as an SSE error event;
- a prefill or decode answering 4xx: the client gets it (its request is
  wrong for vLLM: too long, bad field); 5xx or a broken answer: 502 naming
  the role; the request deadline ends both legs (504);
- client disconnect, deadline or failure → every leg still open is closed
  (`abandon`), which aborts it in vLLM; `aclose` is idempotent.

The surface the app drives is Relay's (start, open, read_body, events,
abandon, aclose), so both flows share the front door and the stream
response.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, TypeVar

import aiohttp

from pdcluster.runtime.router.bodies import error_message_of, payload_error
from pdcluster.runtime.router.errors import RouterError, error_body
from pdcluster.runtime.router.leg_client import (
    LegFailure,
    classify,
    close_response,
    finish_response,
    leg_data,
    response_line_batches,
)
from pdcluster.runtime.router.leg_plan import LegPlan
from pdcluster.runtime.router.relay import JSON, LegError, RelayContext, RelayPhase
from pdcluster.runtime.router.request_record import RequestRecord
from pdcluster.runtime.router.sse import DONE_EVENT, SSEReader, format_event, format_json_event
from pdcluster.runtime.router.vllm_legs import (
    KVParamsError,
    build_decode_body,
    build_prefill_body,
    read_kv_params,
)
from pdcluster.runtime.router.workers import Worker

log = logging.getLogger(__name__)
T = TypeVar("T")

# Picks another prefill for a decode, none of those tried (LegPlanner.repick_prefill).
Repick = Callable[[Worker, Collection[Worker]], Worker | None]


class PrefillLost(Exception):
    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker = worker
        self.reason = reason


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


class VllmRelay:
    def __init__(
        self, ctx: RelayContext, plan: LegPlan, repick: Repick, record: RequestRecord | None = None
    ) -> None:
        assert plan.prefill is not None and plan.request is not None, "a kv_params plan"
        self.ctx = ctx
        self.plan = plan
        # Outcome, tokens and (tracing on) spans; each leg's traceparent makes vLLM's
        # own request span (--otlp-traces-endpoint) a child of the leg's.
        self.record = record or RequestRecord()
        self.record.started(plan.rid, plan.room)
        self.repick = repick
        self.prefill: Worker = plan.prefill
        self.tried: list[Worker] = [plan.prefill]
        self.planned_at = asyncio.get_running_loop().time()
        self.deadline = self.planned_at + ctx.config.request_timeout_s
        self.headers = {**JSON, "x-request-id": plan.rid}
        self._phase = RelayPhase.planned
        self._main_resp: aiohttp.ClientResponse | None = None
        self._batches: AsyncIterator[list[str]] | None = None
        self._reader = SSEReader()
        # What was read before the answer was committed: the whole body, or the
        # stream's first events (already framed for the client).
        self._body: bytes | None = None
        self._head: list[bytes] = []
        self._stream_done = False
        # Set by `_on_prefill_lost` while the current prefill is watched.
        self._lost: asyncio.Future[PrefillLost] | None = None

    @property
    def rid(self) -> str:
        return self.plan.rid

    @property
    def phase(self) -> RelayPhase:
        return self._phase

    @property
    def main_status(self) -> int:
        return 200 if self._main_resp is None else self._main_resp.status

    def _advance(self, phase: RelayPhase) -> None:
        self._phase = max(self._phase, phase)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.ctx.pool.acquire(self.plan.main)
        self._advance(RelayPhase.relaying)

    def abandon(self, reason: str) -> None:
        """Close every leg still open (client gone, deadline, failure)."""
        if self._phase >= RelayPhase.abandoned:
            return
        main_done = self._phase >= RelayPhase.main_done
        self._advance(RelayPhase.abandoned)
        self.record.set_outcome(reason)
        self._unwatch()
        if not main_done:
            self.ctx.send_abort(self.plan.main, self.rid, reason)
            if self._main_resp is not None:
                close_response(self._main_resp)
        log.info("request %s abandoned: %s", self.rid, reason)

    async def aclose(self) -> None:
        if self._phase is RelayPhase.closed:
            return
        started = self._phase is not RelayPhase.planned
        ended_cleanly = self._phase is RelayPhase.main_done
        if self._phase < RelayPhase.main_done:
            self.abandon("incomplete")
        self._advance(RelayPhase.closed)
        self._unwatch()
        resp = self._main_resp
        if resp is not None:
            if ended_cleanly and not resp.content.at_eof():
                self.ctx.spawn(finish_response(resp))
            else:
                close_response(resp)
        if started:
            self.ctx.pool.release(self.plan.main)
        self.record.finish(self.ctx.metrics)

    # ------------------------------------------------------------ prefill watch
    def _watch(self) -> None:
        self._lost = asyncio.get_running_loop().create_future()
        self.ctx.prefills.watch(self.prefill, self._on_prefill_lost)

    def _unwatch(self) -> None:
        self.ctx.prefills.unwatch(self.prefill, self._on_prefill_lost)
        self._lost = None

    def _on_prefill_lost(self, worker: Worker, reason: str) -> None:
        lost = self._lost
        if lost is not None and not lost.done() and worker is self.prefill:
            lost.set_result(PrefillLost(worker, reason))

    async def _guarded(self, aw: Awaitable[T]) -> T:
        """Await `aw` under the deadline; the prefill's loss interrupts it."""
        lost = self._lost
        work = asyncio.ensure_future(aw)
        try:
            async with asyncio.timeout_at(self.deadline):
                if lost is None:
                    return await work
                either: set[asyncio.Future[Any]] = {work, lost}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.done() and not work.cancelled():
            return work.result()
        assert lost is not None and lost.done()
        raise lost.result()

    # ------------------------------------------------------------ the legs
    async def _prefill_leg(self, worker: Worker) -> dict[str, Any]:
        """The prefill's `kv_transfer_params` (LegError or PrefillLost otherwise)."""
        request = self.plan.request
        assert request is not None
        body = json.dumps(build_prefill_body(request.body, request.endpoint)).encode()
        self.ctx.pool.acquire(worker)
        try:
            # Leaving the block before the body's end (cancelled) closes the
            # connection, which is vLLM's abort of the prefill leg.
            headers = {**self.headers, **self.record.leg_headers("prefill", worker.url)}
            async with self.ctx.legs.post(
                worker.url + self.plan.path, data=leg_data(body), headers=headers
            ) as resp:
                raw = await resp.read()
        except aiohttp.ClientError as err:
            self.record.end_leg("prefill", "prefill_unreachable")
            text = str(err) or type(err).__name__
            if classify(err) is LegFailure.unreachable:
                if self.ctx.pool.mark_unreachable(worker, text):
                    log.warning("worker %s (prefill) unreachable, left the pool", worker.url)
                self.ctx.prefills.lost(worker, f"unreachable: {text}")
                raise PrefillLost(worker, f"unreachable: {text}") from None
            if classify(err) is LegFailure.connection_lost:
                raise PrefillLost(worker, f"connection lost: {text}") from None
            raise LegError(worker, 502, f"bad response: {text}", "prefill_bad_response") from None
        finally:
            self.ctx.pool.release(worker)
        self.record.end_leg("prefill", "prefill_error_status" if resp.status >= 400 else None)
        if resp.status >= 400:
            raise LegError(
                worker,
                resp.status,
                error_message_of(raw, resp.status),
                "prefill_error_status",
                retry_after=resp.headers.get("retry-after"),
            )
        try:
            params = read_kv_params(_json(raw))
        except KVParamsError as err:
            raise LegError(worker, 502, str(err), "prefill_no_kv_params") from None
        self.ctx.metrics.time_to_first_token.observe(
            asyncio.get_running_loop().time() - self.planned_at
        )
        return params

    async def _decode_leg(self, params: dict[str, Any]) -> aiohttp.ClientResponse:
        request = self.plan.request
        assert request is not None
        body = json.dumps(build_decode_body(request.body, params)).encode()
        decode = self.plan.main
        headers = {**self.headers, **self.record.leg_headers("decode", decode.url)}
        resp = await self.ctx.legs.post(
            decode.url + self.plan.path, data=leg_data(body), headers=headers
        )
        self._main_resp = resp
        if resp.status >= 400:
            raw = await resp.read()
            message = error_message_of(raw, resp.status)
            raise LegError(decode, resp.status, message, "decode_error_status")
        if self.plan.stream:
            self._batches = response_line_batches(resp)
            await self._read_head()
        else:
            raw = await resp.read()
            if _json(raw) is None:
                raise LegError(decode, 502, "answered with a body that is not JSON", "bad_payload")
            self._body = raw
        return resp

    async def _read_head(self) -> None:
        """Read the stream up to its first event (the decode has the KV by then)."""
        assert self._batches is not None
        while not self._head:
            try:
                batch = await anext(self._batches)
            except StopAsyncIteration:
                raise LegError(
                    self.plan.main, 502, "stream ended before [DONE]", "stream_truncated"
                ) from None
            self._frame(batch)

    def _frame(self, batch: list[str]) -> None:
        for line in batch:
            event = self._reader.feed(line)
            if event is None or self._stream_done:
                continue
            if event.is_done:
                self._stream_done = True
                self._head.append(DONE_EVENT)
                continue
            if event.error() is not None:
                self.ctx.metrics.leg_failures.labels("decode", "error_event").inc()
            self._head.append(format_event(event.data))

    def _close_decode(self, reason: str) -> None:
        resp, self._main_resp, self._batches = self._main_resp, None, None
        self._reader, self._head, self._body = SSEReader(), [], None
        if resp is not None:
            self.ctx.send_abort(self.plan.main, self.rid, reason)
            close_response(resp)

    async def open(self) -> None:
        """Run the legs until the answer is committed: the whole body, or the
        stream's first event; a lost prefill restarts them on another one."""
        while True:
            self._watch()
            try:
                params = await self._guarded(self._prefill_leg(self.prefill))
                await self._guarded(self._decode_leg(params))
                self._unwatch()
                return
            except PrefillLost as lost:
                self._unwatch()
                self._close_decode("prefill_lost")
                self._retry_or_fail(lost)
            except LegError as err:
                self._unwatch()
                if err.worker is self.plan.main and err.status >= 500 and not self.prefill.healthy:
                    # The decode failed reading from a prefill the pool lost meanwhile.
                    self._close_decode("prefill_lost")
                    self._retry_or_fail(PrefillLost(self.prefill, self.prefill.last_error))
                    continue
                raise self._fail(err) from None
            except aiohttp.ClientError as err:
                self._unwatch()
                text = str(err) or type(err).__name__
                failure = LegError(self.plan.main, 502, text, "decode_connection")
                raise self._fail(failure) from None
            except TimeoutError:
                self._unwatch()
                self.abandon("timeout")
                raise RouterError(
                    504,
                    f"request did not finish within {self.ctx.config.request_timeout_s:g}s",
                    reason="timeout",
                ) from None

    def _retry_or_fail(self, lost: PrefillLost) -> None:
        self.record.end_leg("prefill", f"prefill_lost: {lost.reason}")
        metrics = self.ctx.metrics
        metrics.leg_failures.labels("prefill", "prefill_lost").inc()
        nxt = self.repick(self.plan.main, self.tried)
        if nxt is None:
            self.abandon("prefill_lost")
            raise RouterError(
                502,
                f"prefill worker {lost.worker.url} lost before the decode read the KV "
                f"({lost.reason}); no other prefill worker to retry on",
                reason="prefill_lost",
            )
        log.warning(
            "request %s: prefill %s lost (%s); retrying on %s",
            self.rid,
            lost.worker.url,
            lost.reason,
            nxt.url,
        )
        self.prefill = nxt
        self.tried.append(nxt)

    def _fail(self, err: LegError) -> RouterError:
        self.record.set_outcome(err.reason)
        self.ctx.metrics.leg_failures.labels(err.worker.role.value, err.reason).inc()
        role = err.worker.role.value
        log.warning(
            "request %s: %s leg on %s failed: %s", self.rid, role, err.worker.url, err.message
        )
        self.abandon(f"{err.worker.role.value}_failed")
        return err.to_router_error()

    async def read_body(self) -> bytes:
        """The decode's whole JSON answer (non-streaming requests)."""
        assert self._body is not None, "open() first"
        self._advance(RelayPhase.main_done)
        payload = _json(self._body)
        failed = payload_error(payload) is not None
        self.record.read_answer(payload, "error_payload" if failed else None)
        if failed:
            self.ctx.metrics.leg_failures.labels("decode", "error_payload").inc()
        return self._body

    async def events(self) -> AsyncIterator[bytes]:
        """The decode's SSE events, re-framed; a failure becomes an error event."""
        while True:
            head, self._head = self._head, []
            for chunk in head:
                if chunk is DONE_EVENT:
                    self._advance(RelayPhase.main_done)
                    self.record.set_outcome("stop")
                yield chunk
                if chunk is DONE_EVENT:
                    return
            if self._batches is None:
                return
            try:
                async with asyncio.timeout_at(self.deadline):
                    batch = await anext(self._batches)
            except StopAsyncIteration:
                failure = RouterError(502, "decode worker failed: stream ended before [DONE]")
            except (aiohttp.ClientError, TimeoutError) as err:
                text = "timed out" if isinstance(err, TimeoutError) else str(err) or "broken"
                failure = RouterError(502, f"decode worker failed: {text}")
            else:
                self._frame(batch)
                continue
            self.ctx.metrics.leg_failures.labels("decode", "stream_broken").inc()
            self.record.set_outcome("stream_broken")
            self.abandon("decode_failed")
            yield format_json_event(error_body(failure.message, failure.status))
            yield DONE_EVENT
            return
