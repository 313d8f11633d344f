"""An archive unpacked into an empty staging directory, refusing any member that would leave it
and anything past what an archive of its kind may unpack to.

:func:`extract` reads every member's header first and refuses the whole archive
(:class:`UnsafeArchive`) before writing anything when one member is unsafe: an absolute path or a
``..`` component, a symlink that points outside the tree, any hard link, device, FIFO or sparse
file, a member below a symlink, a name given twice, or more members or bytes than its
:class:`Limits` allow.  A tar's sizes are judged header by header as they are read, so a member
declaring 10 GiB is refused before the reader skips over its data.  Only regular files,
directories and relative in-tree symlinks (llama.cpp's ``libfoo.so -> libfoo.so.0`` chains) are
written, all by this module for both formats: a file's bytes are counted as they come out of the
decompressor (agent.bounded.copy) and the extraction stops at the first chunk past what the member
declares or what the archive may hold, since headers can lie.

What an archive may unpack to depends on its kind:

- an engine release (:data:`ENGINE_RELEASE`, llama.cpp's archives and their CUDA runtime): 2 GiB
  and 2,000 members.  Measured here: the real llama-server (``shared/bin``, statically linked
  against llama and ggml) is 12.5 MB and the libraries it links 5.4 MB (``du -sb``); the
  release listing gives 16.9 MB packed for b11070's CPU archive, and 410-594 MB packed for the
  CUDA runtime archive, the largest asset.  Shared objects of that kind seldom deflate below
  half their size, so the largest build unpacks to about a gigabyte: 2 GiB is twice that, and
  2,000 members far more than the tools and libraries a release holds.  A 15.5 MB archive
  holding a real llama-server and 10 GiB of zeros is refused at the zeros' header;
- uv's release archive (:data:`UV_RELEASE`): 256 MiB and 100 members (its root directory holds
  ``uv`` and ``uvx``, tens of megabytes);
- a source distribution to compile llama.cpp from (:data:`SOURCE`): 2 GiB and 50,000 members.

And on every node, whatever the kind: unpacking must leave ``reserve`` bytes free
(:data:`RESERVE_BYTES`, 2 GiB, so that logs, state and model downloads go on).  The declared sizes
are checked against the free space before anything is written, and the bytes written against it
as they are written.

Modes are normalised the same way for both formats: setuid, setgid, sticky and group/other write
bits are dropped, the owner can always read and write, and exec bits are kept.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

from agent import bounded
from agent.bounded import size_text

__all__ = [
    "DEFAULT_LIMITS",
    "ENGINE_RELEASE",
    "RESERVE_BYTES",
    "SOURCE",
    "UV_RELEASE",
    "Limits",
    "NoRoom",
    "UnsafeArchive",
    "archive_format",
    "extract",
]

# Corrupt compressed data surfaces as the codec's own error rather than a tarfile/zipfile one.
_DECOMPRESS_ERRORS: tuple[type[Exception], ...] = (zlib.error, gzip.BadGzipFile)
try:
    import lzma
except ImportError:  # pragma: no cover - a Python built without liblzma
    pass
else:
    _DECOMPRESS_ERRORS += (lzma.LZMAError,)
_CORRUPT_MEMBER_ERRORS: tuple[type[Exception], ...] = (
    zipfile.BadZipFile,
    EOFError,
    ValueError,
    NotImplementedError,  # a compression method this Python lacks
    *_DECOMPRESS_ERRORS,
)
_CORRUPT_ARCHIVE_ERRORS: tuple[type[Exception], ...] = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    *_DECOMPRESS_ERRORS,
)

_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
_ZIP_SUFFIXES = (".zip",)

#: Longest symlink target read from a zip entry (Linux allows 4095 bytes).
_MAX_LINK_TARGET = 4096
#: Symlinks followed when checking where one symlink leads (the kernel's own limit is 40).
_MAX_LINK_HOPS = 40

_FILE, _DIR, _SYMLINK = "file", "directory", "symlink"


class UnsafeArchive(Exception):
    """An archive that was not extracted; ``str()`` names the member and why.

    Also raised for an archive that cannot be read (corrupt or truncated data)."""


class NoRoom(UnsafeArchive):
    """An archive that was not extracted because the disk cannot take it and keep its reserve:
    the node's condition, not a fault of the archive."""


@dataclass(frozen=True)
class Limits:
    """What one archive of a kind may hold before it is refused (the defaults: an engine release's)."""

    max_members: int = 2_000
    #: The sum of the members' uncompressed sizes.
    max_total_bytes: int = 2 * 2**30
    max_member_bytes: int = 2 * 2**30
    #: The kind, as refusals name it.
    kind: str = "an engine release archive"


ENGINE_RELEASE = Limits()
UV_RELEASE = Limits(max_members=100, max_total_bytes=256 * 2**20, max_member_bytes=256 * 2**20, kind="uv's archive")
SOURCE = Limits(max_members=50_000, max_total_bytes=2 * 2**30, max_member_bytes=2**30, kind="a source distribution")
DEFAULT_LIMITS = ENGINE_RELEASE
#: What unpacking must leave free on the node's disk.
RESERVE_BYTES = 2 * 2**30


def archive_format(name: str) -> str:
    """``"tar"`` or ``"zip"``, from the extension of an archive's file name.

    Tar covers what ``tarfile`` reads on every supported Python: ``.tar``, ``.tar.gz``/``.tgz``,
    ``.tar.xz``/``.txz`` and ``.tar.bz2``/``.tbz2``.  Anything else is a ValueError naming the
    extension."""
    lower = name.lower()
    if lower.endswith(_ZIP_SUFFIXES):
        return "zip"
    if lower.endswith(_TAR_SUFFIXES):
        return "tar"
    suffixes = PurePosixPath(lower).suffixes
    if len(suffixes) >= 2 and suffixes[-2] == ".tar":
        extension = "".join(suffixes[-2:])
    else:
        extension = suffixes[-1] if suffixes else ""
    shown = f"extension {extension!r}" if extension else "no extension"
    raise ValueError(f"{name} has {shown}: not a supported archive (.tar.gz, .tgz, .tar.xz, .tar.bz2, .tar, .zip)")


@dataclass(frozen=True)
class _Entry:
    """One member as planned for extraction."""

    #: The normalised relative POSIX path (no ``.`` components, no trailing slash).
    name: str
    kind: str
    size: int
    mode: int
    target: str = ""
    tar_info: tarfile.TarInfo | None = None
    zip_info: zipfile.ZipInfo | None = None


def _normalise(raw: str, *, zip_member: bool) -> str:
    """The member's relative path, or UnsafeArchive when it is absolute or climbs out."""
    if "\x00" in raw:
        raise UnsafeArchive(f"member {raw!r} has a NUL byte in its name: refused")
    name = raw
    if "\\" in name:
        if not zip_member:
            raise UnsafeArchive(f"member {raw} has a backslash in its name: refused")
        # Zips written by some Windows tools use backslashes as separators.
        name = name.replace("\\", "/")
    if name.startswith("/") or (len(name) >= 2 and name[1] == ":" and name[0].isalpha()):
        raise UnsafeArchive(f"member {raw} is an absolute path, outside the install directory")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchive(f"member {raw} leaves the install directory")
    return "/".join(parts)


def _link_escape(entry: _Entry, symlinks: dict[str, str]) -> str | None:
    """Why ``entry``'s symlink target leaves the tree, or None when it stays inside.

    The target is walked from the link's own directory, following the archive's other symlinks
    (keys casefolded, so the check also holds on case-insensitive file systems)."""
    target = entry.target
    if not target:
        return "has an empty target"
    if "\x00" in target or "\\" in target:
        return f"has a target with a NUL or backslash ({target!r})"
    if target.startswith("/"):
        return f"is a symlink to {target}, outside the install directory"
    stack = entry.name.split("/")[:-1]
    queue = deque(target.split("/"))
    hops = 0
    while queue:
        part = queue.popleft()
        if part in ("", "."):
            continue
        if part == "..":
            if not stack:
                return f"is a symlink to {target}, outside the install directory"
            stack.pop()
            continue
        stack.append(part)
        link = symlinks.get("/".join(stack).casefold())
        if link is None:
            continue
        hops += 1
        if hops > _MAX_LINK_HOPS or link.startswith("/"):
            return f"is a symlink to {target}, which loops or leads outside the install directory"
        stack.pop()
        queue.extendleft(reversed(link.split("/")))
    return None


def _check_plan(entries: list[_Entry]) -> None:
    """The checks that need the whole member list: names, tree shape and links (sizes and counts
    were judged header by header, _Budget.count)."""
    kinds: dict[str, str] = {}
    for entry in entries:
        previous = kinds.get(entry.name)
        if previous is not None and not (previous == _DIR and entry.kind == _DIR):
            raise UnsafeArchive(f"member {entry.name} appears twice: refused")
        kinds[entry.name] = entry.kind
    folded = {name.casefold(): kind for name, kind in kinds.items()}
    for entry in entries:
        parts = entry.name.split("/")
        for depth in range(1, len(parts)):
            ancestor = "/".join(parts[:depth])
            kind = folded.get(ancestor.casefold())
            if kind == _SYMLINK:
                raise UnsafeArchive(f"member {entry.name} is under {ancestor}, which is a symlink: refused")
            if kind == _FILE:
                raise UnsafeArchive(f"member {entry.name} is under {ancestor}, which is a file: refused")
    symlinks = {entry.name.casefold(): entry.target for entry in entries if entry.kind == _SYMLINK}
    for entry in entries:
        if entry.kind == _SYMLINK:
            why = _link_escape(entry, symlinks)
            if why is not None:
                raise UnsafeArchive(f"member {entry.name} {why}")


@dataclass
class _Budget:
    """What one extraction may still write: its kind's limits, and the disk's free space less the
    reserve (measured once, before the first header is read)."""

    limits: Limits
    where: Path
    free: int
    reserve: int
    members: int = 0
    declared: int = 0
    written: int = 0

    @classmethod
    def measure(cls, staging: Path, limits: Limits, reserve: int) -> _Budget:
        where = staging.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        return cls(limits, where, shutil.disk_usage(where).free, reserve)

    def count(self, name: str, size: int) -> None:
        """One more member, declaring ``size`` bytes: refused at once past the kind's member count,
        its size per member or in all, or what the disk can spare."""
        limits = self.limits
        self.members += 1
        if self.members > limits.max_members:
            raise UnsafeArchive(
                f"at least {self.members:,} members: more than the limit of {limits.max_members:,} for {limits.kind}"
            )
        if size > limits.max_member_bytes:
            raise UnsafeArchive(
                f"member {name} declares {size:,} bytes: more than the limit of "
                f"{size_text(limits.max_member_bytes)} per member of {limits.kind}"
            )
        self.declared += size
        if self.declared > limits.max_total_bytes:
            raise UnsafeArchive(
                f"the members declare at least {self.declared:,} bytes in all: more than the limit of "
                f"{size_text(limits.max_total_bytes)} for {limits.kind}"
            )
        if self.declared > self.free - self.reserve:
            raise self._disk("the members declare at least", self.declared)

    def copy(self, entry: _Entry, source: IO[bytes], write: Callable[[bytes], object]) -> int:
        """Copy one file's bytes, counted as they come out of the decompressor: refused at the first
        chunk past what the member declares or what the archive may still write."""
        room = min(self.limits.max_total_bytes, self.free - self.reserve) - self.written
        try:
            count = bounded.copy(source, write, limit=max(0, min(entry.size, room)), what=f"member {entry.name}")
        except bounded.TooLarge:
            if entry.size <= room:
                raise UnsafeArchive(f"member {entry.name} inflates past the {entry.size:,} bytes it declares") from None
            if self.written + room >= self.limits.max_total_bytes:
                raise UnsafeArchive(
                    f"the members hold more than the limit of {size_text(self.limits.max_total_bytes)} "
                    f"for {self.limits.kind}"
                ) from None
            raise self._disk("the members hold more than", self.written + room) from None
        self.written += count
        return count

    def _disk(self, said: str, amount: int) -> UnsafeArchive:
        return NoRoom(
            f"{said} {amount:,} bytes and {self.where} has {self.free:,} bytes free: unpacking would leave "
            f"less than the {size_text(self.reserve)} this node keeps free"
        )


def _file_mode(mode: int) -> int:
    return (mode & 0o755) | 0o600


def _dir_mode(mode: int) -> int:
    return (mode & 0o755) | 0o700


# --------------------------------------------------------------------------- tar


def _tar_kind(info: tarfile.TarInfo, name: str) -> str:
    if info.issparse():
        raise UnsafeArchive(f"member {name} is a sparse file: refused")
    if info.isreg():
        return _FILE
    if info.isdir():
        return _DIR
    if info.issym():
        return _SYMLINK
    if info.islnk():
        raise UnsafeArchive(f"member {name} is a hard link to {info.linkname}: refused")
    if info.ischr():
        raise UnsafeArchive(f"member {name} is a character device: refused")
    if info.isblk():
        raise UnsafeArchive(f"member {name} is a block device: refused")
    if info.isfifo():
        raise UnsafeArchive(f"member {name} is a FIFO: refused")
    raise UnsafeArchive(f"member {name} has the unsupported tar type {info.type!r}: refused")


def _scan_tar(tar: tarfile.TarFile, budget: _Budget) -> list[_Entry]:
    """Every member's header, each judged as it is read: an unsafe or too large member is refused
    before the reader skips over its data (a gzip stream is skipped by inflating it)."""
    entries: list[_Entry] = []
    for info in tar:
        name = _normalise(info.name, zip_member=False)
        kind = _tar_kind(info, name or info.name)
        budget.count(name or info.name, info.size if kind == _FILE else 0)
        if not name:
            if kind != _DIR:
                raise UnsafeArchive(f"member {info.name} names the install directory itself: refused")
            continue  # "./": the top directory, which is the staging directory
        if kind == _SYMLINK and "\\" in info.linkname:
            raise UnsafeArchive(f"member {name} has a backslash in its symlink target: refused")
        entries.append(
            _Entry(
                name=name,
                kind=kind,
                size=info.size if kind == _FILE else 0,
                mode=info.mode,
                target=info.linkname if kind == _SYMLINK else "",
                tar_info=info,
            )
        )
    return entries


def _tar_member(tar: tarfile.TarFile) -> Callable[[_Entry], IO[bytes]]:
    def open_member(entry: _Entry) -> IO[bytes]:
        assert entry.tar_info is not None
        source = tar.extractfile(entry.tar_info)
        if source is None:
            raise UnsafeArchive(f"member {entry.name} has no data to read")
        return source

    return open_member


# --------------------------------------------------------------------------- zip


def _zip_unix_mode(info: zipfile.ZipInfo) -> int:
    return (info.external_attr >> 16) & 0xFFFF


def _zip_kind(info: zipfile.ZipInfo, mode: int) -> str:
    file_type = stat.S_IFMT(mode)
    if info.flag_bits & 0x1:
        raise UnsafeArchive(f"member {info.filename} is encrypted: refused")
    if stat.S_ISLNK(mode):
        return _SYMLINK
    if info.is_dir() or stat.S_ISDIR(mode):
        return _DIR  # S_ISDIR: a directory entry written without its trailing slash
    if file_type in (0, stat.S_IFREG):
        return _FILE
    what = {
        stat.S_IFCHR: "a character device",
        stat.S_IFBLK: "a block device",
        stat.S_IFIFO: "a FIFO",
        stat.S_IFSOCK: "a socket",
    }.get(file_type, f"of unsupported type {file_type:#o}")
    raise UnsafeArchive(f"member {info.filename} is {what}: refused")


def _scan_zip(archive: zipfile.ZipFile, budget: _Budget) -> list[_Entry]:
    entries: list[_Entry] = []
    for info in archive.infolist():
        name = _normalise(info.filename, zip_member=True)
        mode = _zip_unix_mode(info)
        kind = _zip_kind(info, mode)
        budget.count(name or info.filename, info.file_size if kind == _FILE else 0)
        if not name:
            if kind != _DIR:
                raise UnsafeArchive(f"member {info.filename} names the install directory itself: refused")
            continue
        target = ""
        if kind == _SYMLINK:
            target = _zip_link_target(archive, info, name)
        entries.append(
            _Entry(
                name=name,
                kind=kind,
                size=info.file_size if kind == _FILE else 0,
                mode=(mode & 0o7777) or (0o755 if kind == _DIR else 0o644),
                target=target,
                zip_info=info,
            )
        )
    return entries


def _zip_link_target(archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> str:
    """A zip symlink's target: the entry's content, read with a bound since sizes can lie."""
    if info.file_size > _MAX_LINK_TARGET:
        raise UnsafeArchive(f"member {name} is a symlink with a {info.file_size:,}-byte target: refused")
    try:
        with archive.open(info) as stream:
            data = stream.read(_MAX_LINK_TARGET + 1)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise UnsafeArchive(f"member {name} cannot be read: {exc}") from exc
    if len(data) > _MAX_LINK_TARGET:
        raise UnsafeArchive(f"member {name} is a symlink with an over-long target: refused")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeArchive(f"member {name} is a symlink whose target is not UTF-8: refused") from exc


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_BINARY = getattr(os, "O_BINARY", 0)


# --------------------------------------------------------------------------- both


def _write_tree(
    entries: list[_Entry], staging: Path, budget: _Budget, open_member: Callable[[_Entry], IO[bytes]]
) -> list[str]:
    """Write the checked members under ``staging``: directories, in-tree symlinks, and files whose
    bytes are counted as they are written (_Budget.copy)."""
    written: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            continue  # a directory given twice
        seen.add(entry.name)
        path = staging / entry.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry.kind == _DIR:
            path.mkdir(exist_ok=True)
            os.chmod(path, _dir_mode(entry.mode))
        elif entry.kind == _SYMLINK:
            os.symlink(entry.target, path)
        else:
            _write_file(entry, path, budget, open_member)
        written.append(entry.name)
    return written


def _write_file(entry: _Entry, path: Path, budget: _Budget, open_member: Callable[[_Entry], IO[bytes]]) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY
    fd = os.open(path, flags, 0o600)

    def write(chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]

    try:
        with open_member(entry) as source:
            count = budget.copy(entry, source, write)
    except _CORRUPT_MEMBER_ERRORS as exc:
        raise UnsafeArchive(f"member {entry.name} cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    os.chmod(path, _file_mode(entry.mode))
    if count != entry.size:
        raise UnsafeArchive(f"member {entry.name} holds {count:,} bytes, not the {entry.size:,} it declares")


@contextlib.contextmanager
def _opened(archive: Path, kind: str, budget: _Budget) -> Iterator[tuple[list[_Entry], Callable[[_Entry], IO[bytes]]]]:
    """The archive's checked members and how to read one of them, while the archive is open."""
    if kind == "tar":
        with tarfile.open(archive, "r:*") as tar:
            entries = _scan_tar(tar, budget)
            _check_plan(entries)
            yield entries, _tar_member(tar)
        return
    with zipfile.ZipFile(archive) as zipped:
        entries = _scan_zip(zipped, budget)
        _check_plan(entries)

        def open_member(entry: _Entry) -> IO[bytes]:
            assert entry.zip_info is not None
            return zipped.open(entry.zip_info)

        yield entries, open_member


def _check_staging(staging: Path) -> bool:
    """Whether ``staging`` has to be created; ValueError unless it is absent or an empty directory."""
    if staging.is_symlink():
        raise ValueError(f"staging directory {staging} is a symlink")
    if not staging.exists():
        return True
    if not staging.is_dir():
        raise ValueError(f"staging directory {staging} exists and is not a directory")
    if any(staging.iterdir()):
        raise ValueError(f"staging directory {staging} is not empty")
    return False


def _empty(staging: Path, *, remove: bool) -> None:
    """Undo a partial extraction: remove what was written (never following symlinks)."""
    if remove:
        shutil.rmtree(staging, ignore_errors=True)
        return
    for child in staging.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def extract(
    archive: Path, staging: Path, *, limits: Limits = DEFAULT_LIMITS, reserve: int = RESERVE_BYTES
) -> list[str]:
    """Unpack ``archive`` (format from its name, see :func:`archive_format`) into ``staging``.

    ``staging`` must be absent or an empty directory (else ValueError); it is created with mode
    0o755.  Every member is checked before anything is written, and one unsafe member refuses
    the whole archive with :class:`UnsafeArchive`, as do more members or bytes than ``limits``
    (the archive's kind) allow, or more bytes than the disk holding ``staging`` can take while
    keeping ``reserve`` bytes free.  While writing, a member that turns out larger than it
    declared, or a total past either bound, stops the extraction at that chunk.  On any failure
    ``staging`` is left as it was given (absent or empty).

    Returns the extracted members' names, normalised (``./`` prefixes and trailing slashes
    dropped), in archive order.
    """
    kind = archive_format(archive.name)
    create = _check_staging(staging)
    budget = _Budget.measure(staging, limits, reserve)
    try:
        with _opened(archive, kind, budget) as (entries, open_member):
            _make_staging(staging, create)
            try:
                return _write_tree(entries, staging, budget, open_member)
            except BaseException:
                _empty(staging, remove=create)
                raise
    except _CORRUPT_ARCHIVE_ERRORS as exc:
        raise UnsafeArchive(f"cannot read {archive.name}: {exc}") from exc


def _make_staging(staging: Path, create: bool) -> None:
    if create:
        staging.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    os.chmod(staging, 0o755)
