"""A safetensors set is whole only when the five conditions hold; each way of not being whole is
named. The shards are real safetensors files the test writes (8-byte length, JSON header, data)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from apps.mirror.safetensors import INDEX, check_set


def shard(path: Path, tensors: dict[str, int]) -> Path:
    """A shard holding each named tensor as that many bytes of F32 data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, size in tensors.items():
        header[name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offset))
    return path


def checkpoint(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    shard(folder / "model-00001-of-00002.safetensors", {"a.weight": 64, "b.weight": 32})
    shard(folder / "model-00002-of-00002.safetensors", {"c.weight": 128})
    index = {
        "metadata": {"total_size": 224},
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00001-of-00002.safetensors",
            "c.weight": "model-00002-of-00002.safetensors",
        },
    }
    (folder / INDEX).write_text(json.dumps(index))
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.safetensors")}


def test_a_whole_set_has_no_problem(tmp_path: Path) -> None:
    digests = checkpoint(tmp_path)
    assert check_set(tmp_path, digests) == []


def test_a_single_file_model_needs_no_index(tmp_path: Path) -> None:
    shard(tmp_path / "model.safetensors", {"w": 16})
    assert check_set(tmp_path) == []
    assert check_set(tmp_path / "nothing-here") == [f"neither {INDEX} nor model.safetensors is there"]


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert check_set(tmp_path) == ["missing shards the index names: model-00002-of-00002.safetensors"]


def test_a_truncated_shard_is_named_with_its_sizes(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    path = tmp_path / "model-00002-of-00002.safetensors"
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])
    assert check_set(tmp_path) == [f"model-00002-of-00002.safetensors is {size - 10:,} bytes; its header says {size:,}"]


def test_a_digest_mismatch_is_named(tmp_path: Path) -> None:
    digests = checkpoint(tmp_path)
    path = tmp_path / "model-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the same size, other bytes: only the digest can tell
    path.write_bytes(bytes(data))
    want = digests["model-00001-of-00002.safetensors"]
    assert check_set(tmp_path, digests) == [
        f"model-00001-of-00002.safetensors: sha256 is not the {want[:12]}… the Hub gives"
    ]


def test_tensors_that_differ_from_the_index_are_named(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    shard(tmp_path / "model-00002-of-00002.safetensors", {"d.weight": 128})
    assert check_set(tmp_path) == [
        "the shards' tensors differ from the index's weight map (not in any shard: c.weight; "
        "not in the index: d.weight)"
    ]


def test_a_total_size_that_does_not_add_up_is_named(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    index["metadata"]["total_size"] = 999
    (tmp_path / INDEX).write_text(json.dumps(index))
    assert check_set(tmp_path) == ["the tensors hold 224 bytes; the index's total_size is 999"]


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x01\x02", "is 2 bytes: too short for a safetensors header"),
        (struct.pack("<Q", 2**40), "claims a 1,099,511,627,776-byte header"),
        (struct.pack("<Q", 100) + b"{}", "ends inside its header (2 of 100 bytes)"),
        (struct.pack("<Q", 5) + b"nope!", "its header is not JSON"),
        (struct.pack("<Q", 22) + b'{"w": {"dtype": "F32"}}'[:22], "its header is not JSON"),
        (struct.pack("<Q", 23) + b'{"w": {"dtype": "F32"}}', "tensor 'w' has no valid data_offsets"),
        (struct.pack("<Q", 40) + b'{"w": {"data_offsets": [9, 2]}}'.ljust(40), "tensor 'w' has no valid data_offsets"),
    ],
)
def test_a_shard_whose_header_lies_is_named(tmp_path: Path, data: bytes, reason: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(data)
    (problem,) = check_set(tmp_path)
    assert problem.startswith("model.safetensors") and reason in problem
