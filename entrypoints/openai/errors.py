"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the HTTP status.

Status policy (documented in api_server's module docstring): every request-validation failure,
including wrong JSON types, is 400 BadRequestError, as vLLM's own validation handler does; 422 is
never used. `code` carries the HTTP status as an int, as vLLM's ErrorResponse does.
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


@dataclass
class OpenAIError(Exception):
    """Raised anywhere in request handling; the error middleware turns it into a response."""

    message: str
    status: int = 400
    param: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status), "param": self.param,
                          "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(
            status=self.status,
            text=json.dumps(self.body(), ensure_ascii=False),
            content_type="application/json",
            headers=headers,
        )


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 400, param)


def not_found(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, 404, param)
