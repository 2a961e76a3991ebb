"""OpenAI's error shape and the statuses both servers answer with.

Every refusal, the gateway's or a worker's, is an `ApiError` raised at the edge and rendered once by
the server's middleware, so a client sees one format whoever refused it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The status counted for a request whose client left before its answer was complete (nginx's code).
CLIENT_GONE = 499
# Seconds a client refused for overload (429) is told to wait, by workers and gateways alike.
RETRY_AFTER_S = 1
_ERROR_TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}


class ApiError(Exception):
    """A request refused, with its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        default = "invalid_request_error" if status < 500 else "server_error"
        self.type = type or _ERROR_TYPES.get(status, default)

    def to_json(self) -> dict[str, Any]:
        return error_json(self.message, self.type, self.param, self.code)


def error_json(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_value(param: str, message: str) -> ApiError:
    """A 400 for one field's value."""
    return ApiError(400, message, param=param, code="invalid_value")
