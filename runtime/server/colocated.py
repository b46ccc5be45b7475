"""Colocated backend: prefill and decode of a request in the same engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pdcluster.runtime.serving.backend import check_capacity, engine_request, page_counts
from pdcluster.runtime.serving.engine_service import EngineService, TokenEvent
from pdcluster.runtime.serving.request import PreparedRequest


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
