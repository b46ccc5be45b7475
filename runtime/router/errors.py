"""Errors the router returns to clients, in OpenAI's error shape.

Every error a client sees is ``{"error": {"message", "type", "code", "param"}}``
with an HTTP status, both for whole responses and for SSE error events, so
the official `openai` client raises a readable exception for each of them.

Pure module.
"""

from __future__ import annotations

from typing import Any

# HTTP status → OpenAI error `type`. Codes not listed are server errors.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}

# The status a client sees when it went away before the answer: nginx's
# convention, used only in metrics and logs (nobody reads the response).
CLIENT_CLOSED_REQUEST = 499


def error_type_for(status: int) -> str:
    return _TYPES.get(status, "server_error")


def error_body(
    message: str, status: int, *, code: str | int | None = None, param: str | None = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type_for(status),
            "code": status if code is None else code,
            "param": param,
        }
    }


class RouterError(Exception):
    """An error with the HTTP status and OpenAI-style body the client gets."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | int | None = None,
        param: str | None = None,
        reason: str = "",
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after  # sent as the Retry-After header
        self.message = message
        self.code = code
        self.param = param
        # Short, low-cardinality label for metrics and logs ("prefill_failed").
        self.reason = reason or f"http_{status}"
        # The request's rid once one was minted (sent as x-request-id).
        self.rid: str | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, code=self.code, param=self.param)


class NoHealthyWorkerError(RouterError):
    def __init__(self, role: str) -> None:
        super().__init__(
            503,
            f"no healthy {role} worker is available",
            code="no_healthy_worker",
            reason=f"no_healthy_{role}",
        )
        self.role = role
