"""The interface between the worker HTTP API and a role's backend, and the engine calls they share.

A `Backend` turns a validated `PreparedRequest` into token events: the
colocated one runs the whole request on its engine, the PD ones drive a
prefill or decode leg. `check_capacity` and `engine_request` run before
anything is reserved, so a request that can never be served is a 400.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from pdcluster.runtime.serving.engine_service import TokenEvent
from pdcluster.runtime.serving.request import BadRequest, PreparedRequest


class Backend(Protocol):
    role: str  # "null" (colocated) | "prefill" | "decode"

    def check(self, req: PreparedRequest) -> None:
        """Raise BadRequest when the request can never be served (capacity, ids)."""

    def events(self, req: PreparedRequest) -> AsyncIterator[TokenEvent]: ...

    def abort(self, rid: str) -> None: ...

    def abort_all(self) -> None: ...

    def server_info(self) -> dict[str, Any]: ...

    def is_healthy(self) -> bool: ...


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
