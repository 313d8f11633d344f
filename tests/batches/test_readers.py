"""The pieces that read what clients send, on their own: a multipart upload fed in any chunks, an
Anthropic batch's requests read one at a time, a file's lines counted as it is written, and what a
try's answer means for its line."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from apps.batches.jsonstream import NotJson, array_items
from apps.batches.multipart import MAX_HEADER_BYTES, BadMultipart, Data, End, Parser, Start, boundary_of
from apps.batches.runner import judge
from apps.batches.services import LineWork
from apps.batches.storage import OverLimit, Sink

BODY = (
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="purpose"\r\n\r\n'
    b"batch\r\n"
    b"--XyZ\r\n"
    b'Content-Disposition: form-data; name="file"; filename="in put.jsonl"\r\n'
    b"Content-Type: application/octet-stream\r\n\r\n"
    b'{"a": 1}\n--XyZ but not a boundary\r\n-XyZ\r\n{"b": 2}\n'
    b"\r\n--XyZ--\r\n"
)


def parse(body: bytes, size: int) -> tuple[dict[str, str | None], dict[str, bytes]]:
    parser = Parser(boundary_of("multipart/form-data; boundary=XyZ"))
    names: dict[str, str | None] = {}
    data: dict[str, bytes] = {}
    current = ""
    for start in range(0, len(body), size):
        for event in parser.feed(body[start : start + size]):
            if isinstance(event, Start):
                current = event.name
                names[current], data[current] = event.filename, b""
            elif isinstance(event, Data):
                data[current] += event.chunk
            else:
                assert isinstance(event, End)
    parser.finish()
    return names, data


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 10_000])
def test_a_multipart_upload_reads_the_same_in_any_chunks(size: int) -> None:
    names, data = parse(BODY, size)
    assert names == {"purpose": None, "file": "in put.jsonl"}
    assert data == {"purpose": b"batch", "file": b'{"a": 1}\n--XyZ but not a boundary\r\n-XyZ\r\n{"b": 2}\n'}


@pytest.mark.parametrize(
    ("content_type", "body", "said"),
    [
        ("application/json", b"{}", "must be multipart/form-data"),
        ("multipart/form-data", b"", "no valid multipart boundary"),
        ("multipart/form-data; boundary=XyZ", BODY[:-10], "ended before its closing boundary"),
        ("multipart/form-data; boundary=XyZ", b"--XyZ\r\nNo colon here\r\n\r\nx\r\n--XyZ--", "no colon"),
        ("multipart/form-data; boundary=XyZ", b"--XyZ\r\n\r\nx\r\n--XyZ--", "no Content-Disposition"),
        ("multipart/form-data; boundary=XyZ", b"--XyZ\r\nX: " + b"a" * MAX_HEADER_BYTES, "headers are over"),
    ],
)
def test_a_malformed_upload_says_what_is_wrong(content_type: str, body: bytes, said: str) -> None:
    with pytest.raises(BadMultipart, match=said):
        parser = Parser(boundary_of(content_type))
        parser.feed(body)
        parser.finish()


def test_an_anthropic_batch_is_read_one_request_at_a_time() -> None:
    body = json.dumps({"requests": [{"custom_id": f"r{i}", "params": {"n": 10**i}} for i in range(30)]}).encode()
    items = list(array_items(io.BytesIO(body).read, "requests", chunk=5))
    assert [item["params"]["n"] for item in items] == [10**i for i in range(30)]
    with pytest.raises(NotJson, match="over 100 characters"):
        list(array_items(io.BytesIO(b'{"requests": ["' + b"x" * 500 + b'"]}').read, "requests", chunk=8, max_item=100))
    with pytest.raises(NotJson, match="Infinity is not JSON"):
        list(array_items(io.BytesIO(b'{"requests": [Infinity]}').read, "requests"))


def test_a_file_counts_its_lines_as_it_is_written_and_stops_at_its_bounds(settings: object, tmp_path: Path) -> None:
    settings.BATCH_STORAGE_DIR = tmp_path  # type: ignore[attr-defined]
    sink = Sink(max_bytes=100)
    for piece in (b'{"a":1}\n\n  \n{"b"', b":2}\n", b'{"c":3}'):
        sink.write(piece)
    assert sink.line_count == 3 and sink.size == 27
    with pytest.raises(OverLimit) as over:
        sink.write(b"x" * 80)
    assert (over.value.what, over.value.limit) == ("bytes", 100)
    sink.discard()
    assert list((tmp_path / "tmp").iterdir()) == []


LINE = LineWork(
    id=1, batch_id="b", number=1, endpoint="/v1/chat/completions", model="m", body={}, key_hash="h", tries=0,
    failures=0, kind="openai",
)  # fmt: skip


def test_what_an_answer_means_for_its_line() -> None:
    ok = judge(LINE, 200, b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}', {}, attempts=3)
    assert (ok.status_code, ok.prompt_tokens, ok.completion_tokens, ok.retry) == (200, 3, 4, False)
    cut = judge(LINE, None, b"", {}, attempts=3)
    assert cut.retry and not cut.failed  # it gave way: no failure counted
    limit = judge(LINE, 429, b"{}", {"retry-after": "7"}, attempts=3)
    assert limit.retry and not limit.failed and limit.backoff_s == 7
    full = judge(LINE, 503, b"{}", {"retry-after": "5"}, attempts=3)
    assert full.retry and not full.failed
    died = judge(LINE, 502, b'{"error": {"message": "gone"}}', {}, attempts=3)
    assert died.retry and died.failed
    last = judge(LineWork(**{**LINE.__dict__, "failures": 2}), 502, b'{"error": {"message": "gone"}}', {}, attempts=3)
    assert not last.retry and last.response["error"]["message"] == "gone (tried 3 times, each failed)"
    refused = judge(LINE, 400, b'{"error": {"message": "bad"}}', {}, attempts=3)
    assert not refused.retry and refused.status_code == 400
    unknown = judge(LINE, 200, b'{"choices": []}', {}, attempts=3)
    assert unknown.prompt_tokens is None and unknown.completion_tokens is None
