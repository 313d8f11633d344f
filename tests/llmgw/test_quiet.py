"""What the web process must not say: the API's schema builds without a warning (in each language),
streamed answers need no warning under ASGI, and /favicon.ico is an icon, not a logged 404."""

from __future__ import annotations

import asyncio
import io
import warnings
from typing import Any

import pytest
from django.http import FileResponse, StreamingHttpResponse
from drf_spectacular.drainage import GENERATOR_STATS

from llmgw.streaming import READ_BYTES, make_async

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("language", ["en", "tr"])
def test_the_schema_the_api_docs_load_is_built_without_a_warning(
    language: str, alice: Any, client: Any, capsys: Any
) -> None:
    GENERATOR_STATS.reset()  # each message is printed once per process: forget those of earlier tests
    client.force_login(alice)
    answer = client.get("/api/v1/schema", headers={"accept-language": language})
    assert answer.status_code == 200
    schema = answer.content.decode()
    assert "fabric_tests_list" in schema and "guardrails_list" in schema and "mirror_overview" in schema
    assert "EngineNameEnum" in schema and "EngineBuildEnum" in schema
    assert not GENERATOR_STATS._warn_cache and not GENERATOR_STATS._error_cache, list(GENERATOR_STATS._warn_cache)
    assert "Warning" not in capsys.readouterr().err


def _drain(response: StreamingHttpResponse) -> bytes:
    async def read() -> bytes:
        return b"".join([part async for part in response])

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Django's "must consume synchronous iterators" would raise here
        return asyncio.run(read())


def test_a_streamed_file_is_read_chunk_by_chunk_by_an_asynchronous_iterator() -> None:
    data = bytes(range(256)) * (READ_BYTES // 64 + 3)  # four reads and a bit
    handle = io.BytesIO(data)
    reads: list[int] = []
    original = handle.read
    handle.read = lambda size=-1: (reads.append(size), original(size))[1]  # type: ignore[method-assign]
    response = FileResponse(handle, as_attachment=True, filename="x.bin")
    make_async(response)
    assert response.is_async
    assert _drain(response) == data
    assert reads and set(reads) == {READ_BYTES}, "never the whole file at once"
    assert response["Content-Length"] == str(len(data))
    response.close()
    assert handle.closed


def test_a_streamed_generator_keeps_its_chunks_and_an_empty_answer_stays_empty() -> None:
    response = StreamingHttpResponse(iter([b"a", "b", b"c"]))
    make_async(response)
    assert _drain(response) == b"abc"
    empty = StreamingHttpResponse(())
    make_async(empty)
    assert _drain(empty) == b""


def test_favicon_ico_is_an_icon(client: Any) -> None:
    answer = client.get("/favicon.ico")
    assert answer.status_code == 200
    assert answer["Content-Type"] == "image/x-icon"
    assert answer.content[:4] == b"\0\0\1\0"
    assert client.head("/favicon.ico").status_code == 200
