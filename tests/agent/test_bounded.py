"""Decoding what another party sent stops at its bound, holding no more than the bound in memory,
and says what and how much; data that is not what it claims is a ValueError with the reason."""

from __future__ import annotations

import gzip
import io
import os
import tracemalloc
import zlib

import pytest

from agent.bounded import TooLarge, b64decode, copy, inflate, size_text


def zeros_gzip(mib: int) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join([packer.compress(bytes(2**20)) for _ in range(mib)] + [packer.flush()])


def test_a_gzip_bomb_stops_at_the_bound_holding_no_more_than_it() -> None:
    bomb = zeros_gzip(300)
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge, match="^the map inflates past 16 MiB$") as refused:
            inflate(bomb, limit=16 * 2**20, what="the map")
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.limit == 16 * 2**20
    assert peak < 2 * 16 * 2**20, f"held {peak:,} bytes"  # the bound and its buffer's growth, not 300 MiB


def test_what_fits_comes_back_whole_members_and_padding_included() -> None:
    text = os.urandom(3 * 2**20 + 5)
    assert inflate(gzip.compress(text), limit=len(text), what="x") == text
    assert inflate(gzip.compress(b"ab") + gzip.compress(b"cd") + b"\0" * 8, limit=4, what="x") == b"abcd"
    with pytest.raises(TooLarge, match="x inflates past 3 bytes"):
        inflate(gzip.compress(b"ab") + gzip.compress(b"cd"), limit=3, what="x")


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (gzip.compress(b"fabric " * 10_000)[:-30], "the map ends inside its compressed data"),
        (b"switch guid 0x1", "the map is not gzip data"),
    ],
)
def test_data_that_is_not_whole_gzip_is_refused_with_why(data: bytes, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        inflate(data, limit=2**20, what="the map")


def test_base64_is_judged_by_its_length_before_it_is_decoded() -> None:
    assert b64decode("aGVsbG8=", limit=5, what="x") == b"hello"
    with pytest.raises(TooLarge, match="the map decodes past 4 bytes"):
        b64decode("aGVsbG8=", limit=4, what="the map")
    with pytest.raises(ValueError, match="x is not base64"):
        b64decode("%%%", limit=10, what="x")


def test_a_copy_writes_nothing_past_its_bound() -> None:
    written = bytearray()
    assert copy(io.BytesIO(b"a" * 10), written.extend, limit=10, what="x") == 10
    written.clear()
    with pytest.raises(TooLarge, match="member m inflates past 2 MiB"):
        copy(io.BytesIO(bytes(5 * 2**20)), written.extend, limit=2 * 2**20, what="member m")
    assert len(written) <= 2 * 2**20


def test_sizes_read_as_they_are_set() -> None:
    assert [size_text(n) for n in (64 * 2**20, 2 * 2**30, 1536, 1_000_001)] == [
        "64 MiB",
        "2 GiB",
        "1,536 bytes",
        "1,000,001 bytes",
    ]
