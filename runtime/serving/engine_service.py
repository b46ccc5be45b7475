"""Runs an engine on its own thread and serves it to asyncio callers.

The engine is single-threaded by design: only the engine thread touches it.
Callers (HTTP handlers on the event loop) talk to it through a command queue;
results come back through per-request asyncio queues, fed with
`loop.call_soon_threadsafe` (one call per event loop for all the events of
one engine step, not one per event: each call is a wake-up of that loop).
Other layers (the PD roles) plug in with `add_tick`: a callable run on the
engine thread before every step, so they can poll transfers and admit
requests without locking the engine.

Invariants:
- every submitted request gets exactly one terminal event (finished or error),
  also when it is aborted or the service stops;
- an abort names an exact rid; unknown rids change nothing;
- one request's error never stops the engine thread: a command, tick hook or
  output hook that raises is logged and the loop goes on; a step that raises
  fails the requests of that step (`StepFailed`), through `fail_hooks` for
  the ones a PD coordinator drives;
- a hung engine is reported, not waited for: with `stall_s` set, once work
  is pending and no loop iteration finished for `stall_s` seconds
  (`engine/stall.py`), `stalled_for()` says so, new calls fail at once with
  `engine_stalled`, and the watchdog fails every tracked request and runs
  `stall_hooks` (a PD agent fails its rooms) once per stall.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdcluster.runtime.engine.stall import STALL_REASON, Progress, stalled_for

log = logging.getLogger("pdcluster.engine")

WATCHDOG_INTERVAL_S = 0.2


class EngineStalled(RuntimeError):
    """The engine thread made no progress for the stall bound; nothing was queued."""

    status = 503


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class TokenEvent:
    """One update for a request: new tokens and text, or the end of it."""

    token_ids: list[int]
    text: str  # text delta since the previous event
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefill_done" | error reason
    error: str | None = None  # set when the request failed; `status` says which HTTP code fits
    status: int = 200
    # One per token of `token_ids` when the request asked for logprobs (engine
    # `TokenLogprobs`, or None where unknown); empty otherwise.
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class _Tracked:
    rid: str
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[TokenEvent]
    stop_strings: list[str]
    prompt_len: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # text emitted so far (never includes a stop string)
    done: bool = False
    started_at: float = field(default_factory=time.monotonic)


class EngineService:
    """Owns the engine thread. `engine` follows the LLMEngine contract."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Tokenizer,
        *,
        idle_wait_s: float = 0.002,
        stall_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wakeup = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._ticks: list[Callable[[], None]] = []
        self._idle_wait_s = idle_wait_s
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_step_at = time.monotonic()
        self.num_steps = 0
        # PD coordinators claim the outputs and aborts of requests they drive.
        self.output_hooks: list[Callable[[Any], bool]] = []
        self.abort_hooks: list[Callable[[str], None]] = []
        # (rid, reason): a step failed these requests; engine thread.
        self.fail_hooks: list[Callable[[str, str], None]] = []
        # Watchdog thread, once per stall: the engine thread is hung.
        self.stall_hooks: list[Callable[[], None]] = []
        self.stall_s = stall_s
        self._working = False  # engine thread: inside an iteration with work
        self._stall_reported = False
        self._emit_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        # Engine thread, while it hands out one step's outputs: their events,
        # given to each event loop with one wake-up instead of one per event.
        self._held: list[tuple[_Tracked, TokenEvent]] | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        if self.stall_s is not None:
            self._watchdog = threading.Thread(
                target=self._watch, name="engine-watchdog", daemon=True
            )
            self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_for(self, now: float | None = None) -> float | None:
        """Seconds the engine has been stalled (work pending, no progress), None if not."""
        if self.stall_s is None:
            return None
        pending = self._working or not self._commands.empty()
        progress = Progress(self.last_step_at, pending)
        return stalled_for(progress, time.monotonic() if now is None else now, self.stall_s)

    @property
    def is_stalled(self) -> bool:
        return self.stalled_for() is not None

    def _watch(self) -> None:
        while not self._stopping.wait(WATCHDOG_INTERVAL_S):
            idle = self.stalled_for()
            if idle is None:
                self._stall_reported = False
                continue
            if self._stall_reported:
                continue
            self._stall_reported = True
            log.error(
                "engine stalled: work pending and no step finished for %.1fs; failing requests",
                idle,
            )
            # Hooks first: by the time a client reads the error, its room is failed too.
            for hook in self.stall_hooks:
                try:
                    hook()
                except Exception:
                    log.exception("engine stall hook failed")
            for rid in list(self._tracked):
                self.fail(rid, STALL_REASON, status=503)

    def add_tick(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread before every step (must not block)."""
        self._ticks.append(fn)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run `fn` on the engine thread; await its result from the event loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.is_stalled:
            fut.set_exception(EngineStalled(STALL_REASON))
            return fut

        def run() -> None:
            try:
                result = fn()
            except BaseException as err:  # noqa: BLE001 - handed back to the caller
                loop.call_soon_threadsafe(_set_exception, fut, err)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._post(run)
        return fut

    def post(self, fn: Callable[[], None]) -> None:
        """Fire-and-forget: run `fn` on the engine thread."""
        self._post(fn)

    def _post(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wakeup.set()

    def wake(self) -> None:
        """Run the engine loop's ticks now instead of after its idle wait (any thread)."""
        self._wakeup.set()

    # ---------------------------------------------------------------- requests
    def track(
        self, rid: str, prompt_len: int, stop_strings: list[str]
    ) -> asyncio.Queue[TokenEvent]:
        """Register a request's output queue (call from the event loop)."""
        if rid in self._tracked:
            raise ValueError(f"duplicate rid {rid!r}")
        out: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._tracked[rid] = _Tracked(
            rid, asyncio.get_running_loop(), out, stop_strings, prompt_len
        )
        return out

    def is_tracked(self, rid: str) -> bool:
        return rid in self._tracked

    def untrack(self, rid: str) -> None:
        """Forget a tracked request that never reached the engine (event loop)."""
        self._tracked.pop(rid, None)

    async def generate(self, request: Any, stop_strings: list[str]) -> AsyncIterator[TokenEvent]:
        """Add an EngineRequest and yield its events until the terminal one."""
        out = self.track(request.rid, len(request.prompt_token_ids), stop_strings)
        fut = self.call(lambda: self.engine.add_request(request))
        try:
            await fut
        except Exception:
            self.untrack(request.rid)
            raise
        async for event in self.events(request.rid, out):
            yield event

    async def events(self, rid: str, out: asyncio.Queue[TokenEvent]) -> AsyncIterator[TokenEvent]:
        try:
            while True:
                event = await out.get()
                yield event
                if event.finished:
                    return
        finally:
            tracked = self._tracked.pop(rid, None)
            if tracked is not None and not tracked.done:
                # The consumer went away (client disconnect): free the request.
                self._post(lambda: self._abort_now(rid))

    def abort(self, rid: str) -> None:
        """Abort by exact rid (thread-safe; unknown rid is a no-op)."""
        self._post(lambda: self._abort_now(rid))

    def abort_all(self) -> None:
        def abort_tracked() -> None:
            for rid in list(self._tracked):
                self._abort_now(rid)

        self._post(abort_tracked)

    def fail(self, rid: str, reason: str, status: int = 500) -> None:
        """Engine thread: end a tracked request with an error event."""
        self.emit(rid, TokenEvent([], "", True, reason, error=reason, status=status))

    def _abort_now(self, rid: str) -> None:
        for hook in self.abort_hooks:
            hook(rid)
        self.engine.abort(rid)
        self.emit(rid, TokenEvent([], "", True, "abort"))

    def emit(self, rid: str, event: TokenEvent) -> None:
        """Engine thread: hand an event to the request's asyncio queue."""
        # The watchdog thread emits too (a hung engine thread never will).
        with self._emit_lock:
            tracked = self._tracked.get(rid)
            if tracked is None or tracked.done:
                return
            if event.finished:
                tracked.done = True
            # Only the engine thread holds events back (other threads emit too).
            if self._held is not None and threading.current_thread() is self._thread:
                self._held.append((tracked, event))
                return
        tracked.loop.call_soon_threadsafe(tracked.out.put_nowait, event)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._working = True
                self._drain_commands()
                for tick in self._ticks:
                    self._guarded(tick, "tick hook")
                if self.engine.has_work():
                    outputs = self._step()
                    self.num_steps += 1
                    self.last_step_at = time.monotonic()
                    self._held = []
                    try:
                        for output in outputs:
                            self._guarded(
                                functools.partial(self._on_output, output), "output", output.rid
                            )
                    finally:
                        held, self._held = self._held, None
                        _hand_over(held)
                else:
                    self.last_step_at = time.monotonic()
                    self._working = False
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
        except Exception:
            log.exception("engine thread crashed")
            raise
        finally:
            for rid in list(self._tracked):
                self.emit(
                    rid, TokenEvent([], "", True, "shutdown", error="engine stopped", status=503)
                )

    def _step(self) -> list[Any]:
        from pdcluster.runtime.engine.engine import StepFailed

        try:
            outputs: list[Any] = self.engine.step()
            return outputs
        except StepFailed as err:
            # The engine already dropped the step's requests; end them here.
            log.error("engine step failed (%s); failing %d request(s)", err, len(err.rids))
            reason = f"engine_error: {err}"
            for rid in err.rids:
                for hook in self.fail_hooks:
                    try:
                        hook(rid, reason)
                    except Exception:
                        log.exception("engine loop: fail hook failed for rid %s", rid)
                self.fail(rid, reason, status=500)
            return []

    def _guarded(self, fn: Callable[[], Any], what: str, rid: str | None = None) -> None:
        """Run one per-request piece of the loop; its error ends that request, not the engine."""
        try:
            fn()
        except Exception as err:
            log.exception("engine loop: %s failed%s", what, f" for rid {rid}" if rid else "")
            if rid is not None:
                reason = f"engine_error: {type(err).__name__}: {err}"
                for hook in self.fail_hooks:
                    try:
                        hook(rid, reason)
                    except Exception:
                        log.exception("engine loop: fail hook failed for rid %s", rid)
                try:
                    self.engine.abort(rid)
                except Exception:
                    log.exception("engine loop: abort of rid %s failed", rid)
                self.fail(rid, reason, status=500)

    def deliver(self, output: Any) -> None:
        """Engine thread: hand one engine output (outside a step) to its request."""
        self._guarded(functools.partial(self._on_output, output), "output", output.rid)

    def _drain_commands(self) -> None:
        while True:
            try:
                fn = self._commands.get_nowait()
            except queue.Empty:
                return
            self._guarded(fn, "command")

    def _on_output(self, output: Any) -> None:
        if any(hook(output) for hook in self.output_hooks):
            return
        tracked = self._tracked.get(output.rid)
        if tracked is None or tracked.done:
            return
        new_ids = list(output.new_token_ids)
        finished, reason = bool(output.finished), output.finish_reason
        visible = [t for t in new_ids if not (finished and t == self.tokenizer.eos_token_id)]
        tracked.output_ids.extend(visible)
        full = self.tokenizer.decode(tracked.output_ids)
        hit = _find_stop(full, tracked.stop_strings, len(tracked.text))
        if hit is not None:
            full = full[:hit]
            if not finished:
                self.engine.abort(output.rid)
            finished, reason = True, "stop"
        # Hold back an incomplete UTF-8 tail (shown as U+FFFD) until it completes,
        # and a possible stop-string prefix until it is ruled out.
        emit_upto = len(full) if finished else _safe_prefix_len(full, tracked.stop_strings)
        delta = full[len(tracked.text) : emit_upto] if emit_upto > len(tracked.text) else ""
        tracked.text += delta
        logprobs = list(getattr(output, "new_logprobs", ()))
        self.emit(output.rid, TokenEvent(new_ids, delta, finished, reason, logprobs=logprobs))


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, start - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _safe_prefix_len(text: str, stops: list[str]) -> int:
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end


def _hand_over(held: list[tuple[_Tracked, TokenEvent]]) -> None:
    """One `call_soon_threadsafe` per event loop for a step's events, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]]
    by_loop = {}
    for tracked, event in held:
        by_loop.setdefault(tracked.loop, []).append((tracked.out, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # that loop is closed: nobody waits for these events
            log.debug("dropped %d events for a closed event loop", len(items))


def _put_all(items: list[tuple[asyncio.Queue[TokenEvent], TokenEvent]]) -> None:
    for out, event in items:
        out.put_nowait(event)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)
