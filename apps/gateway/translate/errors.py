"""Errors of the translation layer, and error bodies in each protocol's own shape.

`TranslationError` is raised for a request the translator cannot turn into a chat
completions request (a missing field, a wrong type, a block type with no equivalent).
The gateway answers it with a 400 in the client's protocol: `anthropic_error(400, ...)`
for /v1/messages, `openai_error(400, ..., param=e.param)` for the OpenAI-style endpoints.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TranslationError", "anthropic_error", "anthropic_error_type", "openai_error", "openai_error_type"]


class TranslationError(ValueError):
    """A request that cannot be translated; `param` names the offending field ("messages[2].content[0].type")."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __repr__(self) -> str:
        return f"TranslationError({self.message!r}, param={self.param!r})"


# Anthropic: https://docs.anthropic.com/en/api/errors. 402/408/409/504 follow the SDK's error types.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_type(status: int) -> str:
    """The Anthropic error type for an HTTP status: other 4xx are invalid requests, other 5xx api errors."""
    found = _ANTHROPIC_TYPES.get(status)
    if found is not None:
        return found
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def anthropic_error(status: int, message: str, type: str | None = None) -> dict[str, Any]:
    """`{"type": "error", "error": {"type": ..., "message": ...}}`, the body of an Anthropic error (and of
    the `error` event of an Anthropic stream)."""
    return {"type": "error", "error": {"type": type or anthropic_error_type(status), "message": message}}


# OpenAI: 401 keys, 403 permissions, 404 unknown models/routes are all "invalid_request_error" at
# api.openai.com with a `code` saying which; the type here says the class and the caller adds the code.
_OPENAI_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
}


def openai_error_type(status: int) -> str:
    found = _OPENAI_TYPES.get(status)
    if found is not None:
        return found
    return "server_error" if status >= 500 else "invalid_request_error"


def openai_error(
    status: int,
    message: str,
    type: str | None = None,
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}`, the body of an OpenAI-style error."""
    return {"error": {"message": message, "type": type or openai_error_type(status), "param": param, "code": code}}
