"""Real archives on disk for the install tests, benign and malicious.

    llama_tarball(tmp / "llama-b6500-bin-ubuntu-x64.tar.gz")       # the llama.cpp Linux layout
    llama_zip(tmp / "llama-b6500-bin-win-cpu-x64.zip")             # the same as a zip
    write_tar(tmp / "evil.tar.gz", [tar_file("../evil")])          # any members, any order
    write_zip(tmp / "evil.zip", [zip_symlink("lib", "../..")])

Member builders return what the writers need; the writers pick gzip or plain tar from the name.
"""

from __future__ import annotations

import gzip
import io
import stat
import struct
import tarfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LLAMA_FILES",
    "LLAMA_SYMLINKS",
    "TarMember",
    "ZipMember",
    "llama_tarball",
    "llama_zip",
    "lying_zip_bomb",
    "sparse_tarball",
    "tar_device",
    "tar_dir",
    "tar_file",
    "tar_hardlink",
    "tar_symlink",
    "write_tar",
    "write_zip",
    "zip_dir",
    "zip_file",
    "zip_symlink",
]

#: name inside the root directory -> (content, mode)
LLAMA_FILES: dict[str, tuple[bytes, int]] = {
    "llama-server": (b"#!/bin/sh\necho llama-server\n", 0o755),
    "llama-cli": (b"#!/bin/sh\necho llama-cli\n", 0o755),
    "libllama.so.0.0.6500": (b"\x7fELF shared object\n", 0o644),
    "libggml-base.so.0.9.4": (b"\x7fELF ggml\n", 0o644),
    "LICENSE": (b"MIT\n", 0o644),
}
#: the ``.so`` chains llama.cpp ships: name -> relative target
LLAMA_SYMLINKS: dict[str, str] = {
    "libllama.so.0": "libllama.so.0.0.6500",
    "libllama.so": "libllama.so.0",
    "libggml-base.so.0": "libggml-base.so.0.9.4",
    "libggml-base.so": "libggml-base.so.0",
}


@dataclass(frozen=True)
class TarMember:
    info: tarfile.TarInfo
    data: bytes | None = None


@dataclass(frozen=True)
class ZipMember:
    info: zipfile.ZipInfo
    data: bytes = b""


# --------------------------------------------------------------------------- tar


def tar_file(name: str, data: bytes = b"payload\n", mode: int = 0o644) -> TarMember:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    return TarMember(info, data)


def tar_dir(name: str, mode: int = 0o755) -> TarMember:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return TarMember(info)


def tar_symlink(name: str, target: str) -> TarMember:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    info.mode = 0o777
    return TarMember(info)


def tar_hardlink(name: str, target: str) -> TarMember:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE
    info.linkname = target
    return TarMember(info)


def tar_device(name: str, kind: bytes) -> TarMember:
    """A special member: ``tarfile.CHRTYPE``, ``BLKTYPE`` or ``FIFOTYPE``."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.devmajor, info.devminor = (1, 3) if kind != tarfile.FIFOTYPE else (0, 0)
    return TarMember(info)


def write_tar(path: Path, members: Iterable[TarMember]) -> Path:
    mode = "w:gz" if path.name.endswith((".tar.gz", ".tgz")) else "w"
    with tarfile.open(path, mode) as tar:
        for member in members:
            tar.addfile(member.info, io.BytesIO(member.data) if member.data is not None else None)
    return path


def llama_tarball(
    path: Path,
    tag: str = "b6500",
    files: Mapping[str, tuple[bytes, int]] | None = None,
    symlinks: Mapping[str, str] | None = None,
) -> Path:
    """A ``.tar.gz`` laid out like llama.cpp's Linux releases: one root ``llama-<tag>/``."""
    root = f"llama-{tag}"
    members = [tar_dir(root)]
    members += [tar_file(f"{root}/{name}", data, mode) for name, (data, mode) in (files or LLAMA_FILES).items()]
    members += [tar_symlink(f"{root}/{name}", target) for name, target in (symlinks or LLAMA_SYMLINKS).items()]
    return write_tar(path, members)


def sparse_tarball(path: Path, name: str, apparent_size: int, data: bytes = b"x") -> Path:
    """A GNU tar holding one sparse member, as ``tar --sparse`` writes one: its header declares
    ``apparent_size`` bytes while the archive stores only ``data``, at the end of the file."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    info.size = len(data)
    info.mode = 0o644
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(info, io.BytesIO(data))
    raw = bytearray(buffer.getvalue())
    # The old GNU sparse header: the first (offset, length) pair at 386, the file's real size at 483.
    raw[386:398] = b"%012o" % (apparent_size - len(data))
    raw[398:410] = b"%012o" % len(data)
    raw[483:495] = b"%012o" % apparent_size
    raw[148:156] = b" " * 8
    raw[148:156] = b"%06o\0 " % sum(raw[:512])
    path.write_bytes(gzip.compress(bytes(raw)) if path.name.endswith((".tar.gz", ".tgz")) else bytes(raw))
    return path


# --------------------------------------------------------------------------- zip


def _zip_info(name: str, unix_mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2026, 9, 14, 12, 0, 0))
    info.create_system = 3  # Unix: the high 16 bits of external_attr are st_mode
    info.external_attr = unix_mode << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def zip_file(name: str, data: bytes = b"payload\n", mode: int = 0o644) -> ZipMember:
    return ZipMember(_zip_info(name, stat.S_IFREG | mode), data)


def zip_dir(name: str, mode: int = 0o755) -> ZipMember:
    info = _zip_info(name.rstrip("/") + "/", stat.S_IFDIR | mode)
    info.external_attr |= 0x10  # MS-DOS directory flag
    info.compress_type = zipfile.ZIP_STORED
    return ZipMember(info)


def zip_symlink(name: str, target: str) -> ZipMember:
    """A symlink as Info-ZIP stores it: S_IFLNK in the mode, the target as the content."""
    return ZipMember(_zip_info(name, stat.S_IFLNK | 0o777), target.encode())


def write_zip(path: Path, members: Iterable[ZipMember]) -> Path:
    with zipfile.ZipFile(path, "w") as zipped:
        for member in members:
            zipped.writestr(member.info, member.data)
    return path


def llama_zip(
    path: Path,
    tag: str = "b6500",
    files: Mapping[str, tuple[bytes, int]] | None = None,
    symlinks: Mapping[str, str] | None = None,
) -> Path:
    """The llama.cpp layout as a zip (how Linux builds were shipped before ``.tar.gz``)."""
    root = f"llama-{tag}"
    members = [zip_dir(root)]
    members += [zip_file(f"{root}/{name}", data, mode) for name, (data, mode) in (files or LLAMA_FILES).items()]
    members += [zip_symlink(f"{root}/{name}", target) for name, target in (symlinks or LLAMA_SYMLINKS).items()]
    return write_zip(path, members)


def lying_zip_bomb(path: Path, real_size: int, declared_size: int) -> Path:
    """A zip whose one member inflates to ``real_size`` zero bytes while its headers (local and
    central) declare ``declared_size``, as a zip bomb would."""
    write_zip(path, [zip_file("bomb.bin", bytes(real_size))])
    raw = bytearray(path.read_bytes())
    local = raw.find(b"PK\x03\x04")
    central = raw.find(b"PK\x01\x02")
    assert local >= 0 and central > local
    struct.pack_into("<I", raw, local + 22, declared_size)
    struct.pack_into("<I", raw, central + 24, declared_size)
    path.write_bytes(bytes(raw))
    return path
