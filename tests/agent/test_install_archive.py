"""Unpacking engine archives: llama.cpp's layouts extract with their symlinks and exec bits; every
unsafe archive is refused with its reason, before anything is written anywhere."""

from __future__ import annotations

import os
import re
import shutil
import stat
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from archives import (
    LLAMA_FILES,
    LLAMA_SYMLINKS,
    TarMember,
    ZipMember,
    llama_tarball,
    llama_zip,
    lying_zip_bomb,
    sparse_tarball,
    tar_device,
    tar_dir,
    tar_file,
    tar_hardlink,
    tar_symlink,
    write_tar,
    write_zip,
    zip_dir,
    zip_file,
    zip_symlink,
)

from agent.install.archive import ENGINE_RELEASE, Limits, UnsafeArchive, archive_format, extract


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _others(tmp_path: Path, archive: Path) -> list[Path]:
    """Everything under ``tmp_path`` except the archive: what an extraction left behind."""
    return sorted(path for path in tmp_path.rglob("*") if path != archive)


def _assert_llama_tree(root: Path) -> None:
    for name, (data, mode) in LLAMA_FILES.items():
        path = root / name
        assert path.is_file() and not path.is_symlink()
        assert path.read_bytes() == data
        assert _mode(path) == mode
    for name, target in LLAMA_SYMLINKS.items():
        assert (root / name).is_symlink()
        assert os.readlink(root / name) == target
    assert (root / "libllama.so").resolve() == (root / "libllama.so.0.0.6500").resolve()
    assert os.access(root / "llama-server", os.X_OK)


# --------------------------------------------------------------------------- benign archives


def test_llama_tarball_extracts_with_symlinks_and_exec_bits(tmp_path: Path) -> None:
    archive = llama_tarball(tmp_path / "llama-b6500-bin-ubuntu-x64.tar.gz")
    staging = tmp_path / "staging"
    names = extract(archive, staging)
    assert names[0] == "llama-b6500"
    assert sorted(names[1:]) == sorted(f"llama-b6500/{name}" for name in [*LLAMA_FILES, *LLAMA_SYMLINKS])
    assert _mode(staging) == 0o755
    assert [path.name for path in staging.iterdir()] == ["llama-b6500"]
    _assert_llama_tree(staging / "llama-b6500")


def test_llama_zip_extracts_with_symlinks_and_exec_bits(tmp_path: Path) -> None:
    archive = llama_zip(tmp_path / "llama-b6500-bin-ubuntu-x64.zip")
    staging = tmp_path / "staging"
    names = extract(archive, staging)
    assert len(names) == 1 + len(LLAMA_FILES) + len(LLAMA_SYMLINKS)
    _assert_llama_tree(staging / "llama-b6500")


def test_tar_extracts_the_same_without_the_extraction_filter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """Pythons before 3.11.4 (Debian 12 ships 3.11.2) have no ``filter=``: the pre-scan and the
    mode clean-up still apply."""
    monkeypatch.delattr(tarfile, "data_filter")
    archive = write_tar(
        tmp_path / "a.tar.gz",
        [tar_dir("bin", mode=0o777), tar_file("bin/tool", b"x", mode=0o4775), tar_symlink("bin/t", "tool")],
    )
    assert extract(archive, tmp_path / "staging") == ["bin", "bin/tool", "bin/t"]
    assert _mode(tmp_path / "staging/bin") == 0o755
    assert _mode(tmp_path / "staging/bin/tool") == 0o755
    assert os.readlink(tmp_path / "staging/bin/t") == "tool"


def _modes_archive(path: Path) -> Path:
    files = {"suid": 0o4755, "sgid": 0o2750, "shared": 0o666, "readonly": 0o400, "exec": 0o775}
    if path.suffix == ".zip":
        return write_zip(
            path, [zip_dir("d", mode=0o1777), *(zip_file(f"d/{n}", b"x", mode=m) for n, m in files.items())]
        )
    return write_tar(path, [tar_dir("d", mode=0o1777), *(tar_file(f"d/{n}", b"x", mode=m) for n, m in files.items())])


@pytest.mark.parametrize("name", ["modes.tar.gz", "modes.zip"])
def test_modes_lose_setuid_sticky_and_group_write_but_keep_exec(tmp_path: Path, name: str) -> None:
    extract(_modes_archive(tmp_path / name), tmp_path / "staging")
    d = tmp_path / "staging" / "d"
    assert _mode(d) == 0o755
    assert {path.name: _mode(path) for path in d.iterdir()} == {
        "suid": 0o755,
        "sgid": 0o750,
        "shared": 0o644,
        "readonly": 0o600,
        "exec": 0o755,
    }


def test_zip_without_unix_modes_gets_plain_defaults(tmp_path: Path) -> None:
    member = zip_file("llama.exe", b"MZ")
    member.info.create_system = 0  # MS-DOS: no st_mode in external_attr
    member.info.external_attr = 0x20
    extract(write_zip(tmp_path / "win.zip", [member]), tmp_path / "staging")
    assert _mode(tmp_path / "staging/llama.exe") == 0o644


def test_dot_slash_names_and_the_root_entry_are_normalised(tmp_path: Path) -> None:
    """``tar -czf x.tar.gz -C build .`` writes ``./`` and ``./bin/...``."""
    archive = write_tar(
        tmp_path / "dot.tgz",
        [
            tar_dir("./"),
            tar_dir("./bin/"),
            tar_file("./bin/llama-server", mode=0o755),
            tar_symlink("./bin/ls", "llama-server"),
        ],
    )
    assert extract(archive, tmp_path / "staging") == ["bin", "bin/llama-server", "bin/ls"]
    assert (tmp_path / "staging/bin/ls").is_symlink()


def test_in_tree_symlinks_to_directories_and_up_the_tree_are_kept(tmp_path: Path) -> None:
    archive = write_tar(
        tmp_path / "links.tar.gz",
        [
            tar_file("a/b/c/lib.so.1"),
            tar_symlink("a/b/c/top", "../../.."),  # the staging directory itself
            tar_symlink("a/b/c/here", "."),
            tar_symlink("a/up", "b/c/top/a"),  # through another in-tree symlink
            tar_symlink("a/dangling", "b/not-there"),
        ],
    )
    extract(archive, tmp_path / "staging")
    assert (tmp_path / "staging/a/b/c/top").resolve() == (tmp_path / "staging").resolve()
    assert (tmp_path / "staging/a/up").resolve() == (tmp_path / "staging/a").resolve()


def test_existing_empty_staging_is_used(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir(mode=0o700)
    extract(llama_tarball(tmp_path / "l.tar.gz"), staging)
    assert _mode(staging) == 0o755
    assert (staging / "llama-b6500" / "llama-server").is_file()


def test_non_empty_staging_is_a_value_error(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "left-over").write_text("x")
    with pytest.raises(ValueError, match="is not empty"):
        extract(llama_tarball(tmp_path / "l.tar.gz"), staging)
    assert [path.name for path in staging.iterdir()] == ["left-over"]


def test_staging_that_is_a_file_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "staging").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        extract(llama_tarball(tmp_path / "l.tar.gz"), tmp_path / "staging")


# --------------------------------------------------------------------------- refused before writing

Build = Callable[[Path], list[TarMember]]
ZipBuild = Callable[[Path], list[ZipMember]]

TAR_REFUSALS = [
    pytest.param(
        lambda tmp: [tar_file("llama-b1/ok"), tar_file("../evil")],
        "member ../evil leaves the install directory",
        Limits(),
        id="traversal",
    ),
    pytest.param(
        lambda tmp: [tar_file("llama-b1/../../evil")],
        "member llama-b1/../../evil leaves the install directory",
        Limits(),
        id="traversal-inside-the-name",
    ),
    pytest.param(
        lambda tmp: [tar_file(str(tmp / "abs-evil"))],
        "is an absolute path, outside the install directory",
        Limits(),
        id="absolute",
    ),
    pytest.param(
        lambda tmp: [tar_file("..\\evil")],
        "has a backslash in its name",
        Limits(),
        id="backslash",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("llama-b1/lib", "../../.."), tar_file("llama-b1/lib/evil")],
        "member llama-b1/lib/evil is under llama-b1/lib, which is a symlink: refused",
        Limits(),
        id="file-through-symlink",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("llama-b1/lib", "../../..")],
        "member llama-b1/lib is a symlink to ../../.., outside the install directory",
        Limits(),
        id="symlink-escape",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("lib/libx.so", "/etc/shadow")],
        "member lib/libx.so is a symlink to /etc/shadow, outside the install directory",
        Limits(),
        id="symlink-absolute",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("a/b/c/s", "../../.."), tar_symlink("a/b/c/t", "s/../../..")],
        "member a/b/c/t is a symlink to s/../../.., outside the install directory",
        Limits(),
        id="symlink-escape-through-symlink",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("a", "b"), tar_symlink("b", "a")],
        "which loops",
        Limits(),
        id="symlink-loop",
    ),
    pytest.param(
        lambda tmp: [tar_hardlink("lib/h", "/etc/passwd")],
        "member lib/h is a hard link to /etc/passwd: refused",
        Limits(),
        id="hardlink-outside",
    ),
    pytest.param(
        lambda tmp: [tar_file("lib/x"), tar_hardlink("lib/h", "lib/x")],
        "member lib/h is a hard link to lib/x: refused",
        Limits(),
        id="hardlink-in-tree",
    ),
    pytest.param(
        lambda tmp: [tar_device("dev/null", tarfile.CHRTYPE)],
        "member dev/null is a character device: refused",
        Limits(),
        id="character-device",
    ),
    pytest.param(
        lambda tmp: [tar_device("dev/sda", tarfile.BLKTYPE)],
        "member dev/sda is a block device: refused",
        Limits(),
        id="block-device",
    ),
    pytest.param(
        lambda tmp: [tar_device("run/pipe", tarfile.FIFOTYPE)],
        "member run/pipe is a FIFO: refused",
        Limits(),
        id="fifo",
    ),
    pytest.param(
        lambda tmp: [tar_symlink("bin/x", "llama-server"), tar_file("bin/x")],
        "member bin/x appears twice: refused",
        Limits(),
        id="file-over-symlink",
    ),
    pytest.param(
        lambda tmp: [tar_file("a"), tar_file("a/b")],
        "member a/b is under a, which is a file: refused",
        Limits(),
        id="file-under-file",
    ),
    pytest.param(
        lambda tmp: [tar_file("big.bin", bytes(2000))],
        "member big.bin declares 2,000 bytes: more than the limit of 1,000 bytes per member of an engine release",
        Limits(max_member_bytes=1000),
        id="member-too-big",
    ),
    pytest.param(
        lambda tmp: [tar_file("a.bin", bytes(2000)), tar_file("b.bin", bytes(2000))],
        "the members declare at least 4,000 bytes in all: more than the limit of 3,000 bytes for an engine release",
        Limits(max_total_bytes=3000),
        id="total-too-big",
    ),
    pytest.param(
        lambda tmp: [tar_file(f"f{i}") for i in range(11)],
        "at least 11 members: more than the limit of 10 for an engine release archive",
        Limits(max_members=10),
        id="too-many-members",
    ),
]


@pytest.mark.parametrize(("build", "message", "limits"), TAR_REFUSALS)
def test_unsafe_tarball_is_refused_before_anything_is_written(
    tmp_path: Path, build: Build, message: str, limits: Limits
) -> None:
    archive = write_tar(tmp_path / "a.tar.gz", build(tmp_path / "work"))
    staging = tmp_path / "work" / "staging"
    with pytest.raises(UnsafeArchive, match=re.escape(message)):
        extract(archive, staging, limits=limits)
    assert _others(tmp_path, archive) == []


def _zip_device(name: str) -> ZipMember:
    member = zip_file(name, b"")
    member.info.external_attr = (stat.S_IFCHR | 0o666) << 16
    return member


ZIP_REFUSALS = [
    pytest.param(
        lambda tmp: [zip_file("llama-b1/ok"), zip_file("../evil")],
        "member ../evil leaves the install directory",
        Limits(),
        id="traversal",
    ),
    pytest.param(
        lambda tmp: [zip_file("..\\..\\evil")],
        "member ..\\..\\evil leaves the install directory",
        Limits(),
        id="traversal-with-backslashes",
    ),
    pytest.param(
        lambda tmp: [zip_file(str(tmp / "abs-evil"))],
        "is an absolute path, outside the install directory",
        Limits(),
        id="absolute",
    ),
    pytest.param(
        lambda tmp: [zip_symlink("llama-b1/lib", "../../.."), zip_file("llama-b1/lib/evil")],
        "member llama-b1/lib/evil is under llama-b1/lib, which is a symlink: refused",
        Limits(),
        id="file-through-symlink",
    ),
    pytest.param(
        lambda tmp: [zip_symlink("link", "/etc/passwd")],
        "member link is a symlink to /etc/passwd, outside the install directory",
        Limits(),
        id="symlink-absolute",
    ),
    pytest.param(
        lambda tmp: [zip_symlink("llama-b1/lib", "../..")],
        "member llama-b1/lib is a symlink to ../.., outside the install directory",
        Limits(),
        id="symlink-escape",
    ),
    pytest.param(
        lambda tmp: [_zip_device("dev/null")],
        "member dev/null is a character device: refused",
        Limits(),
        id="character-device",
    ),
    pytest.param(
        lambda tmp: [zip_file("bomb.bin", bytes(10_000_000))],
        "the members declare at least 10,000,000 bytes in all: more than the limit of 1,000,000 bytes",
        Limits(max_total_bytes=1_000_000),
        id="zip-bomb",
    ),
    pytest.param(
        lambda tmp: [zip_file(f"f{i}") for i in range(11)],
        "at least 11 members: more than the limit of 10 for an engine release archive",
        Limits(max_members=10),
        id="too-many-members",
    ),
    pytest.param(
        lambda tmp: [zip_symlink("bin/x", "llama-server"), zip_file("bin/x")],
        "member bin/x appears twice: refused",
        Limits(),
        id="file-over-symlink",
    ),
]


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
@pytest.mark.parametrize(("build", "message", "limits"), ZIP_REFUSALS)
def test_unsafe_zip_is_refused_before_anything_is_written(
    tmp_path: Path, build: ZipBuild, message: str, limits: Limits
) -> None:
    archive = write_zip(tmp_path / "a.zip", build(tmp_path / "work"))
    staging = tmp_path / "work" / "staging"
    with pytest.raises(UnsafeArchive, match=re.escape(message)):
        extract(archive, staging, limits=limits)
    assert _others(tmp_path, archive) == []


def test_refusal_leaves_a_given_empty_staging_empty(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    archive = write_tar(tmp_path / "a.tar.gz", [tar_file("ok"), tar_hardlink("h", "/etc/passwd")])
    with pytest.raises(UnsafeArchive, match="hard link"):
        extract(archive, staging)
    assert list(staging.iterdir()) == []


# --------------------------------------------------------------------------- refused while writing


@pytest.mark.parametrize("given_staging", [False, True], ids=["absent", "empty"])
def test_zip_bomb_that_understates_its_size_is_stopped_and_cleaned_up(tmp_path: Path, given_staging: bool) -> None:
    archive = lying_zip_bomb(tmp_path / "bomb.zip", real_size=10_000_000, declared_size=1000)
    staging = tmp_path / "staging"
    if given_staging:
        staging.mkdir()
    with pytest.raises(UnsafeArchive, match="member bomb.bin"):
        extract(archive, staging, limits=Limits(max_total_bytes=1_000_000))
    if given_staging:
        assert list(staging.iterdir()) == []
    else:
        assert not staging.exists()


# --------------------------------------------------------------------------- bounded by kind and disk

MIB = 2**20
SMALL_RELEASE = Limits(max_total_bytes=8 * MIB, max_member_bytes=8 * MIB)


@pytest.mark.parametrize("name", ["r.tar.gz", "r.zip"])
def test_a_compressible_member_past_the_kind_limit_is_refused_at_its_header(tmp_path: Path, name: str) -> None:
    # A real engine file and, beside it, 12 MiB of zeros (a few kilobytes packed) against a limit of
    # 8 MiB: the zeros' header refuses the archive, and nothing is written.
    if name.endswith(".zip"):
        archive = write_zip(
            tmp_path / name, [zip_file("llama-b1/llama-server"), zip_file("llama-b1/z", bytes(12 * MIB))]
        )
    else:
        archive = write_tar(
            tmp_path / name, [tar_file("llama-b1/llama-server"), tar_file("llama-b1/z", bytes(12 * MIB))]
        )
    assert archive.stat().st_size < 100_000
    message = (
        "member llama-b1/z declares 12,582,912 bytes: "
        "more than the limit of 8 MiB per member of an engine release archive"
    )
    with pytest.raises(UnsafeArchive, match=re.escape(message)):
        extract(archive, tmp_path / "staging", limits=SMALL_RELEASE)
    assert _others(tmp_path, archive) == []


def test_an_engine_release_unpacks_to_2_gib_at_most() -> None:
    assert (ENGINE_RELEASE.max_total_bytes, ENGINE_RELEASE.max_members) == (2 * 2**30, 2_000)


def test_a_sparse_member_declaring_10_gib_is_refused(tmp_path: Path) -> None:
    archive = sparse_tarball(tmp_path / "s.tar.gz", "llama-b1/zeros.bin", 10 * 2**30)
    assert archive.stat().st_size < 1000
    with pytest.raises(UnsafeArchive, match="member llama-b1/zeros.bin is a sparse file: refused"):
        extract(archive, tmp_path / "staging")
    assert _others(tmp_path, archive) == []


@pytest.mark.parametrize("name", ["many.tar.gz", "many.zip"])
def test_a_member_count_bomb_is_refused_at_the_kinds_count(tmp_path: Path, name: str) -> None:
    count = ENGINE_RELEASE.max_members + 1
    if name.endswith(".zip"):
        archive = write_zip(tmp_path / name, [zip_file(f"llama-b1/f{i}", b"") for i in range(count)])
    else:
        archive = write_tar(tmp_path / name, [tar_file(f"llama-b1/f{i}", b"") for i in range(count)])
    message = "at least 2,001 members: more than the limit of 2,000 for an engine release archive"
    with pytest.raises(UnsafeArchive, match=re.escape(message)):
        extract(archive, tmp_path / "staging")
    assert _others(tmp_path, archive) == []


def test_an_archive_that_would_leave_less_than_the_reserve_free_is_refused_with_the_numbers(tmp_path: Path) -> None:
    archive = write_tar(tmp_path / "r.tar.gz", [tar_file("llama-b1/llama-server", bytes(3 * MIB))])
    reserve = shutil.disk_usage(tmp_path).total  # no disk keeps all of itself free
    with pytest.raises(UnsafeArchive) as refused:
        extract(archive, tmp_path / "a" / "staging", reserve=reserve)
    text = str(refused.value)
    assert re.fullmatch(
        rf"the members declare at least 3,145,728 bytes and {re.escape(str(tmp_path))} has [0-9,]+ bytes free: "
        r"unpacking would leave less than the [0-9,]+ (GiB|MiB|KiB|bytes) this node keeps free",
        text,
    ), text
    assert _others(tmp_path, archive) == []


def test_truncated_tarball_is_refused_as_unreadable(tmp_path: Path) -> None:
    archive = llama_tarball(tmp_path / "l.tar.gz", files={"llama-server": (os.urandom(200_000), 0o755)})
    archive.write_bytes(archive.read_bytes()[:50_000])
    with pytest.raises(UnsafeArchive, match="cannot read l.tar.gz"):
        extract(archive, tmp_path / "staging")
    assert not (tmp_path / "staging").exists()


def test_truncated_zip_is_refused_as_unreadable(tmp_path: Path) -> None:
    archive = llama_zip(tmp_path / "l.zip")
    archive.write_bytes(archive.read_bytes()[:100])
    with pytest.raises(UnsafeArchive, match="cannot read l.zip"):
        extract(archive, tmp_path / "staging")


# --------------------------------------------------------------------------- archive_format


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-b6500-bin-ubuntu-x64.tar.gz", "tar"),
        ("llama-b6500-bin-ubuntu-cuda-12.8-x64.tar.gz", "tar"),
        ("cudart-llama-b6500-bin-ubuntu-cuda-13.3-x64.TAR.GZ", "tar"),
        ("llama-b6500-bin-ubuntu-x64.tgz", "tar"),
        ("llama.tar.xz", "tar"),
        ("llama.tar.bz2", "tar"),
        ("llama.tar", "tar"),
        ("llama-b6500-bin-win-cuda-12.4-x64.zip", "zip"),
        ("cudart-llama-bin-win-cuda-12.4-x64.zip", "zip"),
    ],
)
def test_archive_format_reads_the_extension(name: str, expected: str) -> None:
    assert archive_format(name) == expected


@pytest.mark.parametrize(
    ("name", "shown"),
    [("x.rar", "'.rar'"), ("llama.tar.zst", "'.tar.zst'"), ("llama-server", "no extension")],
)
def test_archive_format_refuses_other_extensions(name: str, shown: str) -> None:
    with pytest.raises(ValueError, match=re.escape(shown)):
        archive_format(name)


def test_unsupported_name_is_refused_before_staging_is_touched(tmp_path: Path) -> None:
    archive = tmp_path / "x.rar"
    archive.write_bytes(b"Rar!")
    with pytest.raises(ValueError, match="'.rar'"):
        extract(archive, tmp_path / "staging")
    assert not (tmp_path / "staging").exists()
