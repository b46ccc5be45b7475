"""A colocated worker app over a real tiny engine, served in-process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import WorkerInfo, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService

MAX_PROMPT = 200


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[TestClient, EngineService]]:
    cfg = EngineConfig(num_pages=64, page_size=8, max_prompt_tokens=MAX_PROMPT, max_new_tokens=64)
    engine = LLMEngine(cfg)
    tok = load_tokenizer("tiny", engine.model_config.eos_token_id)
    service = EngineService(engine, tok)
    info = WorkerInfo("tiny", "tiny", MAX_PROMPT, 64, engine.model_config.vocab_size)
    app = create_worker_app(
        ColocatedBackend(service), tok, info, WorkerMetrics("null"), max_body_bytes=64 * 1024
    )
    service.start()
    with TestClient(app) as client:
        yield client, service
    service.stop()
