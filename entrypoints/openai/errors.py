"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Status policy (documented in api_server's module docstring): every request-validation failure,
including wrong JSON types, is 400 BadRequestError, as vLLM's own validation handler does; 422 is
never used. `code` carries the HTTP status as an int, as vLLM's ErrorResponse does.

The error path must never fail itself: messages often echo what the client sent (a model name, a
path), which may hold lone surrogates that no UTF-8 encoder accepts, so every string in the body
is made encodable first and the JSON is written ASCII-only.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web

# The `type` names follow the openai client's exception classes for each status.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    501: "NotImplementedError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")


def encodable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (lone surrogates) spelled as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class OpenAIError(Exception):
    """Raised anywhere in request handling; the error middleware turns it into a response."""

    message: str
    status: int = 400
    param: str | None = None
    headers: dict[str, str] | None = None  # e.g. Retry-After on a 503
    # The request body was not (fully) read: the connection cannot carry another request.
    close_connection: bool = False

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        param = encodable(self.param) if self.param is not None else None
        return {"error": {"message": encodable(self.message), "type": error_type(self.status), "param": param,
                          "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=json.dumps(self.body(), ensure_ascii=True).encode("ascii"),
            content_type="application/json",
            charset="utf-8",
            headers={**(self.headers or {}), **(headers or {})} or None,
        )
        if self.close_connection:
            resp.force_close()
        return resp


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 404, param)
