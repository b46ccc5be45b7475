"""A worker asked to stop announces it before it drains (`worker_main._serve_all`).

On Kubernetes the kubelet signals a pod while routers are still learning of
its deletion: for `drain.announceSeconds` the worker keeps serving with
/health Not Ready, and only then stops accepting. A real worker app (tiny
engine) on a real uvicorn server, stopped by a real SIGTERM.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from pdcluster.runtime.engine.engine import LLMEngine
from pdcluster.runtime.engine.engine_config import EngineConfig
from pdcluster.runtime.engine.tokenizer import load_tokenizer
from pdcluster.runtime.http.limits import server_config
from pdcluster.runtime.metrics import WorkerMetrics
from pdcluster.runtime.ports import free_port
from pdcluster.runtime.server.colocated import ColocatedBackend
from pdcluster.runtime.server.worker_app import WorkerInfo, WorkerState, create_worker_app
from pdcluster.runtime.serving.engine_service import EngineService
from pdcluster.runtime.worker_main import _serve_all
from tests.engine.testing import write_random_hf_dir

BODY = {"prompt": "hi", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, EngineService]]:
    directory = write_random_hf_dir(tmp_path_factory.mktemp("model"), "llama")
    engine = LLMEngine(EngineConfig(model=str(directory), num_pages=32, page_size=8))
    tok = load_tokenizer(Path(directory), engine.model_config.eos_token_id)
    service = EngineService(engine, tok)
    info = WorkerInfo("m", str(directory), 200, 16, engine.model_config.vocab_size)
    service.start()
    try:
        yield (tok, info, engine), service
    finally:
        service.stop()


def serve_and_stop(
    worker: tuple[Any, EngineService], announce_s: float, signals: int
) -> tuple[list[tuple[str, int, str]], float]:
    """Serve a fresh app, SIGTERM it `signals` times, and probe it until it ends:
    [(what, status, reason)] seen after the first signal, and seconds to the end."""
    (tok, info, _), service = worker
    app = create_worker_app(ColocatedBackend(service), tok, info, WorkerMetrics("null"))
    state: WorkerState = app.state.worker
    port = free_port("127.0.0.1")
    server = uvicorn.Server(server_config(app, "127.0.0.1", port))
    seen: list[tuple[str, int, str]] = []

    async def main() -> float:
        serving = asyncio.ensure_future(_serve_all([server], announce_s, state.announce_stop))
        while not server.started:
            await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.post("/v1/completions", json=BODY)).status_code == 200
            start = time.monotonic()
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.sleep(0.05)
            while not serving.done():
                try:
                    health = await http.get("/health")
                    work = await http.post("/v1/completions", json=BODY)
                except httpx.TransportError as err:
                    seen.append(("closed", 0, type(err).__name__))
                    break
                reason = health.json().get("reason", "") if health.status_code != 200 else ""
                seen.append(("health", health.status_code, reason))
                seen.append(("completion", work.status_code, ""))
                await asyncio.sleep(0.1)
        await serving
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    return seen, elapsed


def test_a_stopping_worker_serves_not_ready_for_its_announcement_then_drains(
    worker: tuple[Any, EngineService],
) -> None:
    seen, elapsed = serve_and_stop(worker, announce_s=1.0, signals=1)
    probes = [s for s in seen if s[0] != "closed"]
    assert probes, seen
    # Not Ready the whole time, and every request served.
    assert {s for s in probes if s[0] == "health"} == {("health", 503, "stopping")}
    assert {s for s in probes if s[0] == "completion"} == {("completion", 200, "")}
    # The drain (the port closing) came only after the announcement.
    assert elapsed >= 1.0


def test_a_second_signal_or_no_announcement_drains_at_once(
    worker: tuple[Any, EngineService],
) -> None:
    # An announcement far longer than the test: the drain must not wait for it.
    seen, elapsed = serve_and_stop(worker, announce_s=60.0, signals=2)
    assert elapsed < 30, seen
    seen, elapsed = serve_and_stop(worker, announce_s=0.0, signals=1)
    assert elapsed < 30, seen
    assert ("health", 503, "stopping") not in seen


def test_only_a_worker_in_a_kubernetes_pod_announces() -> None:
    from types import SimpleNamespace

    from pdcluster.runtime.spec import WorkerDrainSpec
    from pdcluster.runtime.worker_main import announce_seconds

    settings: Any = SimpleNamespace(
        role_spec=SimpleNamespace(drain=WorkerDrainSpec(announce_seconds=2.5))
    )
    assert announce_seconds(settings, {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == 2.5
    # Local mode: its router lets a worker go before the worker is stopped.
    assert announce_seconds(settings, {}) == 0.0
