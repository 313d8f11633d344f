"""Streamed answers under ASGI.

Django's ASGI handler sends a streamed answer with `async for`. Given a synchronous iterator (a
FileResponse's file, WhiteNoise's static files, a view's generator) it warns ("StreamingHttpResponse
must consume synchronous iterators ...") and reads the whole iterator into a list first: a mirror
file of many gigabytes would be held in memory before its first byte went out. AsyncStreams, the
outermost middleware, gives every such answer an asynchronous iterator instead, which reads one
chunk at a time in a worker thread. Under WSGI (the test client, a WSGI server) nothing changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest
from django.http.response import HttpResponseBase, StreamingHttpResponse

__all__ = ["READ_BYTES", "AsyncStreams", "make_async"]

#: What one read of a streamed file asks for: large enough that the thread hop per chunk is noise.
READ_BYTES = 256 * 1024
_DONE = object()


class AsyncStreams:
    """Middleware: under ASGI, a streamed answer with a synchronous iterator gets an asynchronous one."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.get_response(request)
        if isinstance(request, ASGIRequest) and isinstance(response, StreamingHttpResponse):
            make_async(response)
        return response


def make_async(response: StreamingHttpResponse) -> None:
    """Replace the answer's synchronous content by an asynchronous iterator over the same bytes
    (a file is read READ_BYTES at a time); an answer already asynchronous is left as it is.
    A file or generator stays among the answer's resources, so the handler still closes it at the end."""
    if response.is_async:
        return
    handle = getattr(response, "file_to_stream", None)
    if handle is not None:
        response.streaming_content = _read(handle)
    else:
        response.streaming_content = _pull(iter(cast(Iterator[bytes], response.streaming_content)))


async def _read(handle: Any) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(handle.read, READ_BYTES):
        yield chunk


async def _pull(chunks: Iterator[Any]) -> AsyncIterator[Any]:
    """Each chunk of a synchronous iterator, taken in a worker thread. (A generator given to the
    answer is among its resources already: the handler closes it when the answer ends.)"""
    while (chunk := await asyncio.to_thread(next, chunks, _DONE)) is not _DONE:
        yield chunk
