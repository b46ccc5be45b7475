"""The servers' event loop is a setting (`PDCLUSTER_EVENT_LOOP`), uvloop unless
asked for the standard loop, never chosen by what happens to be installed."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from pdcluster.runtime.http.event_loop import (
    EVENT_LOOP_ENV,
    EventLoop,
    event_loop_from_env,
    parse_event_loop,
    run,
)
from pdcluster.runtime.http.limits import server_config
from pdcluster.runtime.router.cli import parse_invocation
from pdcluster.runtime.router.server import _uvicorn_config

WORKERS = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]


@pytest.mark.parametrize(
    ("value", "loop"),
    [(None, EventLoop.uvloop), ("", EventLoop.uvloop), ("asyncio", EventLoop.asyncio)],
)
def test_the_setting_defaults_to_uvloop(value: str | None, loop: EventLoop) -> None:
    assert parse_event_loop(value) is loop
    env = {} if value is None else {EVENT_LOOP_ENV: value}
    assert event_loop_from_env(env) is loop


def test_an_unknown_loop_is_refused_naming_the_variable_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"PDCLUSTER_EVENT_LOOP='tokio': expected one of"):
        parse_event_loop("tokio")
    with pytest.raises(ValueError, match="PDCLUSTER_EVENT_LOOP"):
        parse_invocation(WORKERS, env={EVENT_LOOP_ENV: "tokio"})


@pytest.mark.parametrize("loop", list(EventLoop))
def test_run_uses_the_chosen_loop(loop: EventLoop) -> None:
    async def kind() -> bool:
        return isinstance(asyncio.get_running_loop(), uvloop.Loop)

    assert run(kind(), loop) is (loop is EventLoop.uvloop)


def test_the_router_and_the_workers_ask_uvicorn_for_that_loop_not_auto() -> None:
    assert server_config(object(), "127.0.0.1", 1).loop == "uvloop"
    assert parse_invocation(WORKERS, env={}).event_loop is EventLoop.uvloop
    inv = parse_invocation(WORKERS, env={EVENT_LOOP_ENV: "asyncio"})
    assert inv.event_loop is EventLoop.asyncio
    assert _uvicorn_config(inv.config, "127.0.0.1", 1, "warning", inv.event_loop).loop == "asyncio"
