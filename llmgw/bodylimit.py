"""A bound on request bodies, enforced before anything reads them: an ASGI middleware.

Django's ASGIHandler copies a request's whole body into a SpooledTemporaryFile (memory up to
FILE_UPLOAD_MAX_MEMORY_SIZE, a temporary file past it) before any middleware or view runs, so
DATA_UPLOAD_MAX_MEMORY_SIZE only refuses a body that already sits on disk: one anonymous POST of
4 GB to /healthz wrote 4 GB. Wrapped around Django's application, this middleware decides first:

- no body (neither Content-Length nor Transfer-Encoding): the application gets the server's own
  receive and send, untouched, at no cost;
- a Content-Length within the limit: the same (the server never delivers more than it declares);
- a Content-Length over the limit: 413 at once, without calling the application or reading a
  byte of the body (so the server never sends "100 Continue" to a client that waits for it);
- a chunked body: counted as its messages pass through, each handed on as it came (nothing is
  gathered here). The message that takes it past the limit is not handed on: the client gets the
  413 and the application gets ``http.disconnect`` in its place, on which Django's read_body
  closes (and so deletes) its temporary file and returns without a traceback.

The 413 also closes the connection, so the server does not go on reading the rest of the body.
Its text is an HTTP protocol answer for clients and scripts: English, like the gateway's, and
never translated. Under /api/ it is JSON with DRF's ``detail`` key, as every API error is.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["BodyLimit", "refusal"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# Loose on purpose: Django, Channels and uvicorn each type an ASGI callable's arguments their own way.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

API_PREFIX = "/api/"


def refusal(path: str, limit: int, declared: int | None = None) -> tuple[bytes, bytes]:
    """The 413's body and content type for `path`: JSON under /api/, plain text elsewhere."""
    text = f"The request body is over the limit of {limit} bytes"
    text += f" (Content-Length: {declared})." if declared is not None else "."
    if path.startswith(API_PREFIX):
        return json.dumps({"detail": text}).encode(), b"application/json"
    return text.encode() + b"\n", b"text/plain; charset=utf-8"


class BodyLimit:
    """Refuse HTTP request bodies over `max_bytes` with a 413 before the wrapped app reads them."""

    __slots__ = ("app", "max_bytes")

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes}: expected a size in bytes, at least 0")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length: bytes | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"transfer-encoding":
                chunked = True
        if length is None and not chunked:
            await self.app(scope, receive, send)  # no body at all
            return
        declared = _whole_number(length)
        if declared is not None and declared > self.max_bytes:
            await _send_refusal(scope, send, self.max_bytes, declared)
            return
        if declared is not None and not chunked:
            # The server frames the body by its Content-Length: it cannot grow past it.
            await self.app(scope, receive, send)
            return
        await _Counted(self.app, scope, receive, send, self.max_bytes).run()


class _Counted:
    """One request whose body is counted as it streams (chunked, or a Content-Length not understood)."""

    __slots__ = ("answered", "app", "limit", "received", "refused", "scope", "server_receive", "server_send", "started")

    def __init__(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        self.app = app
        self.scope = scope
        self.server_receive = receive
        self.server_send = send
        self.limit = limit
        self.received = 0
        self.refused = False  # past the limit: the app reads nothing more
        self.answered = False  # the 413 is ours: the app's answer has no place on the connection
        self.started = False  # the app's answer has begun

    async def run(self) -> None:
        await self.app(self.scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self.server_receive()
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received <= self.limit:
            return message  # handed on as it came
        self.refused = True
        if not self.started:
            # The app is still reading the body, so nothing of its answer has left: answer for it.
            self.answered = True
            await _send_refusal(self.scope, self.server_send, self.limit, None)
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.answered:
            return  # the client has the 413 and the connection closes: an answer from the app comes too late
        if message["type"] == "http.response.start":
            self.started = True
        await self.server_send(message)


def _whole_number(value: bytes | None) -> int | None:
    # bytes.isdigit() is ASCII only; past 20 digits no length is real, and int() refuses 4,300
    if value is None or not value.isdigit() or len(value) > 20:
        return None
    return int(value)


async def _send_refusal(scope: Scope, send: Send, limit: int, declared: int | None) -> None:
    body, content_type = refusal(scope.get("path", ""), limit, declared)
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                (b"x-content-type-options", b"nosniff"),
                # The rest of the body is not wanted: close rather than read it to reach the next request.
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
