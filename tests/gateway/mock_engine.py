"""A scriptable stand-in for an engine speaking OpenAI chat completions, for faults a real engine
will not produce on demand.

It is an aiohttp.web server on 127.0.0.1 (a free port) in the test's own event loop. Each test sets
what it does (`mode` and friends) and reads what it saw (`seen`, `closed`, `arrived`):

- "ok" (the default): a chat completion with usage, or when the request says "stream": `chunks`
  content chunks, a finish chunk, a usage chunk (unless `stream_usage` is False), then `data: [DONE]`.
- "error": `error_status` with an OpenAI error body whose message is `error_message`.
- "die": `chunks` content chunks, then the connection is dropped (no finish, no [DONE], no last chunk).
- "hang": `chunks` content chunks, then nothing until the client goes away (`closed` is then set).

What an engine gives beyond text, on demand:

- `error_code` and `error_type` shape "error" answers as llama.cpp's are (`"code": 400`, the HTTP
  status as a number, and `"type": "exceed_context_size_error"` or the like);
- `answer`, a function of the request's body returning the assistant's message (`content` and/or
  `tool_calls`), whole or streamed (a tool call's arguments in two pieces), for agents' turns;
- `logprobs` in the answer (whole, and per chunk) when the request asks for them, as llama.cpp gives
  them, with `top_logprobs` alternatives;
- /v1/embeddings: vectors of `embedding_size` numbers per input (base64 when asked), or, with
  `embeddings` False, llama.cpp's 501 for a model started without --embeddings.

`require_key` makes every request without `Authorization: Bearer <require_key>` get a 401; `gate`
(an asyncio.Event) holds every request until it is set, to keep a replica's slots full; `hold` (an
asyncio.Event) holds a stream after its content chunks, before its end, until it is set.

A request may choose its own mode with a "mock" field in its body (the gateway passes unknown
fields on), so concurrent requests can each do something else.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

__all__ = ["MockEngine", "Seen", "closed_port"]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    raw: bytes = b""  # the body's bytes as they came


class MockEngine:
    def __init__(self, *, tokenizer: bool = False) -> None:
        # llama.cpp's /apply-template and /tokenize, which count every prompt as `prompt_tokens` tokens.
        self.tokenizer = tokenizer
        self.mode = "ok"
        self.chunks = 3
        self.pieces: list[str] | None = None  # the answer's text, a chunk per piece (else "t0 t1 …")
        # A model's own whole answer (a guard model's verdict), or a function of the request's body.
        self.replies: dict[str, str | Callable[[dict[str, Any]], str]] = {}
        self.delays: dict[str, float] = {}  # seconds a model's answers wait
        self.stream_usage = True
        self.prompt_tokens = 7
        self.error_status = 400
        self.error_message = "the engine did not like this"
        self.error_code: Any = None  # llama.cpp puts the HTTP status here, as a number
        self.error_type: str | None = None
        self.answer: Callable[[dict[str, Any]], dict[str, Any]] | None = None
        self.embeddings = True
        self.embedding_size = 64
        self.cached_tokens: int | None = None  # of the prompt, reported as read from the prompt cache
        self.require_key: str | None = None
        self.gate: asyncio.Event | None = None
        self.hold: asyncio.Event | None = None
        self.delay = 0.0  # seconds each answer waits before it starts
        self.linger = 0.0  # seconds a stream stays open after its [DONE]
        self.seen: list[Seen] = []
        self.arrived = asyncio.Event()  # set on every request (clear it to wait for the next)
        self.closed = asyncio.Event()  # a streaming handler found its client gone
        self.active = 0
        self.max_active = 0
        self._runner: web.AppRunner | None = None
        self.url = ""

    # Life cycle -------------------------------------------------------------------------------

    async def start(self, ssl_context: Any = None) -> MockEngine:
        """Serve on a free port of 127.0.0.1; with an SSL context, over TLS (as a provider would)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)  # the same answers, as text completions
        app.router.add_post("/v1/embeddings", self._embeddings)
        if self.tokenizer:
            app.router.add_post("/apply-template", self._apply_template)
            app.router.add_post("/tokenize", self._tokenize)
        # handler_cancellation: a client that goes away cancels the handler, which is how we see it.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # Answers ------------------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.seen.append(Seen(request.path, dict(request.headers), body, raw))
        self.arrived.set()
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.require_key is not None and request.headers.get("Authorization") != f"Bearer {self.require_key}":
                return _error(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")
            if self.gate is not None:
                await self.gate.wait()
            if self.delay:
                await asyncio.sleep(self.delay)
            if body.get("model") in self.delays:
                await asyncio.sleep(self.delays[body["model"]])
            mode = body.get("mock") if isinstance(body.get("mock"), str) else self.mode
            if mode == "error":
                return _error(
                    self.error_status,
                    self.error_message,
                    self.error_type or ("server_error" if self.error_status >= 500 else "invalid_request_error"),
                    self.error_code,
                )
            if (mode == "ok" or body.get("model") in self.replies) and not body.get("stream"):
                return web.json_response(self._completion(body, request.path == "/v1/completions"))
            return await self._stream(request, body, mode)
        except (asyncio.CancelledError, ConnectionResetError):
            self.closed.set()  # the client (the gateway) went away before we were done
            raise
        finally:
            self.active -= 1

    async def _apply_template(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": json.dumps(body.get("messages"))})

    async def _tokenize(self, _request: web.Request) -> web.Response:
        return web.json_response({"tokens": list(range(self.prompt_tokens))})

    def _usage(self, completion_tokens: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    async def _embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, dict(request.headers), body))
        self.arrived.set()
        if not self.embeddings:  # llama-server started without --embeddings, word for word
            return web.json_response(
                {
                    "error": {
                        "code": 501,
                        "message": "This server does not support embeddings. Start it with `--embeddings`",
                        "type": "not_supported_error",
                    }
                },
                status=501,
            )
        inputs = body.get("input")
        texts = inputs if isinstance(inputs, list) else [inputs]
        data = []
        for i, _text in enumerate(texts):
            vector = [round(0.01 * (k + 1), 4) for k in range(self.embedding_size)]
            embedding: Any = vector
            if body.get("encoding_format") == "base64":
                embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        usage = {"prompt_tokens": 2 * len(texts), "total_tokens": 2 * len(texts)}
        return web.json_response({"object": "list", "model": body.get("model"), "data": data, "usage": usage})

    def _message(self, body: dict[str, Any]) -> dict[str, Any]:
        """The assistant's message: `answer`'s, else the text reply."""
        if self.answer is not None and body.get("model") not in self.replies:
            return self.answer(body)
        return {"role": "assistant", "content": self._reply(body)}

    def _reply(self, body: dict[str, Any]) -> str:
        reply = self.replies.get(body.get("model"))
        if callable(reply):
            return reply(body)
        if reply is not None:
            return reply
        return "".join(self.pieces) if self.pieces is not None else "Hello there"

    def _completion(self, body: dict[str, Any], text_api: bool = False) -> dict[str, Any]:
        if text_api:
            return {
                "id": "cmpl-mock",
                "object": "text_completion",
                "created": 0,
                "model": body.get("model"),
                "choices": [{"index": 0, "text": self._reply(body), "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": 2,
                    "total_tokens": self.prompt_tokens + 2,
                },
            }
        message = self._message(body)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", **message},
            "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
        }
        if body.get("logprobs") and isinstance(message.get("content"), str):
            choice["logprobs"] = {"content": [_logprob(c, body) for c in message["content"]]}
        return {
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [choice],
            "usage": self._usage(2),
        }

    def _chunk(
        self, body: dict[str, Any], delta: dict[str, Any], finish: str | None = None, text_api: bool = False
    ) -> bytes:
        if text_api:
            data: dict[str, Any] = {
                "id": "cmpl-mock",
                "object": "text_completion",
                "created": 0,
                "model": body.get("model"),
                "choices": [{"index": 0, "text": delta.get("content", ""), "finish_reason": finish}],
            }
            return b"data: " + json.dumps(data).encode() + b"\n\n"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
        if body.get("logprobs") and delta.get("content"):
            choice["logprobs"] = {"content": [_logprob(delta["content"], body)]}
        data = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body.get("model"),
            "choices": [choice],
        }
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    async def _stream(self, request: web.Request, body: dict[str, Any], mode: str) -> web.StreamResponse:
        text_api = request.path == "/v1/completions"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunks = body["mock_chunks"] if isinstance(body.get("mock_chunks"), int) else self.chunks
        pieces = self.pieces if self.pieces is not None else [f"t{i} " for i in range(chunks)]
        message = self.answer(body) if self.answer is not None and not text_api else None
        if message is not None:
            pieces = [message["content"]] if message.get("content") else []
        elif body.get("model") in self.replies:  # the model's reply, in two pieces
            reply = self._reply(body)
            pieces = [reply[: len(reply) // 2], reply[len(reply) // 2 :]]
        chunks = len(pieces)
        for i, piece in enumerate(pieces):
            delta: dict[str, Any] = {"content": piece}
            if i == 0:
                delta["role"] = "assistant"
            await response.write(self._chunk(body, delta, text_api=text_api))
        finish = "stop"
        for k, call in enumerate((message or {}).get("tool_calls") or []):
            arguments = call["function"]["arguments"]
            half = len(arguments) // 2
            first = {"index": k, "id": call["id"], "type": "function", "function": {"name": call["function"]["name"]}}
            first["function"]["arguments"] = arguments[:half]
            await response.write(self._chunk(body, {"tool_calls": [first]}))
            rest = {"index": k, "function": {"arguments": arguments[half:]}}
            await response.write(self._chunk(body, {"tool_calls": [rest]}))
            chunks += 2
            finish = "tool_calls"
        if mode == "die":
            # Drop the connection without the last chunk of the chunked body: the client sees a
            # payload that was never completed.
            assert request.transport is not None
            request.transport.close()
            return response
        if mode == "hang":
            await asyncio.Event().wait()  # until the client goes away and the handler is cancelled
        if self.hold is not None:
            await self.hold.wait()
        await response.write(self._chunk(body, {}, finish, text_api=text_api))
        if self.stream_usage:
            usage = self._usage(chunks)
            data = {
                "id": "chatcmpl-mock",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body.get("model"),
                "choices": [],
                "usage": usage,
            }
            await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        if self.linger:
            await asyncio.sleep(self.linger)
        await response.write_eof()
        return response


def _logprob(text: str, body: dict[str, Any]) -> dict[str, Any]:
    """A token's log probability as llama.cpp reports it, with `top_logprobs` alternatives."""
    top = body.get("top_logprobs") if isinstance(body.get("top_logprobs"), int) else 0
    alternatives = [
        {"id": k, "token": f"alt{k}", "bytes": list(f"alt{k}".encode()), "logprob": -1.0 - k} for k in range(top)
    ]
    return {"id": 7, "token": text, "bytes": list(text.encode()), "logprob": -0.25, "top_logprobs": alternatives}


def _error(status: int, message: str, kind: str, code: Any = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": code}}, status=status)


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
