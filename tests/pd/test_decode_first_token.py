"""Decode hands the client prefill's first token at hand-off, before any decode step."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import MagicMock

from pdcluster.runtime.cli import load_manifest
from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sampling import SamplingParams
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.coordinator import DecodeCoordinator, Leg
from pdcluster.runtime.pd_worker.group import GroupReport
from pdcluster.runtime.serving.engine_service import EngineService, TokenEvent
from pdcluster.runtime.spec import KVLayout, PDClusterSpec
from tests.engine.testing import generate

CONFIG = EngineConfig(
    num_pages=20, page_size=16, kv_layout=KVLayout.NHD, chunk_size=16, max_running_requests=4,
    max_batch_tokens=64,
)  # fmt: skip
ROOM = 4242
ROOT = Path(__file__).resolve().parents[2]
FIRST = 65


def _spec() -> PDClusterSpec:
    """The 1P1D example's spec with this test's page size and decode slots."""
    spec = load_manifest(str(ROOT / "examples" / "pd-1p1d.yaml")).spec
    decode = spec.decode.model_copy(
        update={"engine": spec.decode.engine.model_copy(update={"max_running_requests": 4})}
    )
    kv = spec.kv_cache.model_copy(update={"page_size": CONFIG.page_size})
    return spec.model_copy(update={"decode": decode, "kv_cache": kv})


def _agent() -> Any:
    ctx = SimpleNamespace(
        room_settings=RoomSettings(),
        stats={},
        compat=SimpleNamespace(kv_dtype="float32", transfer_backend="tcp"),
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
    )
    return SimpleNamespace(ctx=ctx, broadcast=lambda msg, here_now=False: None)


async def _hand_off(engine: LLMEngine) -> tuple[EngineService, list[TokenEvent]]:
    """Open a room, reserve its pages, report its KV complete; return the events so far."""
    service = EngineService(engine, ByteTokenizer())
    coordinator = DecodeCoordinator(_agent(), service, 1, MagicMock(), _spec())
    out = service.track("rid-1", 5, [])
    prompt = list(b"hello")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    coordinator.open(Leg(ROOM, "rid-1", prompt, params), "127.0.0.1:1", None)
    coordinator.tick()  # admission reserves the pages
    coordinator._queue_report(GroupReport(ROOM, 0, "complete", None, FIRST))
    coordinator.tick()  # hand-off to the engine
    await asyncio.sleep(0)  # events travel through call_soon_threadsafe
    events = []
    while not out.empty():
        events.append(out.get_nowait())
    return service, events


def test_the_first_token_reaches_the_client_before_the_first_decode_step() -> None:
    engine = LLMEngine(dataclasses.replace(CONFIG))
    steps: list[int] = []
    real_step = engine.step
    engine.step = lambda: (steps.append(1), real_step())[1]  # type: ignore[method-assign]

    async def go() -> list[TokenEvent]:
        _, events = await _hand_off(engine)
        return events

    events = asyncio.run(go())
    assert steps == []
    assert [(e.token_ids, e.text, e.finished) for e in events] == [([FIRST], "A", False)]
    # The engine's steps then report only what they sampled themselves.
    rest, reason = generate(engine, [])["rid-1"]
    assert reason == "length" and len(rest) == 3


def test_without_the_early_report_the_first_token_waits_for_a_step() -> None:
    """Guards the test above: the hand-off alone reports nothing."""
    engine = LLMEngine(dataclasses.replace(CONFIG))
    engine.report_first_token = lambda rid: []  # type: ignore[method-assign]

    async def go() -> list[TokenEvent]:
        _, events = await _hand_off(engine)
        return events

    assert asyncio.run(go()) == []
    tokens, _ = generate(engine, [])["rid-1"]
    assert tokens[0] == FIRST and len(tokens) == 4
