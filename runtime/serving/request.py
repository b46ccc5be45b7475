"""The request a backend receives once the HTTP layer validated and tokenized it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from pdcluster.runtime.telemetry.span_plan import RequestStamps
    from pdcluster.runtime.telemetry.trace_context import RequestTrace


class Lenient(BaseModel):
    """Base of every worker request body."""

    # Unknown fields are ignored (other routers and OpenAI clients send extras
    # we do not use); known fields are type-checked strictly.
    model_config = ConfigDict(extra="ignore")


class BootstrapFields(Lenient):
    """PD pairing fields a PD router adds to both legs of a request."""

    bootstrap_host: str | None = Field(default=None, max_length=253)
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0, le=(1 << 63) - 1)
    # Optional explicit prefill dp rank (otherwise room % dp).
    data_parallel_rank: int | None = Field(default=None, ge=0, le=1023)

    @property
    def has_bootstrap(self) -> bool:
        return self.bootstrap_room is not None


class BadRequest(ValueError):
    """A request the worker refuses with a 4xx; nothing was reserved."""

    def __init__(
        self, message: str, status: int = 400, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers  # e.g. Retry-After on a 503


@dataclass
class PreparedRequest:
    rid: str
    prompt_ids: list[int]
    sampling: dict[str, Any]  # keyword arguments of engine SamplingParams
    stop_strings: list[str]
    bootstrap: BootstrapFields
    # The worker minted `rid` (the caller sent none): it names the request on
    # this worker only and is never compared with the other leg's.
    rid_is_local: bool = False
    # The caller's W3C `traceparent`, passed on to a dp group's leader and to logs.
    traceparent: str | None = None
    # Tracing on: the request's trace ids and sampling decision (`telemetry/trace_context.py`).
    trace: RequestTrace | None = None
    # Stage stamps for this worker's spans; None unless the request is traced.
    stamps: RequestStamps | None = None
