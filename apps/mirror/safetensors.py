"""Whether a safetensors set on disk is whole, as its index describes it.

A sharded checkpoint has `model.safetensors.index.json`: `{"metadata": {"total_size": <tensor
bytes>}, "weight_map": {"<tensor>": "model-00001-of-00004.safetensors", ...}}`. Each shard is an
8-byte little-endian length N, an N-byte JSON header (`{"__metadata__": {...}, "<tensor>":
{"dtype", "shape", "data_offsets": [begin, end]}}`), then the data. A set is complete only when:

1. the shards present are exactly the files the weight map names;
2. every shard's header parses and `8 + N + max(end)` equals the file's size;
3. the tensors the headers name are exactly the weight map's keys;
4. the tensors' bytes add up to `total_size`;
5. every shard's sha256 is the one the Hub gives (`lfs.sha256`), when digests are given.

`check_set(folder)` returns the problems, each a sentence naming the file; an empty list is a
whole set. A single `model.safetensors` without an index is checked by conditions 2 and 5.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["INDEX", "check_set", "read_shard_header"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_HEADER = 100 * 2**20


class ShardError(ValueError):
    pass


def read_shard_header(path: Path) -> tuple[dict[str, Any], int]:
    """The shard's tensors (name -> entry) and the length its header says the file has."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise ShardError(f"{path.name} is {len(raw)} bytes: too short for a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER:
            raise ShardError(f"{path.name} claims a {length:,}-byte header, more than {MAX_HEADER:,}")
        text = handle.read(length)
    if len(text) < length:
        raise ShardError(f"{path.name} ends inside its header ({len(text):,} of {length:,} bytes)")
    try:
        header = json.loads(text)
    except ValueError as exc:
        raise ShardError(f"{path.name}: its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ShardError(f"{path.name}: its header is not an object")
    tensors: dict[str, Any] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]
        ):
            raise ShardError(f"{path.name}: tensor {name!r} has no valid data_offsets")
        tensors[name] = entry
        end = max(end, offsets[1])
    return tensors, 8 + length + end


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(2**20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_set(folder: Path, digests: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with the safetensors set in `folder` (empty: it is whole)."""
    folder = Path(folder)
    digests = digests or {}
    index_path = folder / INDEX
    present = {p.name for p in folder.glob("*.safetensors")}
    problems: list[str] = []
    if not index_path.is_file():
        if SINGLE not in present:
            return [f"neither {INDEX} nor {SINGLE} is there"]
        shards: set[str] = {SINGLE}
        weight_map: dict[str, str] | None = None
        total_size = None
    else:
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of tensor names to files")
            total_size = (index.get("metadata") or {}).get("total_size")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [f"{INDEX} cannot be read: {exc}"]
        shards = set(weight_map.values())
        missing = sorted(shards - present)
        extra = sorted(present - shards)
        if missing:
            problems.append(f"missing shards the index names: {', '.join(missing)}")
        if extra:
            problems.append(f"shards the index does not name: {', '.join(extra)}")
    named: set[str] = set()
    tensor_bytes = 0
    for shard in sorted(shards & present):
        path = folder / shard
        try:
            tensors, expected = read_shard_header(path)
        except ShardError as exc:
            problems.append(str(exc))
            continue
        size = path.stat().st_size
        if size != expected:
            problems.append(f"{shard} is {size:,} bytes; its header says {expected:,}")
        named |= set(tensors)
        tensor_bytes += sum(t["data_offsets"][1] - t["data_offsets"][0] for t in tensors.values())
        want = digests.get(shard)
        if want and _sha256(path) != want.lower():
            problems.append(f"{shard}: sha256 is not the {want[:12]}… the Hub gives")
    if weight_map is not None and not problems:
        if named != set(weight_map):
            gone = sorted(set(weight_map) - named)[:5]
            stray = sorted(named - set(weight_map))[:5]
            detail = "; ".join(
                part
                for part in (
                    f"not in any shard: {', '.join(gone)}" if gone else "",
                    f"not in the index: {', '.join(stray)}" if stray else "",
                )
                if part
            )
            problems.append(f"the shards' tensors differ from the index's weight map ({detail})")
        if isinstance(total_size, int) and tensor_bytes != total_size:
            problems.append(f"the tensors hold {tensor_bytes:,} bytes; the index's total_size is {total_size:,}")
    return problems
