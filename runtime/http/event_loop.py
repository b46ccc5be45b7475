"""Which event loop the runtime's servers (worker, router) run on.

`PDCLUSTER_EVENT_LOOP` [uvloop]: `uvloop` (libuv; a dependency) or
`asyncio` (the standard library's loop). Read once by each process's entry
point (`event_loop_from_env`) and passed down; nothing else reads the
variable. uvloop is the default because it measured cheaper where the
router spends its CPU, per streamed event and per leg (docs/benchmarks.md,
fifth round); the worker and router processes of the whole suite run on
it. A value that names no loop, or `uvloop` where the package cannot be
imported, stops the process at start with a message naming the variable.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

EVENT_LOOP_ENV = "PDCLUSTER_EVENT_LOOP"

T = TypeVar("T")


class EventLoop(enum.StrEnum):
    asyncio = "asyncio"
    uvloop = "uvloop"


DEFAULT_EVENT_LOOP = EventLoop.uvloop


def parse_event_loop(value: str | None) -> EventLoop:
    if value is None or not value.strip():
        return DEFAULT_EVENT_LOOP
    try:
        return EventLoop(value.strip().lower())
    except ValueError:
        names = ", ".join(e.value for e in EventLoop)
        raise ValueError(f"{EVENT_LOOP_ENV}={value!r}: expected one of {names}") from None


def event_loop_from_env(environ: Mapping[str, str]) -> EventLoop:
    loop = parse_event_loop(environ.get(EVENT_LOOP_ENV))
    loop_factory(loop)  # fail at start, not at the first request
    return loop


def loop_factory(loop: EventLoop) -> Callable[[], asyncio.AbstractEventLoop]:
    if loop is EventLoop.uvloop:
        try:
            import uvloop
        except ImportError as err:
            raise ValueError(f"{EVENT_LOOP_ENV}=uvloop: {err}") from None
        return uvloop.new_event_loop
    return asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], loop: EventLoop) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)
