"""An archive unpacked into an empty staging directory, refusing any member that would leave it.

:func:`extract` reads every member's header first and refuses the whole archive
(:class:`UnsafeArchive`) before writing anything when one member is unsafe: an absolute path or a
``..`` component, a symlink that points outside the tree, any hard link, device or FIFO, a member
below a symlink, a name given twice, or more members or bytes than :class:`Limits` allows.  Only
regular files, directories and relative in-tree symlinks (llama.cpp's ``libfoo.so ->
libfoo.so.0`` chains) are written.  Tar members are then extracted with ``tarfile``'s ``"data"``
filter where the running Python has it (3.11.4+, 3.12); zip members are written here, counting the
bytes that actually come out of the decompressor, since a zip's declared sizes can lie.

Modes are normalised the same way for both formats: setuid, setgid, sticky and group/other write
bits are dropped, the owner can always read and write, and exec bits are kept.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO

__all__ = ["DEFAULT_LIMITS", "Limits", "UnsafeArchive", "archive_format", "extract"]

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
_COPY_CHUNK = 2**20

_FILE, _DIR, _SYMLINK = "file", "directory", "symlink"


class UnsafeArchive(Exception):
    """An archive that was not extracted; ``str()`` names the member and why.

    Also raised for an archive that cannot be read (corrupt or truncated data)."""


@dataclass(frozen=True)
class Limits:
    """What one archive may hold before it is refused as a decompression bomb."""

    max_members: int = 20_000
    #: The sum of the members' uncompressed sizes.
    max_total_bytes: int = 32 * 2**30
    max_member_bytes: int = 16 * 2**30


DEFAULT_LIMITS = Limits()


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


def _check_plan(entries: list[_Entry], limits: Limits) -> None:
    """The checks that need the whole member list: names, tree shape, links and sizes."""
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
    total = 0
    for entry in entries:
        if entry.size > limits.max_member_bytes:
            raise UnsafeArchive(
                f"member {entry.name} declares {entry.size:,} bytes: "
                f"more than the limit of {limits.max_member_bytes:,} per member"
            )
        total += entry.size
    if total > limits.max_total_bytes:
        raise UnsafeArchive(
            f"the members declare {total:,} bytes in all: more than the limit of {limits.max_total_bytes:,}"
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


def _scan_tar(tar: tarfile.TarFile, limits: Limits) -> list[_Entry]:
    entries: list[_Entry] = []
    count = 0
    for info in tar:
        count += 1
        if count > limits.max_members:
            raise UnsafeArchive(f"at least {count:,} members: more than the limit of {limits.max_members:,}")
        name = _normalise(info.name, zip_member=False)
        kind = _tar_kind(info, name or info.name)
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


def _extract_tar(tar: tarfile.TarFile, entries: list[_Entry], staging: Path, limits: Limits) -> list[str]:
    has_filter = hasattr(tarfile, "data_filter")
    written: list[str] = []
    seen: set[str] = set()
    total = 0
    for entry in entries:
        if entry.name in seen:
            continue  # a directory given twice
        seen.add(entry.name)
        info = entry.tar_info
        assert info is not None
        try:
            if has_filter:
                tar.extract(info, staging, set_attrs=False, filter="data")
            else:
                tar.extract(info, staging, set_attrs=False)
        except tarfile.FilterError as exc:
            raise UnsafeArchive(f"member {entry.name} refused by the extraction filter: {exc}") from exc
        path = staging / entry.name
        st = path.lstat()
        if entry.kind == _FILE:
            if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
                raise UnsafeArchive(
                    f"member {entry.name} wrote {st.st_size:,} bytes, not the {entry.size:,} it declares"
                )
            total += st.st_size
            if total > limits.max_total_bytes:
                raise UnsafeArchive(f"the members hold more than the limit of {limits.max_total_bytes:,} bytes in all")
            os.chmod(path, _file_mode(entry.mode))
        elif entry.kind == _DIR:
            os.chmod(path, _dir_mode(entry.mode))
        elif not stat.S_ISLNK(st.st_mode):
            raise UnsafeArchive(f"member {entry.name} was not written as a symlink")
        written.append(entry.name)
    return written


# --------------------------------------------------------------------------- zip


def _zip_unix_mode(info: zipfile.ZipInfo) -> int:
    return (info.external_attr >> 16) & 0xFFFF


def _scan_zip(archive: zipfile.ZipFile, limits: Limits) -> list[_Entry]:
    infos = archive.infolist()
    if len(infos) > limits.max_members:
        raise UnsafeArchive(f"{len(infos):,} members: more than the limit of {limits.max_members:,}")
    entries: list[_Entry] = []
    for info in infos:
        name = _normalise(info.filename, zip_member=True)
        mode = _zip_unix_mode(info)
        file_type = stat.S_IFMT(mode)
        if info.flag_bits & 0x1:
            raise UnsafeArchive(f"member {info.filename} is encrypted: refused")
        if stat.S_ISLNK(mode):
            kind = _SYMLINK
        elif info.is_dir():
            kind = _DIR
        elif stat.S_ISDIR(mode):
            kind = _DIR  # a directory entry written without its trailing slash
        elif file_type in (0, stat.S_IFREG):
            kind = _FILE
        else:
            what = {
                stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device",
                stat.S_IFIFO: "a FIFO",
                stat.S_IFSOCK: "a socket",
            }.get(file_type, f"of unsupported type {file_type:#o}")
            raise UnsafeArchive(f"member {info.filename} is {what}: refused")
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
                mode=mode & 0o7777,
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


def _copy_counted(source: IO[bytes], fd: int, entry: _Entry, written_before: int, limits: Limits) -> int:
    """Copy a zip member's decompressed bytes to ``fd``; stop as soon as a limit is passed."""
    count = 0
    while True:
        chunk = source.read(_COPY_CHUNK)
        if not chunk:
            return count
        count += len(chunk)
        if count > entry.size:
            raise UnsafeArchive(f"member {entry.name} inflates past the {entry.size:,} bytes it declares")
        if written_before + count > limits.max_total_bytes:
            raise UnsafeArchive(f"the members hold more than the limit of {limits.max_total_bytes:,} bytes in all")
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def _extract_zip(archive: zipfile.ZipFile, entries: list[_Entry], staging: Path, limits: Limits) -> list[str]:
    written: list[str] = []
    seen: set[str] = set()
    total = 0
    for entry in entries:
        if entry.name in seen:
            continue  # a directory given twice
        seen.add(entry.name)
        info = entry.zip_info
        assert info is not None
        path = staging / entry.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if entry.kind == _DIR:
            path.mkdir(exist_ok=True)
            os.chmod(path, _dir_mode(entry.mode or 0o755))
        elif entry.kind == _SYMLINK:
            os.symlink(entry.target, path)
        else:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_BINARY
            fd = os.open(path, flags, 0o600)
            try:
                with archive.open(info) as source:
                    count = _copy_counted(source, fd, entry, total, limits)
            except _CORRUPT_MEMBER_ERRORS as exc:
                raise UnsafeArchive(f"member {entry.name} cannot be read: {exc}") from exc
            finally:
                os.close(fd)
            os.chmod(path, _file_mode(entry.mode or 0o644))
            if count != entry.size:
                raise UnsafeArchive(f"member {entry.name} holds {count:,} bytes, not the {entry.size:,} it declares")
            total += count
        written.append(entry.name)
    return written


# --------------------------------------------------------------------------- both


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


def extract(archive: Path, staging: Path, *, limits: Limits = DEFAULT_LIMITS) -> list[str]:
    """Unpack ``archive`` (format from its name, see :func:`archive_format`) into ``staging``.

    ``staging`` must be absent or an empty directory (else ValueError); it is created with mode
    0o755.  Every member is checked before anything is written, and one unsafe member refuses
    the whole archive with :class:`UnsafeArchive`.  While writing, a member that turns out
    larger than it declared, or a total past ``limits.max_total_bytes``, stops the extraction.
    On any failure ``staging`` is left as it was given (absent or empty).

    Returns the extracted members' names, normalised (``./`` prefixes and trailing slashes
    dropped), in archive order.
    """
    kind = archive_format(archive.name)
    create = _check_staging(staging)
    try:
        if kind == "tar":
            with tarfile.open(archive, "r:*") as tar:
                entries = _scan_tar(tar, limits)
                _check_plan(entries, limits)
                _make_staging(staging, create)
                try:
                    return _extract_tar(tar, entries, staging, limits)
                except BaseException:
                    _empty(staging, remove=create)
                    raise
        with zipfile.ZipFile(archive) as zipped:
            entries = _scan_zip(zipped, limits)
            _check_plan(entries, limits)
            _make_staging(staging, create)
            try:
                return _extract_zip(zipped, entries, staging, limits)
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
