"""Colocated backend: prefill and decode of a request in the same engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdcluster.runtime.server.engine_service import EngineService, TokenEvent
from pdcluster.runtime.server.worker_app import BadRequest, PreparedRequest


def engine_request(req: PreparedRequest, **extra: Any) -> Any:
    from pdcluster.runtime.engine.engine import EngineRequest
    from pdcluster.runtime.engine.sampling import SamplingParams

    try:
        sampling = SamplingParams(**req.sampling, stop=list(req.stop_strings))
    except ValueError as err:
        raise BadRequest(str(err)) from None
    return EngineRequest(
        rid=req.rid, prompt_token_ids=list(req.prompt_ids), sampling=sampling, **extra
    )


def check_capacity(engine: Any, req: PreparedRequest) -> None:
    """400 before anything is reserved when the engine could never hold the request."""
    from pdcluster.runtime.engine.scheduler import RequestRejected

    try:
        engine.check_admissible(len(req.prompt_ids), int(req.sampling["max_tokens"]))
    except RequestRejected as err:
        raise BadRequest(str(err)) from None


def page_counts(engine: Any) -> dict[str, int]:
    """The KV pool's fill, as every role's /server_info reports it."""
    return {"num_free_pages": engine.num_free_pages, "num_total_pages": engine.num_total_pages}


class ColocatedBackend:
    role = "null"

    def __init__(self, service: EngineService) -> None:
        self.service = service

    def check(self, req: PreparedRequest) -> None:
        check_capacity(self.service.engine, req)
        engine_request(req)  # sampling parameters validated here, before anything runs

    async def events(self, req: PreparedRequest) -> AsyncIterator[TokenEvent]:
        async for event in self.service.generate(engine_request(req), req.stop_strings):
            yield event

    def abort(self, rid: str) -> None:
        self.service.abort(rid)

    def abort_all(self) -> None:
        self.service.abort_all()

    def server_info(self) -> dict[str, Any]:
        return page_counts(self.service.engine)

    def is_healthy(self) -> bool:
        return self.service.is_alive
