"""One client request relayed to its worker legs, with cancel propagation.

In disaggregated mode the prefill leg and the decode ("main") leg run at
once, the decode leg's request written first (its path to the KV is the
longer one); the client sees the main leg. Rules (docs/design.md §7, §8):
- prefill leg fails (error status, error payload, connection error) →
  abort the main leg (exact rid) and answer the prefill error — unless the
  cluster's failure policy is `recompute`: there decode computes the prompt
  itself when its KV never comes, so the failure is logged and counted, the
  prefill worker gets its abort if it may still run, and the main leg alone
  decides the outcome (under the same deadline, so nothing waits longer);
- main leg fails → abort the prefill leg if it is still running;
- client disconnect or deadline → abort every unfinished leg.

Races handled here:
- every wait on the main leg also watches the prefill task (`_race`), so a
  prefill failure interrupts a main leg that would otherwise wait forever
  for KV that never comes (policy `fail`; under `recompute` it never waits
  forever: decode's own KV timeouts and heartbeats end the wait);
- aborts are spawned tasks on a separate HTTP client, sent before the legs'
  own connections are torn down, so a saturated leg pool or a slow close
  cannot delay them;
- `abandon` and `aclose` are idempotent, since a disconnect, a deadline and
  a leg failure can all arrive for the same request.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, TypeVar

import aiohttp
import httpx

from pdcluster.runtime import stage_trace
from pdcluster.runtime.router.bodies import error_message_of, payload_error
from pdcluster.runtime.router.config import RouterConfig
from pdcluster.runtime.router.errors import RouterError, error_body
from pdcluster.runtime.router.leg_client import (
    LegFailure,
    classify,
    close_response,
    finish_response,
    leg_data,
    response_line_batches,
    response_lines,
)
from pdcluster.runtime.router.leg_plan import LegPlan
from pdcluster.runtime.router.metrics import RouterMetrics
from pdcluster.runtime.router.prefill_watch import PrefillWatch
from pdcluster.runtime.router.request_record import JSON_CONTENT, USAGE_COMMENT, RequestRecord
from pdcluster.runtime.router.sse import DONE_EVENT, SSEReader, format_event, format_json_event
from pdcluster.runtime.router.workers import Worker, WorkerPool
from pdcluster.runtime.telemetry.request_log import request_fields

log = logging.getLogger(__name__)
T = TypeVar("T")
# Leg bodies go out as bytes (`LegPlan.content`); with tracing each leg adds its traceparent.
JSON = JSON_CONTENT


# repr=False: the exception's own repr (its message), as in tracebacks.
@dataclass(eq=False, repr=False)
class LegError(Exception):
    worker: Worker
    status: int
    message: str
    reason: str
    _: KW_ONLY
    # The worker may still be working on the request (so it needs an abort).
    may_run: bool = False
    # A worker's 503 with Retry-After (a full prefill queue): backpressure
    # the client sees as such, not as a broken worker.
    retry_after: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def to_router_error(self) -> RouterError:
        role = self.worker.role.value
        if 400 <= self.status < 500:
            return RouterError(self.status, self.message, reason=self.reason)
        if self.status == 503 and self.retry_after is not None:
            return RouterError(
                503,
                f"{role} worker busy: {self.message}",
                code="busy",
                reason=f"{role}_busy",
                retry_after=self.retry_after,
            )
        status = 504 if self.status == 504 else 502
        return RouterError(status, f"{role} worker failed: {self.message}", reason=self.reason)


def _http_error(worker: Worker, err: aiohttp.ClientError, pool: WorkerPool) -> LegError:
    role = worker.role.value
    text = str(err) or type(err).__name__
    failure = classify(err)
    if failure is LegFailure.unreachable:
        if pool.mark_unreachable(worker, text):
            log.warning("worker %s (%s) unreachable, left the pool", worker.url, role)
        return LegError(worker, 502, "worker unreachable", f"{role}_unreachable")
    if failure is LegFailure.connection_lost:
        reason, message = f"{role}_connection_lost", f"connection lost: {text}"
    else:
        reason, message = f"{role}_bad_response", f"bad response: {text}"
    return LegError(worker, 502, message, reason, may_run=True)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _next_batch(batches: AsyncIterator[list[str]]) -> list[str] | None:
    try:
        return await anext(batches)
    except StopAsyncIteration:
        return None


@dataclass
class RelayContext:
    config: RouterConfig
    pool: WorkerPool
    # Both legs of every request (`leg_client`).
    legs: aiohttp.ClientSession
    # Aborts ride on their own client so that a full leg pool cannot delay them.
    control: httpx.AsyncClient
    metrics: RouterMetrics
    rooms_in_use: set[int] = field(default_factory=set)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # Requests that depend on a prefill until their decode read its KV (vLLM).
    prefills: PrefillWatch = field(default_factory=PrefillWatch)

    def spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(_retrieve)
        return task

    def send_abort(self, worker: Worker, rid: str, reason: str) -> None:
        self.metrics.aborts.labels(worker.role.value, reason).inc()
        if not self.config.aborts_by_rid:
            # vLLM has no /abort_request: closing the leg's connection aborts it.
            return
        self.spawn(self._abort(worker, rid, reason))

    async def _abort(self, worker: Worker, rid: str, reason: str) -> None:
        try:
            resp = await self.control.post(
                f"{worker.url}/abort_request",
                json={"rid": rid, "abort_all": False},
                timeout=self.config.abort_timeout_s,
            )
        except httpx.HTTPError as err:
            log.warning("abort %s on %s (%s) failed: %s", rid, worker.url, reason, err)
            return
        if resp.status_code >= 400:
            log.warning("abort %s on %s answered HTTP %d", rid, worker.url, resp.status_code)


class RelayPhase(enum.IntEnum):
    """Where one relay stands. It only moves forward, and each phase keeps the
    facts of those before it: an abandoned relay's main leg is done too."""

    planned = 0  # legs chosen, nothing sent
    relaying = 1  # `start` ran: the main worker is acquired, the prefill leg spawned
    main_done = 2  # the main leg answered, failed, or was told to abort
    abandoned = 3  # every leg still running was told to abort
    closed = 4  # `aclose` ran (always last): response closed, worker and room released


class Relay:
    def __init__(
        self, ctx: RelayContext, plan: LegPlan, record: RequestRecord | None = None
    ) -> None:
        self.ctx = ctx
        self.plan = plan
        # Outcome, tokens and (tracing on) spans, counted when the relay closes.
        self.record = record or RequestRecord()
        self.record.started(plan.rid, plan.room)
        self.planned_at = asyncio.get_running_loop().time()
        self.deadline = self.planned_at + ctx.config.request_timeout_s
        self._prefill_task: asyncio.Task[None] | None = None
        self._main_resp: aiohttp.ClientResponse | None = None
        # Set when the main leg starts sending: the prefill leg goes out after it.
        self._main_sending = asyncio.Event()
        self._phase = RelayPhase.planned

    @property
    def rid(self) -> str:
        return self.plan.rid

    @property
    def phase(self) -> RelayPhase:
        return self._phase

    def _advance(self, phase: RelayPhase) -> None:
        self._phase = max(self._phase, phase)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        plan = self.plan
        if plan.room is not None:
            self.ctx.rooms_in_use.add(plan.room)
        if plan.prefill is not None:
            self.ctx.pool.acquire(plan.prefill)
            self._prefill_task = self.ctx.spawn(self._prefill_leg(plan.prefill))
            self._prefill_task.add_done_callback(self._prefill_finished)
        self.ctx.pool.acquire(plan.main)
        self._advance(RelayPhase.relaying)

    def abandon(self, reason: str) -> None:
        """Abort every unfinished leg (client gone, deadline, failure)."""
        if self._phase >= RelayPhase.abandoned:
            return
        main_done = self._phase >= RelayPhase.main_done
        self._advance(RelayPhase.abandoned)
        plan = self.plan
        task = self._prefill_task
        if plan.prefill is not None and task is not None and not task.done():
            self.ctx.send_abort(plan.prefill, plan.rid, reason)
            task.cancel()
        if not main_done:
            self.ctx.send_abort(plan.main, plan.rid, reason)
        self.record.set_outcome(reason)
        log.info(
            "request %s room %s abandoned: %s",
            plan.rid,
            plan.room,
            reason,
            extra=request_fields(plan.room, plan.rid),
        )

    async def aclose(self) -> None:
        if self._phase is RelayPhase.closed:
            return
        started = self._phase is not RelayPhase.planned
        ended_cleanly = self._phase is RelayPhase.main_done
        if self._phase < RelayPhase.main_done:
            self.abandon("incomplete")
        self._advance(RelayPhase.closed)
        resp = self._main_resp
        if resp is not None:
            if ended_cleanly and not resp.content.at_eof():
                # Relayed to its [DONE]; the body's terminator may still be on its way.
                self.ctx.spawn(finish_response(resp))
            else:
                close_response(resp)
        if started:
            self.ctx.pool.release(self.plan.main)
        self.record.finish(self.ctx.metrics)
        room = self.plan.room
        task = self._prefill_task
        if room is not None:
            # The room stays reserved while a prefill leg may still use it.
            if task is None or task.done():
                self.ctx.rooms_in_use.discard(room)
            else:
                task.add_done_callback(lambda _: self.ctx.rooms_in_use.discard(room))

    # ---------------------------------------------------------- prefill leg
    async def _prefill_leg(self, worker: Worker) -> None:
        try:
            async with asyncio.timeout_at(self.deadline):
                # Decode's leg first: its path to prefill (reserve pages, send the
                # metadata) is the longer one, and prefill can start only once both
                # have arrived. One event loop writes both requests, one after the
                # other; on a pooled connection the decode leg's request is written
                # before this one's (a new connection: both connect at once).
                await self._main_sending.wait()
                stage_trace.mark(self.plan.room, "router.prefill_send")
                plan = self.plan
                headers = self.record.leg_headers("prefill", worker.url)
                async with self.ctx.legs.post(
                    worker.url + plan.path, data=leg_data(plan.prefill_content), headers=headers
                ) as resp:
                    if resp.status >= 400:
                        raw = await resp.read()
                        message = error_message_of(raw, resp.status)
                        raise LegError(
                            worker,
                            resp.status,
                            message,
                            "prefill_error_status",
                            retry_after=resp.headers.get("retry-after"),
                        )
                    if self.plan.stream:
                        reader = SSEReader()
                        async for line in response_lines(resp):
                            event = reader.feed(line)
                            failure = event.error() if event is not None else None
                            if failure is not None:
                                raise LegError(worker, 502, failure, "prefill_error_event")
                    else:
                        raw = await resp.read()
                        failure = payload_error(_json_or_none(raw))
                        if failure is not None:
                            raise LegError(worker, 502, failure, "prefill_error_payload")
        except aiohttp.ClientError as err:
            raise _http_error(worker, err, self.ctx.pool) from None
        except TimeoutError:
            raise LegError(worker, 504, "timed out", "prefill_timeout", may_run=True) from None
        except (LegError, asyncio.CancelledError):
            raise
        except Exception as err:
            # Whatever broke, the decode leg must hear of it, or it waits for
            # KV until the deadline.
            raise LegError(
                worker, 502, f"unexpected error: {err!r}", "prefill_internal", may_run=True
            ) from err
        finally:
            self.ctx.pool.release(worker)
        took = asyncio.get_running_loop().time() - self.planned_at
        self.ctx.metrics.time_to_first_token.observe(took)
        stage_trace.mark(self.plan.room, "router.prefill_done")

    def _prefill_finished(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            self.record.end_leg("prefill", "cancelled")
            return
        err = task.exception()
        self.record.end_leg("prefill", err.reason if isinstance(err, LegError) else None)
        if isinstance(err, LegError):
            self.ctx.metrics.leg_failures.labels("prefill", err.reason).inc()
            log.warning(
                "request %s room %s: prefill leg on %s failed: %s%s",
                self.plan.rid,
                self.plan.room,
                err.worker.url,
                err.message,
                "" if self.ctx.config.is_prefill_failure_final else "; decode recomputes",
                extra=request_fields(self.plan.room, self.plan.rid),
            )
            if err.may_run:
                self.ctx.send_abort(err.worker, self.plan.rid, err.reason)

    def _is_prefill_ok(self) -> bool:
        task = self._prefill_task
        return (
            task is not None and task.done() and not task.cancelled() and task.exception() is None
        )

    def _prefill_failure(self) -> LegError | None:
        task = self._prefill_task
        if task is None or not task.done() or task.cancelled():
            return None
        err = task.exception()
        return err if isinstance(err, LegError) else None

    async def _race(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` under the deadline; a prefill failure interrupts it (policy `fail`)."""
        async with asyncio.timeout_at(self.deadline):
            task = self._prefill_task
            watch = self.ctx.config.is_prefill_failure_final
            if (
                task is None
                or not watch
                or self._is_prefill_ok()
                or self._phase >= RelayPhase.abandoned
            ):
                return await aw
            failure = self._prefill_failure()
            if failure is not None:
                if isinstance(aw, Coroutine):
                    aw.close()
                raise failure
            inner = asyncio.ensure_future(aw)
            inner.add_done_callback(_retrieve)
            try:
                while not inner.done():
                    if task.done():
                        failure = self._prefill_failure()
                        if failure is not None:
                            raise failure
                        return await inner
                    await asyncio.wait({inner, task}, return_when=asyncio.FIRST_COMPLETED)
                return inner.result()
            finally:
                if not inner.done():
                    inner.cancel()

    # ------------------------------------------------------------- main leg
    def _on_leg_error(self, err: LegError) -> RouterError:
        """Propagate one leg's failure to the other; return what the client gets."""
        plan = self.plan
        self.record.set_outcome(err.reason)
        if err.worker is plan.main:
            self.ctx.metrics.leg_failures.labels(plan.main.role.value, err.reason).inc()
            log.warning(
                "request %s room %s: %s leg on %s failed: %s",
                plan.rid,
                plan.room,
                plan.main.role.value,
                plan.main.url,
                err.message,
                extra=request_fields(plan.room, plan.rid),
            )
            if self._phase < RelayPhase.main_done:
                self._advance(RelayPhase.main_done)
                if err.may_run:
                    self.ctx.send_abort(plan.main, plan.rid, err.reason)
            self.abandon(f"{plan.main.role.value}_failed")
        else:
            self.abandon("prefill_failed")
        return err.to_router_error()

    def _on_timeout(self) -> RouterError:
        self.abandon("timeout")
        return RouterError(
            504,
            f"request did not finish within {self.ctx.config.request_timeout_s:g}s",
            reason="timeout",
        )

    @contextlib.contextmanager
    def _main_leg_failures(self) -> Iterator[None]:
        """Turn a failure while waiting on the main leg (its own, the prefill's, or
        the deadline) into the RouterError the client gets, aborting the other leg."""
        try:
            yield
        except aiohttp.ClientError as err:
            raise self._on_leg_error(_http_error(self.plan.main, err, self.ctx.pool)) from None
        except LegError as err:
            raise self._on_leg_error(err) from None
        except TimeoutError:
            raise self._on_timeout() from None

    async def _send_main(self) -> aiohttp.ClientResponse:
        # The prefill leg wakes only when this coroutine next waits, which is
        # after this request was written (aiohttp writes it before it waits).
        self._main_sending.set()
        stage_trace.mark(self.plan.room, "router.main_send")
        plan = self.plan
        headers = self.record.leg_headers(plan.main.role.value, plan.main.url)
        self._main_resp = await self.ctx.legs.post(
            plan.main.url + plan.path, data=leg_data(plan.content), headers=headers
        )
        stage_trace.mark(self.plan.room, "router.main_headers")
        return self._main_resp

    async def open(self) -> None:
        """Send the main leg; return once its response status is a success."""
        main = self.plan.main
        with self._main_leg_failures():
            resp = await self._race(self._send_main())
            if resp.status >= 400:
                raw = await self._race(resp.read())
                message = error_message_of(raw, resp.status)
                raise LegError(main, resp.status, message, f"{main.role}_error_status")

    async def read_body(self) -> bytes:
        """The main leg's whole JSON answer, as sent (non-streaming requests)."""
        resp = self._main_resp
        assert resp is not None, "open() first"
        main = self.plan.main
        with self._main_leg_failures():
            raw = await self._race(resp.read())
            payload = _json_or_none(raw)
            if payload is None:
                raise LegError(main, 502, "answered with a body that is not JSON", "bad_payload")
        self._advance(RelayPhase.main_done)
        failed = payload_error(payload) is not None
        self.record.read_answer(payload, "error_payload" if failed else None)
        if failed:
            self.ctx.metrics.leg_failures.labels(main.role.value, "error_payload").inc()
            self.abandon(f"{main.role.value}_failed")
        return raw

    @property
    def main_status(self) -> int:
        return 200 if self._main_resp is None else self._main_resp.status

    async def events(self) -> AsyncIterator[bytes]:
        """The main leg's SSE events, re-framed; failures become error events."""
        resp = self._main_resp
        assert resp is not None, "open() first"
        main = self.plan.main
        reader = SSEReader()
        batches = response_line_batches(resp)
        while True:
            try:
                with self._main_leg_failures():
                    batch = await self._race(_next_batch(batches))
                    if batch is None:
                        raise LegError(main, 502, "stream ended before [DONE]", "stream_truncated")
            except RouterError as failure:
                self.record.set_outcome(failure.reason or "error")
                yield format_json_event(error_body(failure.message, failure.status))
                yield DONE_EVENT
                return
            for line in batch:
                event = reader.feed(line)
                if event is None:
                    if line.startswith(USAGE_COMMENT):
                        self.record.read_usage_comment(line)
                    continue
                if event.is_done:
                    self._advance(RelayPhase.main_done)
                    self.record.set_outcome("stop")
                    yield DONE_EVENT
                    return
                if event.error() is not None and self._phase < RelayPhase.abandoned:
                    self.record.set_outcome("error_event")
                    self.ctx.metrics.leg_failures.labels(main.role.value, "error_event").inc()
                    # The worker ended this request itself; only the prefill leg needs the abort.
                    self._advance(RelayPhase.main_done)
                    self.abandon(f"{main.role.value}_failed")
                yield format_event(event.data)


def _json_or_none(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
