"""The engine loop outlives any one request's error, and reports a hung engine.

A real tiny engine behind `EngineService`; failures are injected in every
per-request hook the loop calls (a command, a tick hook, an output hook, the
step itself through the prefill chunk hook), and after each the next request
is served. A step that blocks shows the stall detector at work: the pending
request fails with `engine_stalled` at the bound, new calls fail at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pdcluster.runtime.engine.engine import EngineRequest, LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.stall import Progress, is_stalled, stalled_for
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.serving.engine_service import EngineService, EngineStalled, TokenEvent

TOK = ByteTokenizer()
CFG = EngineConfig(num_pages=64, page_size=4, max_running_requests=8, max_batch_tokens=64)


def _req(rid: str) -> EngineRequest:
    return EngineRequest(rid, TOK.encode("hello"), SamplingParams(max_tokens=3, ignore_eos=True))


async def _run(service: EngineService, rid: str) -> list[TokenEvent]:
    return [e async for e in service.generate(_req(rid), [])]


def _last(events: list[TokenEvent]) -> TokenEvent:
    return events[-1]


@pytest.fixture
def service() -> Iterator[EngineService]:
    svc = EngineService(LLMEngine(CFG), TOK, stall_s=0.5)
    svc.start()
    yield svc
    svc.stop()


# ------------------------------------------------------------------ stall (pure)


def test_idle_is_never_a_stall_however_old_the_last_step() -> None:
    assert not is_stalled(Progress(last_progress_at=0.0, has_pending_work=False), 1e6, 5)


def test_pending_work_without_progress_past_the_bound_is_a_stall() -> None:
    busy = Progress(last_progress_at=100.0, has_pending_work=True)
    assert stalled_for(busy, 104.9, 5) is None
    assert stalled_for(busy, 105.5, 5) == pytest.approx(5.5)


def test_a_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall bound"):
        stalled_for(Progress(0.0, True), 1.0, 0)


# --------------------------------------------------------- tracking


async def test_an_untracked_rid_that_never_reached_the_engine_is_free_again(
    service: EngineService,
) -> None:
    service.track("twice", 5, [])
    with pytest.raises(ValueError, match="duplicate rid 'twice'"):
        service.track("twice", 5, [])
    service.untrack("twice")
    assert not service.is_tracked("twice")
    assert _last(await _run(service, "twice")).finish_reason == "length"
    assert not service.is_tracked("twice")


# --------------------------------------------------------- the loop survives


async def test_a_command_that_raises_does_not_stop_the_engine(service: EngineService) -> None:
    def boom() -> None:
        raise RuntimeError("bad command")

    service.post(boom)
    assert _last(await _run(service, "after-command")).finish_reason == "length"
    assert service.is_alive


async def test_a_tick_hook_that_raises_does_not_stop_the_engine(service: EngineService) -> None:
    calls = {"n": 0}

    def flaky_tick() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("bad tick")

    service.add_tick(flaky_tick)
    assert _last(await _run(service, "after-tick")).finish_reason == "length"
    assert calls["n"] > 1 and service.is_alive


async def test_an_output_hook_that_raises_fails_that_request_only(service: EngineService) -> None:
    failed: list[tuple[str, str]] = []
    service.fail_hooks.append(lambda rid, reason: failed.append((rid, reason)))

    def hook(output: Any) -> bool:
        if output.rid == "victim":
            raise ValueError("bad output")
        return False

    service.output_hooks.append(hook)
    victim = _last(await _run(service, "victim"))
    assert victim.error is not None and "engine_error: ValueError: bad output" in victim.error
    assert failed and failed[0][0] == "victim"
    assert _last(await _run(service, "survivor")).finish_reason == "length"
    # The failed request's pages came back.
    engine = service.engine
    assert engine.num_free_pages == engine.num_total_pages


async def test_a_step_that_raises_fails_its_requests_and_the_next_one_runs(
    service: EngineService,
) -> None:
    failed: list[str] = []
    service.fail_hooks.append(lambda rid, reason: failed.append(rid))
    broken = {"on": True}

    def chunk_hook(rid: str, pages: Any, start: int, end: int) -> None:
        if broken["on"]:
            broken["on"] = False
            raise OSError("destination cannot be written")

    service.engine.on_prefill_chunk = chunk_hook
    victim = _last(await _run(service, "victim"))
    assert victim.error is not None and "destination cannot be written" in victim.error
    assert failed == ["victim"]
    assert _last(await _run(service, "next")).finish_reason == "length"
    assert service.engine.num_free_pages == service.engine.num_total_pages


# ------------------------------------------------------------------ a hung step


async def test_a_hung_step_fails_the_request_with_engine_stalled_and_refuses_new_calls(
    service: EngineService,
) -> None:
    release = threading.Event()
    stalls: list[bool] = []
    service.stall_hooks.append(lambda: stalls.append(True))

    def hang(rid: str, pages: Any, start: int, end: int) -> None:
        release.wait(20)

    service.engine.on_prefill_chunk = hang
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    events = await asyncio.wait_for(_run(service, "stuck"), 10)
    assert _last(events).finish_reason == "engine_stalled" and _last(events).status == 503
    assert loop.time() - t0 < 5  # the bound is 0.5 s
    assert service.is_stalled and stalls == [True]
    with pytest.raises(EngineStalled):
        await service.call(lambda: None)
    # The step returns: progress resumes, the stall ends, requests run again.
    service.engine.on_prefill_chunk = None
    release.set()
    for _ in range(200):
        if not service.is_stalled:
            break
        await asyncio.sleep(0.02)
    assert not service.is_stalled
    assert _last(await _run(service, "after")).finish_reason == "length"
