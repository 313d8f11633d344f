"""Mount tables, storage pools for model directories, and "are the weights there" checks.

* :func:`parse_mountinfo` / :func:`parse_findmnt_json` are pure parsers.
* :func:`storage_pools` and :func:`weights_present` look at the file system (``os.path``,
  ``os.listdir``, an injectable ``statvfs``) and never raise for a missing or unreadable path.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agent.messages import HeldSource
from agent.probes.jsontext import read_json

__all__ = [
    "PARTIAL_SUFFIXES",
    "SHARED_FS_TYPES",
    "Mount",
    "StoragePool",
    "WeightsScan",
    "is_shared",
    "mount_for_path",
    "parse_findmnt_json",
    "parse_mountinfo",
    "scan_weights",
    "storage_pools",
    "weights_held",
    "weights_present",
]


@dataclass
class Mount:
    """One mounted file system.  Fields a source did not give are None."""

    mount_id: int | None
    parent_id: int | None
    #: ``"253:0"``; for network file systems an anonymous ``"0:59"``.
    major_minor: str | None
    #: The directory of the file system that is mounted here (``/`` unless a bind mount of a subtree).
    root: str | None
    mount_point: str
    fstype: str | None
    source: str | None
    options: str | None = None


def _unescape(field_text: str) -> str:
    """Undo the kernel's octal escapes in mountinfo (``\\040`` space, ``\\011`` tab, ``\\012``, ``\\134``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field_text)


# Mount ids are small numbers; isdigit() would also pass "²" and 5,000 digits that int() refuses.
_MOUNT_ID_RE = re.compile(r"[0-9]{1,10}")


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/<pid>/mountinfo``; malformed lines are skipped.

    Format: ``id parent major:minor root mount_point options [optional fields...] - fstype source super_options``.
    """
    mounts: list[Mount] = []
    for raw in (text or "").lstrip("\ufeff").splitlines():
        parts = raw.split()
        if len(parts) < 7:
            continue
        try:
            separator = parts.index("-", 6)
        except ValueError:
            continue
        if not (_MOUNT_ID_RE.fullmatch(parts[0]) and _MOUNT_ID_RE.fullmatch(parts[1])):
            continue
        tail = parts[separator + 1 :]
        mounts.append(
            Mount(
                mount_id=int(parts[0]),
                parent_id=int(parts[1]),
                major_minor=parts[2] if re.fullmatch(r"\d+:\d+", parts[2]) else None,
                root=_unescape(parts[3]),
                mount_point=_unescape(parts[4]),
                fstype=_unescape(tail[0]) if tail else None,
                source=_unescape(tail[1]) if len(tail) > 1 else None,
                options=parts[5],
            )
        )
    return mounts


_BIND_SUFFIX_RE = re.compile(r"^(?P<source>.*?)\[(?P<root>/[^\]]*)\]$")


def _findmnt_entries(node: Any) -> Iterable[dict[str, Any]]:
    if isinstance(node, dict):
        if "target" in node:
            yield node
        for key in ("filesystems", "children"):
            children = node.get(key)
            if isinstance(children, list):
                for child in children:
                    yield from _findmnt_entries(child)
    elif isinstance(node, list):
        for child in node:
            yield from _findmnt_entries(child)


def _json_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,20}", value):  # "²" passes isdigit(), fails int()
        return int(value)
    return None


def parse_findmnt_json(text: str) -> list[Mount]:
    """Parse ``findmnt --json`` (flat or ``--tree`` with ``children``).

    ``source`` like ``/dev/mapper/vg-data[/kubelet]`` is split into the device and the bind-mounted
    ``root``.  IDs and device numbers are only set when findmnt was asked for them
    (``--output ID,PARENT,MAJ:MIN,...``).  Unparsable JSON gives ``[]``.
    """
    data, _notes = read_json(text)
    if data is None:
        return []
    mounts: list[Mount] = []
    for entry in _findmnt_entries(data):
        target = entry.get("target")
        if not isinstance(target, str):
            continue
        source = entry.get("source")
        root: str | None = None
        if isinstance(source, str):
            m = _BIND_SUFFIX_RE.match(source)
            if m:
                source, root = m.group("source"), m.group("root")
        else:
            source = None
        if root is None and isinstance(entry.get("fsroot"), str):
            root = entry["fsroot"]
        major_minor = entry.get("maj:min")
        mounts.append(
            Mount(
                mount_id=_json_int(entry.get("id")),
                parent_id=_json_int(entry.get("parent")),
                major_minor=major_minor if isinstance(major_minor, str) else None,
                root=root,
                mount_point=target,
                fstype=entry.get("fstype") if isinstance(entry.get("fstype"), str) else None,
                source=source,
                options=entry.get("options") if isinstance(entry.get("options"), str) else None,
            )
        )
    return mounts


#: File systems that are (or are usually) shared between hosts: a model stored there once is
#: visible to every node that mounts it.
SHARED_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "beegfs",
        "fhgfs",
        "gpfs",
        "cifs",
        "smb3",
        "smbfs",
        "cephfs",
        "ceph",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "9p",
        "fuse.juicefs",
        "juicefs",
        "wekafs",
        "fuse.weka",
        "ocfs2",
        "gfs2",
        "orangefs",
        "pvfs2",
        "afs",
        "panfs",
        "quobyte",
        "fuse.quobyte",
        "fuse.moosefs",
        "fuse.mfs",
        "fuse.lizardfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.goofys",
        "fuse.mountpoint-s3",
        "fuse.blobfuse",
        "fuse.blobfuse2",
        "fuse.alluxio-fuse",
        "dvs",
    }
)


def is_shared(fstype: str | None) -> bool:
    """Whether a file system type is a network / cluster file system."""
    if not fstype:
        return False
    return fstype.lower() in SHARED_FS_TYPES


def _is_under(path: str, mount_point: str) -> bool:
    if mount_point == "/":
        return path.startswith("/")
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def mount_for_path(mounts: Iterable[Mount], path: str) -> Mount | None:
    """The mount a path lives on: the longest mount point that is a prefix of it (on whole
    components).  When several mounts share that mount point the last one (the top of the stack)
    wins.  ``path`` is normalised but symlinks are not resolved here."""
    if not path:
        return None
    path = os.path.normpath(path)
    best: Mount | None = None
    for mount in mounts:
        if not _is_under(path, mount.mount_point):
            continue
        if best is None or len(mount.mount_point.rstrip("/")) >= len(best.mount_point.rstrip("/")):
            best = mount
    return best


@dataclass
class StoragePool:
    """One file system holding one or more model directories."""

    mount_point: str | None
    fstype: str | None
    shared: bool
    total_bytes: int | None
    free_bytes: int | None
    directories: list[str] = field(default_factory=list)
    source: str | None = None


def storage_pools(
    dirs: list[str],
    mounts: list[Mount],
    statvfs: Callable[[str], Any] = os.statvfs,
) -> list[StoragePool]:
    """Group model directories by the file system they live on.

    Directories that do not exist (a filer that is not mounted) are skipped.  Directories on the
    same device (``major:minor``, else the same mount point) share a pool.  Sizes come from
    ``statvfs``: total ``f_blocks * f_frsize``, free ``f_bavail * f_frsize`` (what an unprivileged
    writer can use); they stay None if statvfs fails for every directory of the pool.
    """
    pools: dict[str, StoragePool] = {}
    for directory in dirs:
        if not directory or not os.path.isdir(directory):
            continue
        resolved = os.path.realpath(directory)
        mount = mount_for_path(mounts, resolved)
        if mount is not None:
            key = f"dev:{mount.major_minor}" if mount.major_minor else f"mnt:{mount.mount_point}"
        else:
            key = f"dir:{resolved}"
        pool = pools.get(key)
        if pool is None:
            fstype = mount.fstype if mount else None
            pool = StoragePool(
                mount_point=mount.mount_point if mount else None,
                fstype=fstype,
                shared=is_shared(fstype),
                total_bytes=None,
                free_bytes=None,
                source=mount.source if mount else None,
            )
            pools[key] = pool
        if directory not in pool.directories:
            pool.directories.append(directory)
        if pool.total_bytes is None:
            try:
                st = statvfs(directory)
                pool.total_bytes = int(st.f_blocks) * int(st.f_frsize)
                pool.free_bytes = int(st.f_bavail) * int(st.f_frsize)
            except (OSError, AttributeError, TypeError, ValueError):
                pass
    return list(pools.values())


#: Suffixes of files that are still being downloaded.
PARTIAL_SUFFIXES = (".part", ".partial", ".tmp", ".download", ".incomplete", ".aria2", ".crdownload")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
_SPLIT_GGUF_RE = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
_MAX_WALK_ENTRIES = 10000


def _is_partial(name: str) -> bool:
    lowered = name.lower()
    return lowered.endswith(PARTIAL_SUFFIXES) or lowered.startswith(".~lock")


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size  # follows symlinks (Hugging Face snapshots link into blobs/)
    except OSError:
        return None


def _reads_as_gguf(path: str) -> bool:
    """A GGUF file that is whole: it starts with the magic (a file of another kind, or zeros where
    a download was preallocated, is not weights) and is at least as long as its own header says
    its tensors reach (a copy or download cut short is not weights either)."""
    size = _size(path)
    if size is None:
        return False
    try:
        expected = _gguf_expected_size(path, size)
    except (OSError, ValueError, struct.error):
        return False
    return expected is None or size >= expected


# ggml tensor types: (elements per block, bytes per block), as in ggml.h / gguf-py's GGML_QUANT_SIZES.
GGML_TYPE_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4),
    1: (1, 2),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    9: (32, 40),
    10: (256, 84),
    11: (256, 110),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
    15: (256, 292),
    16: (256, 66),
    17: (256, 74),
    18: (256, 98),
    19: (256, 50),
    20: (32, 18),
    21: (256, 110),
    22: (256, 82),
    23: (256, 136),
    24: (1, 1),
    25: (1, 2),
    26: (1, 4),
    27: (1, 8),
    28: (1, 8),
    29: (256, 56),
    30: (1, 2),
    34: (256, 54),
    35: (256, 66),
    39: (32, 17),
    40: (64, 36),
    41: (128, 18),
}
# GGUF metadata value types of a fixed size (bytes); 8 is a string, 9 an array.
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_LIMIT = 1 << 24  # more tensors, keys or array items than this is not a file to trust
_WHOLE_CACHE: dict[tuple[str, int, int], int | None] = {}


def _gguf_expected_size(path: str, size: int) -> int | None:
    """The length a GGUF file must have for its last tensor to be there, from its header; None when
    this reader cannot tell (a version or tensor type it does not know). ValueError when the header
    itself does not read (not GGUF, or cut short within it). Kept per (path, size, mtime): a
    vocabulary of 262,144 strings is read once, not at every sample."""
    stat = os.stat(path)
    key = (path, size, stat.st_mtime_ns)
    if key in _WHOLE_CACHE:
        return _WHOLE_CACHE[key]
    with open(path, "rb") as handle:
        expected = _read_gguf_header(handle, size)
    if len(_WHOLE_CACHE) > 1024:
        _WHOLE_CACHE.clear()
    _WHOLE_CACHE[key] = expected
    return expected


def _read_gguf_header(handle: Any, size: int) -> int | None:
    def take(count: int) -> bytes:
        data: bytes = handle.read(count)
        if len(data) != count:
            raise ValueError("the header is cut short")
        return data

    def u32() -> int:
        return int(struct.unpack("<I", take(4))[0])

    def u64() -> int:
        return int(struct.unpack("<Q", take(8))[0])

    def skip(count: int) -> None:
        if count < 0 or handle.tell() + count > size:
            raise ValueError("the header is cut short")
        handle.seek(count, os.SEEK_CUR)

    def string() -> bytes:
        length = u64()
        if length > size:
            raise ValueError("a string longer than the file")
        return take(length)

    if take(4) != b"GGUF":
        raise ValueError("not a GGUF file")
    version = u32()
    if version not in (2, 3):
        return None
    tensors, keys = u64(), u64()
    if tensors > _GGUF_LIMIT or keys > _GGUF_LIMIT:
        raise ValueError("implausible counts")
    alignment = 32
    for _ in range(keys):
        name = string()
        kind = u32()
        if kind == 4 and name == b"general.alignment":
            alignment = u32() or 32
        elif kind in _GGUF_FIXED:
            skip(_GGUF_FIXED[kind])
        elif kind == 8:
            skip(u64())
        elif kind == 9:
            item, count = u32(), u64()
            if count > _GGUF_LIMIT:
                raise ValueError("implausible array")
            if item in _GGUF_FIXED:
                skip(_GGUF_FIXED[item] * count)
            elif item == 8:
                for _ in range(count):
                    skip(u64())
            else:
                return None  # arrays of arrays: not written by llama.cpp's tools
        else:
            raise ValueError(f"unknown metadata type {kind}")
    end = 0
    for _ in range(tensors):
        string()
        dims = u32()
        if dims > 8:
            raise ValueError("implausible tensor shape")
        elements = 1
        for _ in range(dims):
            elements *= u64()
        kind, offset = u32(), u64()
        block = GGML_TYPE_SIZES.get(kind)
        if block is None:
            return None
        end = max(end, offset + elements // block[0] * block[1])
    start: int = handle.tell()
    start += -start % alignment
    return start + end


def _whole_safetensors(path: str) -> bool:
    """A safetensors file at least as long as its header says its tensors reach."""
    size = _size(path)
    if size is None or size < 8:
        return False
    try:
        with open(path, "rb") as handle:
            length = int(struct.unpack("<Q", handle.read(8))[0])
            if length > min(size - 8, 100 * 1024 * 1024):
                return False
            header, _notes = read_json(handle.read(length).decode("utf-8", "replace"))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, struct.error):
        return False
    return all(isinstance(e, int) for e in ends) and size >= 8 + length + max(ends, default=0)


def _complete_gguf(directory: str, name: str, names: set[str]) -> bool:
    if any(name + suffix in names for suffix in PARTIAL_SUFFIXES):
        return False
    if not (_size(os.path.join(directory, name)) or 0) > 0 or not _reads_as_gguf(os.path.join(directory, name)):
        return False
    split = _SPLIT_GGUF_RE.match(name)
    if split:
        count = int(split.group("count"))
        if int(split.group("part")) != 1:
            return False  # the first shard stands for the whole model
        for part in range(2, count + 1):
            shard = f"{split.group('stem')}-{part:05d}-of-{split.group('count')}.gguf"
            if shard not in names or not (_size(os.path.join(directory, shard)) or 0) > 0:
                return False
            if any(shard + suffix in names for suffix in PARTIAL_SUFFIXES):
                return False
            if not _reads_as_gguf(os.path.join(directory, shard)):
                return False
    return True


class _Budget:
    """Directory entries a scan may still look at; once spent, the scan stops and says so."""

    __slots__ = ("left", "spent")

    def __init__(self, entries: int) -> None:
        self.left = entries
        self.spent = False

    def take(self, count: int) -> bool:
        self.left -= count
        if self.left < 0:
            self.spent = True
        return not self.spent


def _complete_model_dir(path: str, budget: _Budget | None = None) -> bool:
    """config.json + at least one non-empty weight file, no partial download anywhere below,
    and every shard a ``*.safetensors.index.json`` names present. Each entry walked is taken from
    `budget` (when given); a directory the budget ran out in is not complete."""
    try:
        top = os.listdir(path)
    except OSError:
        return False
    if "config.json" not in top:
        return False
    has_weights = False
    seen = 0
    for current, dirnames, filenames in os.walk(path):
        dirnames.sort()
        if budget is not None and not budget.take(len(dirnames) + len(filenames)):
            return False
        for filename in filenames:
            seen += 1
            if seen > _MAX_WALK_ENTRIES:
                return has_weights
            if _is_partial(filename):
                return False
            full = os.path.join(current, filename)
            lowered = filename.lower()
            if lowered.endswith(".safetensors") and not _whole_safetensors(full):
                return False  # cut short: the engine would fail on it
            if lowered.endswith(".gguf") and not _reads_as_gguf(full):
                return False
            if lowered.endswith(_WEIGHT_SUFFIXES) and (_size(full) or 0) > 0:
                has_weights = True
    if not has_weights:
        return False
    for name in top:
        if not name.endswith(".index.json"):
            continue
        try:
            with open(os.path.join(path, name), encoding="utf-8") as handle:
                weight_map = json.load(handle).get("weight_map", {})
        except (OSError, ValueError, AttributeError):
            return False
        if not isinstance(weight_map, dict):
            return False
        for shard in set(weight_map.values()):
            if not isinstance(shard, str) or not (_size(os.path.join(path, shard)) or 0) > 0:
                return False
    return True


def _tree_size(path: str) -> int:
    """The bytes of the files under a model directory (at most _MAX_WALK_ENTRIES of them)."""
    size = seen = 0
    for current, _dirs, files in os.walk(path):
        for name in files:
            seen += 1
            if seen > _MAX_WALK_ENTRIES:
                return size
            size += _size(os.path.join(current, name)) or 0
    return size


def weights_held(directory: str, scan: WeightsScan | None = None) -> list[HeldSource]:
    """The complete entries of a model directory as sources: each one's absolute path (what a
    model's `source` names) and its size in bytes (all shards or files of it together). `scan`:
    the directory's `scan_weights()`, when already taken."""
    held: list[HeldSource] = []
    for name in (scan or scan_weights(directory)).entries:
        path = os.path.join(directory, name)
        if os.path.isdir(path):
            size = _tree_size(path)
        else:
            split = _SPLIT_GGUF_RE.match(os.path.basename(name))
            if split:
                count = int(split.group("count"))
                folder = os.path.dirname(path)
                size = sum(
                    _size(os.path.join(folder, f"{split.group('stem')}-{part:05d}-of-{split.group('count')}.gguf")) or 0
                    for part in range(1, count + 1)
                )
            else:
                size = _size(path) or 0
        held.append({"path": path, "bytes": size})
    return held


#: How far below a model directory weights are looked for: the mirror writes
#: <dir>/mirror/<owner>--<name>/<commit>/<file>, a Hugging Face cache
#: models--<owner>--<name>/snapshots/<commit>/, and a repository may keep files in folders.
MAX_SCAN_DEPTH = 8
#: Directory entries one model directory's scan looks at in all (files and folders, those of
#: complete model folders included): a huge tree costs this much per sample, not more.
MAX_SCAN_ENTRIES = 20000


_Queues = tuple[deque[tuple[str, int]], deque[tuple[str, int]]]  # folders to read: real, then symlinked


@dataclass
class WeightsScan:
    """What one model directory holds whole (names relative to it, sorted), and whether the scan
    saw all of it: False when it stopped at MAX_SCAN_DEPTH or MAX_SCAN_ENTRIES, so that a source
    not among the entries may still be there (unknown, not absent)."""

    entries: list[str]
    complete: bool = True
    stopped: str | None = None  # why it is not complete, in words


def _scan_folder(
    directory: str, relative: str, depth: int, budget: _Budget, scan: WeightsScan, queues: _Queues
) -> None:
    """One folder of a scan: its whole GGUF files and model folders become entries; other folders
    are queued to be looked into (unless past the depth bound), a symlinked one after every real one."""
    folder = os.path.join(directory, relative) if relative else directory
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    if not budget.take(len(names)):
        return
    name_set = set(names)
    for name in names:
        if name.startswith(".") or _is_partial(name):
            continue
        path = os.path.join(folder, name)
        entry = os.path.join(relative, name) if relative else name
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "config.json")) and _complete_model_dir(path, budget):
                scan.entries.append(entry)
            elif budget.spent:
                return
            elif depth + 1 > MAX_SCAN_DEPTH:
                scan.complete = False
                scan.stopped = f"folders more than {MAX_SCAN_DEPTH} deep are not looked into ({path})"
            else:
                (queues[1] if os.path.islink(path) else queues[0]).append((entry, depth + 1))
        elif name.lower().endswith(".gguf") and os.path.isfile(path) and _complete_gguf(folder, name, name_set):
            scan.entries.append(entry)


def scan_weights(directory: str) -> WeightsScan:
    """The complete model entries anywhere below ``directory`` (to MAX_SCAN_DEPTH folders down,
    MAX_SCAN_ENTRIES entries looked at), by their path relative to it, sorted.

    An entry is a non-empty whole ``*.gguf`` file with no partial-download sibling (for split
    GGUFs ``x-00001-of-0000N.gguf``: the first shard, once all N are there), or a folder holding
    ``config.json`` plus at least one non-empty ``*.safetensors``/``*.bin``/``*.gguf`` and no
    partial files (not looked into further). Hidden folders and files are skipped, and a folder
    reached twice (by a symlink) is read once. A missing or unreadable directory gives no entries.
    """
    scan = WeightsScan(entries=[])
    budget = _Budget(MAX_SCAN_ENTRIES)
    # Breadth first, the shallow entries before the deep; a folder reached by a symlink is read after
    # every real one, so a tree is named by its own path where the scan can reach it by both.
    queues: _Queues = (deque([("", 0)]), deque())
    seen: set[str] = set()
    while queues[0] or queues[1]:
        relative, depth = (queues[0] or queues[1]).popleft()
        real = os.path.realpath(os.path.join(directory, relative) if relative else directory)
        if real in seen:
            continue
        seen.add(real)
        _scan_folder(directory, relative, depth, budget, scan, queues)
        if budget.spent:
            scan.complete = False
            scan.stopped = f"more than {MAX_SCAN_ENTRIES} entries; the rest are not looked at"
            break
    scan.entries.sort()
    return scan


def weights_present(directory: str) -> list[str]:
    """Names (relative to ``directory``) of complete model entries below it, sorted: see
    :func:`scan_weights`. A missing or unreadable directory gives ``[]``."""
    return scan_weights(directory).entries
