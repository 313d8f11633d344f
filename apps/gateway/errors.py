"""Refusals, and how each is written in the client's own protocol.

A `Refused` carries the status, the message (which says why, with the numbers) and optionally
the error's type and code; `error_body` writes it as an OpenAI-style or Anthropic error, and
`send_error` sends it with the gateway's headers (an Anthropic error body carries the request
id too, as Anthropic's do). `upstream_refusal` reads an engine's error answer and says what it
means for the client: a prompt over the context is the client's 400 with code
"context_length_exceeded" and the param naming the prompt's field, an input kind the model cannot
take (an image to a text model) a 400 with the engine's reason, and what the engine does not do
at all (its 501: embeddings of a model started without them) a 400 naming the reason; none is the
5xx that both SDKs would retry. An error's code is the engine's own when it gave a string one
(llama.cpp puts the HTTP status there as a number: that is no code), else null.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

from apps.gateway.translate import anthropic_error, openai_error

__all__ = ["Refused", "error_body", "send_error", "upstream_message", "upstream_refusal"]

Send = Callable[[dict[str, Any]], Awaitable[None]]

# Our kinds (Anthropic's names) as the OpenAI-style API spells them. An unknown model or route is an
# "invalid_request_error" at api.openai.com, with a code saying which.
OPENAI_KINDS = {
    "authentication_error": "authentication_error",
    "rate_limit_error": "rate_limit_error",
    "not_found_error": "invalid_request_error",
    "permission_error": "permission_error",
    "invalid_request_error": "invalid_request_error",
}


class Refused(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers or {}
        self.code = code
        self.param = param


def error_body(
    protocol: str,
    status: int,
    message: str,
    kind: str | None = None,
    code: str | None = None,
    param: str | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    if protocol == "anthropic":
        body = anthropic_error(status, message, kind)
        if request_id is not None:
            body["request_id"] = request_id
        return body
    return openai_error(status, message, OPENAI_KINDS.get(kind or ""), param, code)


REQUEST_ID_HEADER = b"x-llmgw-request-id"


async def send_error(send: Send, protocol: str, refusal: Refused, head: list[tuple[bytes, bytes]]) -> None:
    request_id = next((v.decode() for k, v in head if k == REQUEST_ID_HEADER), None)
    out = json.dumps(
        error_body(protocol, refusal.status, refusal.message, refusal.kind, refusal.code, refusal.param, request_id)
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode()), *head]
    headers += [(k.encode(), v.encode()) for k, v in refusal.headers.items()]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


def upstream_message(raw: bytes) -> tuple[str, dict[str, Any]]:
    """An engine's error answer: its message, and its error object (empty when it sent none)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace"), {}
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message") or error), error
        if isinstance(error, str):
            return error, {"message": error}
        return str(data.get("detail") or data.get("message") or "")[:300], {}
    return "", {}


# What engines say when a prompt does not fit (llama.cpp: exceed_context_size_error, "exceeds the
# available context size"; vLLM: "maximum context length is N tokens"; SGLang: "is longer than the
# model's context length"; OpenAI: context_length_exceeded).
_CONTEXT = re.compile(
    r"context (size|length|window)|context_length_exceeded|exceed_context_size|too many tokens", re.IGNORECASE
)
# An input the model cannot take: llama.cpp answers an image to a text-only model with a 500.
_UNSUPPORTED_INPUT = re.compile(
    r"(image|audio|video|file|multimodal|mmproj)[^.]*not supported|"
    r"not support(ed)?[^.]*(image|audio|video|multimodal)|does not support (image|audio)",
    re.IGNORECASE,
)


def upstream_refusal(
    status: int, raw: bytes, model: str, *, prompt_param: str | None = None, path: str = ""
) -> Refused:
    """What a non-2xx answer of an engine or provider means for the client. `prompt_param`: the
    request field that holds the prompt ("messages", "prompt", "input"), named by a context
    overflow; `path`: the endpoint the engine was asked on, named by a 501."""
    message, error = upstream_message(raw)
    message = message or f"the upstream answered {status}"
    kind = str(error.get("type") or "")
    given = error.get("code")
    code = given if isinstance(given, str) and given else ""
    about_context = _CONTEXT.search(message) or _CONTEXT.search(kind) or _CONTEXT.search(code)
    if about_context and (status < 500 or "exceed" in kind or "exceed" in message.lower()):
        return Refused(400, message, kind="invalid_request_error", code="context_length_exceeded", param=prompt_param)
    if _UNSUPPORTED_INPUT.search(message):
        return Refused(
            400, f"“{model}” cannot take this input: {message}", kind="invalid_request_error", code="unsupported_input"
        )
    if status == 501:
        # The engine does not do this at all (llama.cpp: embeddings of a model started without
        # --embeddings): the same request would get the same answer, so it is not a server error.
        what = f"answer {path}" if path else "answer this request"
        return Refused(
            400, f"“{model}” cannot {what}: {message}", kind="invalid_request_error", code="unsupported_endpoint"
        )
    if status == 429:
        return Refused(429, message, kind="rate_limit_error", code=code or None, headers={"retry-after": "1"})
    if 400 <= status < 600:
        return Refused(status, message, kind=None, code=code or None)
    return Refused(502, f"The replica of “{model}” answered {status}: {message}", kind="api_error")
