"""A PD worker's coordinator exports the engine's queue to /metrics."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.sequence import Sequence
from pdcluster.runtime.engine.tokenizer import ByteTokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.pd.settings import RoomSettings
from pdcluster.runtime.pd_worker.coordinator import PrefillCoordinator
from pdcluster.runtime.serving.engine_service import EngineService


def _agent() -> Any:
    ctx = SimpleNamespace(room_settings=RoomSettings(), stats={})
    return SimpleNamespace(ctx=ctx, broadcast=lambda msg, here_now=False: None)


def test_queued_prefill_tokens_follow_the_engine_queue() -> None:
    engine = LLMEngine(EngineConfig(num_pages=20, page_size=16, chunk_size=16))
    metrics = WorkerMetrics("prefill")
    coordinator = PrefillCoordinator(_agent(), EngineService(engine, ByteTokenizer()), 1, metrics)
    engine.scheduler.add(Sequence(rid="r", prompt_token_ids=list(range(40)), max_tokens=1))
    coordinator.tick()
    assert metrics.registry.get_sample_value("pdcluster_queued_prefill_tokens") == 40
