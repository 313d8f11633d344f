"""/v1/files, /v1/batches and /v1/messages/batches: plain ASGI, beside the gateway (llmgw/asgi.py).

The callers are the official SDKs (client.files.create, client.batches.create/retrieve/cancel/list,
client.files.content; anthropic's client.messages.batches.create/retrieve/list/cancel/delete/
results), so every answer and error is in the shape its API gives, and a key is accepted as the
gateway accepts it (its in-memory key table: a revoked key is refused at once). Database work runs
in threads, never on the event loop.

Bodies are bounded before they are held: an upload is written to disk as it arrives (multipart read
in bounded memory, apps.batches.multipart) and refused with a 413 as soon as it passes
LLMGW_BATCH_MAX_FILE_BYTES or what the organisation's storage limit leaves; an Anthropic batch's
body is spooled the same way and its requests read one at a time (apps.batches.jsonstream); other
bodies are small JSON documents (at most 1 MiB).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from asgiref.sync import sync_to_async
from django.conf import settings

from apps.batches import services, shapes, storage
from apps.batches.choices import FilePurpose, Kind
from apps.batches.jsonstream import NotJson, array_items
from apps.batches.multipart import BadMultipart, Data, End, Parser, Start, boundary_of
from apps.batches.services import BatchRefused, Owner
from apps.gateway.errors import Refused, send_error
from apps.gateway.intake import ClientLeft

__all__ = ["BatchesApp", "handles"]

log = logging.getLogger("llmgw.batches")

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

PREFIXES = ("/v1/files", "/v1/batches", "/v1/messages/batches")
MAX_JSON_BYTES = 1024 * 1024
UPLOAD_PURPOSES = (FilePurpose.BATCH, FilePurpose.USER_DATA)


def handles(path: str) -> bool:
    """Whether a path is one of these APIs' (and not the gateway's)."""
    return any(path == prefix or path.startswith(prefix + "/") for prefix in PREFIXES)


async def _db[T](func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    def run() -> T:
        from django.db import close_old_connections

        close_old_connections()
        try:
            return func(*args, **kwargs)
        finally:
            # Back to the pool: an executor thread keeps its connection otherwise, and a few of them
            # hold every connection of the process's pool (LLMGW_DATABASE_POOL_SIZE).
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


@dataclass
class Request:
    scope: dict[str, Any]
    receive: Receive
    send: Send
    protocol: str  # "openai" or "anthropic": the shape of answers and errors
    request_id: str
    owner: Owner | None = None

    @property
    def method(self) -> str:
        return str(self.scope["method"])

    def header(self, name: bytes) -> str:
        for key, value in self.scope.get("headers", []):
            if key == name:
                return str(value.decode("latin-1"))
        return ""

    def query(self) -> dict[str, str]:
        parsed = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        return {key: values[-1] for key, values in parsed.items()}

    def head(self, content_type: bytes | None = b"application/json") -> list[tuple[bytes, bytes]]:
        rid = self.request_id.encode()
        headers = [(b"x-llmgw-request-id", rid), (b"x-request-id", rid), (b"request-id", rid)]
        if content_type is not None:
            headers.insert(0, (b"content-type", content_type))
        return headers

    async def answer(self, body: Any, status: int = 200) -> None:
        out = json.dumps(body).encode()
        headers = [*self.head(), (b"content-length", str(len(out)).encode())]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": out})


def _refused(exc: BatchRefused) -> Refused:
    return Refused(exc.status, exc.message, kind=exc.kind, code=exc.code, param=exc.param)


def _limit(text: str | None, default: int, most: int) -> int:
    if text is None or text == "":
        return default
    if not re.fullmatch(r"[0-9]{1,7}", text) or not 1 <= int(text) <= most:
        raise BatchRefused(400, f"'limit' must be a whole number from 1 to {most}.", param="limit")
    return int(text)


class BatchesApp:
    """The ASGI application of these APIs; `gateway` is the process's GatewayApp (its key table)."""

    def __init__(self, gateway: Any) -> None:
        self.gateway = gateway

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        protocol = "anthropic" if path.startswith("/v1/messages") else "openai"
        request = Request(scope, receive, send, protocol, "req_" + uuid.uuid4().hex)
        try:
            await self.gateway.ensure_started()
            request.owner = await self._owner(scope)
            await self._route(request, path)
        except BatchRefused as exc:
            await send_error(send, protocol, _refused(exc), request.head(None))
        except Refused as exc:
            await send_error(send, protocol, exc, request.head(None))
        except ClientLeft:
            return
        except Exception:
            log.exception("batches API: %s %s failed", scope.get("method"), path)
            refusal = Refused(500, "The server failed to handle this request.")
            await send_error(send, protocol, refusal, request.head(None))

    async def _owner(self, scope: dict[str, Any]) -> Owner:
        entry = await self.gateway.authenticate(scope)
        return Owner(
            user_id=entry.user_id,
            key_id=entry.key_id,
            org_id=entry.org_id,
            team_id=entry.team_id,
            project_id=entry.project_id,
        )

    async def _route(self, request: Request, path: str) -> None:
        parts = path.split("/")[2:]  # "/v1/files/x/content" -> ["files", "x", "content"]
        method = request.method
        if parts[0] == "messages":
            parts = parts[1:]
            table = self._anthropic_routes()
        elif parts[0] == "files":
            table = self._file_routes()
        else:
            table = self._batch_routes()
        shape = (method, len(parts), parts[2] if len(parts) > 2 else None)
        handler = table.get(shape)
        if handler is None:
            raise BatchRefused(404, f"No route for {method} {path[:200]}", kind="not_found_error", code="unknown_url")
        await handler(request, *parts[1:2])

    def _file_routes(self) -> dict[tuple[str, int, str | None], Callable[..., Awaitable[None]]]:
        return {
            ("POST", 1, None): self.upload,
            ("GET", 1, None): self.list_files,
            ("GET", 2, None): self.get_file,
            ("DELETE", 2, None): self.delete_file,
            ("GET", 3, "content"): self.file_content,
        }

    def _batch_routes(self) -> dict[tuple[str, int, str | None], Callable[..., Awaitable[None]]]:
        return {
            ("POST", 1, None): self.create_batch,
            ("GET", 1, None): self.list_batches,
            ("GET", 2, None): self.get_batch,
            ("POST", 3, "cancel"): self.cancel_batch,
        }

    def _anthropic_routes(self) -> dict[tuple[str, int, str | None], Callable[..., Awaitable[None]]]:
        return {
            ("POST", 1, None): self.create_message_batch,
            ("GET", 1, None): self.list_message_batches,
            ("GET", 2, None): self.get_message_batch,
            ("DELETE", 2, None): self.delete_message_batch,
            ("POST", 3, "cancel"): self.cancel_message_batch,
            ("GET", 3, "results"): self.message_batch_results,
        }

    # Bodies ------------------------------------------------------------------------------------------

    async def _json(self, request: Request) -> dict[str, Any]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_JSON_BYTES:
                raise BatchRefused(413, f"The body is over the limit of {MAX_JSON_BYTES} bytes.")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        try:
            body = json.loads(b"".join(chunks) or b"{}")
        except ValueError as exc:
            raise BatchRefused(400, f"The body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BatchRefused(400, "The body must be a JSON object.")
        return body

    async def _spool(self, request: Request, sink: storage.Sink, write: Callable[[bytes], None] | None = None) -> None:
        """Write the body into `sink` (through `write` when given) as it arrives."""
        put = write or sink.write
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            chunk = message.get("body", b"")
            if chunk:
                put(chunk)
            if not message.get("more_body"):
                return

    # Files -------------------------------------------------------------------------------------------

    async def upload(self, request: Request) -> None:
        assert request.owner is not None
        try:
            boundary = boundary_of(request.header(b"content-type"))
        except BadMultipart as exc:
            raise BatchRefused(400, f"Upload a file as multipart/form-data: {exc}.") from None
        most = await _db(services.upload_bound, request.owner)
        sink = storage.Sink(max_bytes=most)
        form = _Form(Parser(boundary), sink)
        try:
            await self._spool(request, sink, form.feed)
            form.finish()
            if form.filename is None:
                raise BatchRefused(400, "Missing required parameter: 'file'.", param="file")
            purpose = form.fields.get("purpose", "")
            if purpose not in UPLOAD_PURPOSES:
                raise BatchRefused(
                    400,
                    f"'purpose' must be one of {', '.join(UPLOAD_PURPOSES)}, got “{purpose[:40]}”.",
                    param="purpose",
                )
            row = await _db(services.create_file, request.owner, sink, purpose=purpose, filename=form.filename)
        except storage.OverLimit as over:
            sink.discard()
            raise _over(over, most) from None
        except BadMultipart as exc:
            sink.discard()
            raise BatchRefused(400, f"The upload is not valid multipart/form-data: {exc}.") from None
        except BaseException:
            sink.discard()
            raise
        await request.answer(shapes.file_object(row))

    async def list_files(self, request: Request) -> None:
        assert request.owner is not None
        query = request.query()
        limit = _limit(query.get("limit"), 10_000, 10_000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise BatchRefused(400, "'order' must be asc or desc.", param="order")
        rows, more = await _db(_file_page, request.owner, limit, order, query.get("after"), query.get("purpose"))
        await request.answer(shapes.page([shapes.file_object(r) for r in rows], more))

    async def get_file(self, request: Request, file_id: str) -> None:
        assert request.owner is not None
        row = await _db(services.get_file, request.owner, file_id)
        await request.answer(shapes.file_object(row))

    async def delete_file(self, request: Request, file_id: str) -> None:
        assert request.owner is not None
        await _db(services.delete_file, request.owner, file_id)
        await request.answer({"id": file_id, "object": "file", "deleted": True})

    async def file_content(self, request: Request, file_id: str) -> None:
        assert request.owner is not None
        row = await _db(services.get_file, request.owner, file_id)
        await self._stream_file(request, row.id, row.bytes)

    async def _stream_file(self, request: Request, file_id: str, size: int) -> None:
        try:
            handle = await asyncio.to_thread(storage.file_path(file_id).open, "rb")
        except OSError:
            raise BatchRefused(404, f"The bytes of {file_id} are gone.", kind="not_found_error") from None
        try:
            headers = [*request.head(b"application/octet-stream"), (b"content-length", str(size).encode())]
            await request.send({"type": "http.response.start", "status": 200, "headers": headers})
            sent = 0
            while sent < size:
                chunk = await asyncio.to_thread(handle.read, min(storage.CHUNK, size - sent))
                if not chunk:
                    break
                sent += len(chunk)
                await request.send({"type": "http.response.body", "body": chunk, "more_body": sent < size})
            if sent < size:  # the file shrank under us: end the answer rather than hang
                await request.send({"type": "http.response.body", "body": b""})
        finally:
            handle.close()

    # OpenAI batches ----------------------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> None:
        assert request.owner is not None
        body = await self._json(request)
        from apps.batches.validation import OPENAI_ENDPOINTS

        batch = await _db(services.create_openai_batch, request.owner, body, OPENAI_ENDPOINTS)
        await request.answer(shapes.openai_batch(batch, settings.BATCH_PRICE_FACTOR))

    async def list_batches(self, request: Request) -> None:
        assert request.owner is not None
        query = request.query()
        limit = _limit(query.get("limit"), 20, 100)
        rows, more = await _db(_batch_page, request.owner, Kind.OPENAI, limit, query.get("after"), None)
        await request.answer(shapes.page([shapes.openai_batch(r, settings.BATCH_PRICE_FACTOR) for r in rows], more))

    async def get_batch(self, request: Request, batch_id: str) -> None:
        assert request.owner is not None
        batch = await _db(services.get_batch, request.owner, batch_id, Kind.OPENAI)
        await request.answer(shapes.openai_batch(batch, settings.BATCH_PRICE_FACTOR))

    async def cancel_batch(self, request: Request, batch_id: str) -> None:
        batch = await _db(_cancel, request.owner, batch_id, Kind.OPENAI)
        await request.answer(shapes.openai_batch(batch, settings.BATCH_PRICE_FACTOR))

    # Anthropic Message Batches ----------------------------------------------------------------------------

    def _results_url(self, request: Request, batch_id: str) -> str:
        path = f"/v1/messages/batches/{batch_id}/results"
        if settings.PUBLIC_URL:
            return settings.PUBLIC_URL.rstrip("/") + path
        scheme = request.scope.get("scheme", "http")
        if settings.BEHIND_TLS_PROXY and request.header(b"x-forwarded-proto") == "https":
            scheme = "https"
        host = request.header(b"host") or "127.0.0.1"
        return f"{scheme}://{host}{path}"

    def _message_batch(self, request: Request, batch: Any) -> dict[str, Any]:
        return shapes.anthropic_batch(batch, self._results_url(request, batch.id), settings.BATCH_PRICE_FACTOR)

    async def create_message_batch(self, request: Request) -> None:
        assert request.owner is not None
        sink = storage.Sink(max_bytes=settings.BATCH_MAX_FILE_BYTES)
        try:
            await self._spool(request, sink)
            batch = await _db(_create_message_batch, request.owner, sink)
        except storage.OverLimit as over:
            raise _over(over, settings.BATCH_MAX_FILE_BYTES) from None
        finally:
            sink.discard()
        await request.answer(self._message_batch(request, batch))

    async def list_message_batches(self, request: Request) -> None:
        assert request.owner is not None
        query = request.query()
        limit = _limit(query.get("limit"), 20, 1000)
        rows, more = await _db(
            _batch_page, request.owner, Kind.ANTHROPIC, limit, query.get("after_id"), query.get("before_id")
        )
        items = [self._message_batch(request, r) for r in rows]
        await request.answer(shapes.page(items, more, anthropic=True))

    async def get_message_batch(self, request: Request, batch_id: str) -> None:
        assert request.owner is not None
        batch = await _db(services.get_batch, request.owner, batch_id, Kind.ANTHROPIC)
        await request.answer(self._message_batch(request, batch))

    async def cancel_message_batch(self, request: Request, batch_id: str) -> None:
        batch = await _db(_cancel, request.owner, batch_id, Kind.ANTHROPIC)
        await request.answer(self._message_batch(request, batch))

    async def delete_message_batch(self, request: Request, batch_id: str) -> None:
        await _db(_delete, request.owner, batch_id)
        await request.answer({"id": batch_id, "type": "message_batch_deleted"})

    async def message_batch_results(self, request: Request, batch_id: str) -> None:
        assert request.owner is not None
        batch = await _db(services.get_batch, request.owner, batch_id, Kind.ANTHROPIC)
        results = await _db(_results_file, batch)
        if results is None:
            raise BatchRefused(
                404, f"Message Batch {batch_id} has no results yet: it is {batch.status}.", kind="not_found_error"
            )
        await self._stream_file(request, results.id, results.bytes)


# Multipart forms ----------------------------------------------------------------------------------------


class _Form:
    """The fields of an upload (small, in memory) and its file part (written to the sink)."""

    MAX_FIELD = 1024

    def __init__(self, parser: Parser, sink: storage.Sink) -> None:
        self.parser = parser
        self.sink = sink
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self._current: str | None = None
        self._into_file = False
        self._field = bytearray()

    def feed(self, chunk: bytes) -> None:
        for event in self.parser.feed(chunk):
            if isinstance(event, Start):
                self._start(event)
            elif isinstance(event, Data):
                self._data(event.chunk)
            elif isinstance(event, End):
                self._end()

    def _start(self, event: Start) -> None:
        self._current = event.name
        self._into_file = event.name == "file" and event.filename is not None and self.filename is None
        if self._into_file:
            self.filename = (event.filename or "file").replace("/", "_").replace("\\", "_")[:255]
        self._field = bytearray()

    def _data(self, chunk: bytes) -> None:
        if self._into_file:
            self.sink.write(chunk)
        elif len(self._field) + len(chunk) <= self.MAX_FIELD:
            self._field += chunk
        else:
            raise BadMultipart(f"the field “{self._current}” is over {self.MAX_FIELD} bytes")

    def _end(self) -> None:
        if not self._into_file and self._current is not None:
            self.fields[self._current] = self._field.decode("utf-8", "replace").strip()
        self._into_file = False
        self._current = None

    def finish(self) -> None:
        self.parser.finish()


def _over(over: storage.OverLimit, most: int) -> BatchRefused:
    if most < settings.BATCH_MAX_FILE_BYTES:
        return BatchRefused(
            413,
            f"The file is over {most} bytes, what this organisation's storage limit of "
            f"{settings.BATCH_ORG_STORAGE_BYTES} bytes leaves (LLMGW_BATCH_ORG_STORAGE_BYTES).",
            code="storage_limit_exceeded",
        )
    return BatchRefused(
        413,
        f"The file is over the limit of {most} bytes (LLMGW_BATCH_MAX_FILE_BYTES).",
        code="file_too_large",
    )


# In threads ---------------------------------------------------------------------------------------------


def _file_page(owner: Owner, limit: int, order: str, after: str | None, purpose: str | None) -> tuple[list[Any], bool]:
    rows = services.files_for(owner)
    if purpose:
        rows = rows.filter(purpose=purpose)
    ordering = ("created_at", "id") if order == "asc" else ("-created_at", "-id")
    rows = rows.order_by(*ordering)
    if after:
        mark = services.files_for(owner).filter(pk=after).values_list("created_at", "id").first()
        if mark is not None:
            from django.db.models import Q

            if order == "asc":
                rows = rows.filter(Q(created_at__gt=mark[0]) | Q(created_at=mark[0], id__gt=mark[1]))
            else:
                rows = rows.filter(Q(created_at__lt=mark[0]) | Q(created_at=mark[0], id__lt=mark[1]))
    found = list(rows[: limit + 1])
    return found[:limit], len(found) > limit


def _batch_page(owner: Owner, kind: str, limit: int, after: str | None, before: str | None) -> tuple[list[Any], bool]:
    from django.db.models import Q

    rows = services.batches_for(owner, kind).order_by("-created_at", "-id")
    if before:
        mark = services.batches_for(owner, kind).filter(pk=before).values_list("created_at", "id").first()
        if mark is not None:
            newer = rows.filter(Q(created_at__gt=mark[0]) | Q(created_at=mark[0], id__gt=mark[1]))
            found = list(reversed(newer.order_by("created_at", "id")[: limit + 1]))
            return found[-limit:], len(found) > limit
    if after:
        mark = services.batches_for(owner, kind).filter(pk=after).values_list("created_at", "id").first()
        if mark is not None:
            rows = rows.filter(Q(created_at__lt=mark[0]) | Q(created_at=mark[0], id__lt=mark[1]))
    found = list(rows[: limit + 1])
    return found[:limit], len(found) > limit


def _cancel(owner: Owner, batch_id: str, kind: str) -> Any:
    batch = services.get_batch(owner, batch_id, kind)
    return services.cancel_batch(owner, batch, actor=services._user(owner))


def _delete(owner: Owner, batch_id: str) -> None:
    batch = services.get_batch(owner, batch_id, Kind.ANTHROPIC)
    services.delete_batch(owner, batch, actor=services._user(owner))


def _results_file(batch: Any) -> Any:
    from apps.batches.models import BatchFile

    if not batch.ended or not batch.output_file_id:
        return None
    return BatchFile.objects.filter(pk=batch.output_file_id).first()


def _create_message_batch(owner: Owner, sink: storage.Sink) -> Any:
    with sink.path.open("rb") as handle:
        try:
            requests = array_items(handle.read, "requests", max_item=settings.GATEWAY_MAX_BODY_BYTES)
            return services.create_anthropic_batch(owner, requests)
        except NotJson as exc:
            raise BatchRefused(400, f"The body is not a Message Batch: {exc}.") from None
