"""What a node keeps from the mirror: only inside its model_dirs, only whole and verified against
the manifest, resumed where it stopped, and hashed once rather than at every desired message."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from agent.mirror import MESSAGE_MAX, MirrorSync
from tests.localhttp import LocalHTTP
from tests.mirror.ggufbytes import RangeServer


def sync(tmp_path: Path, server: RangeServer) -> MirrorSync:
    return MirrorSync(tmp_path / "state", [str(tmp_path / "models")], address=lambda url: (server.url(url), {}))


def item(tmp_path: Path, data: bytes, *, path: str = "m.gguf", sha256: str | None = None, folder: Path | None = None):
    return {
        "version": 7,
        "dir": str(folder or tmp_path / "models" / "mirror" / "acme--m" / "c0ffee"),
        "files": [
            {"path": path, "size": len(data), "sha256": sha256 or hashlib.sha256(data).hexdigest(), "url": "m.gguf"}
        ],
    }


def test_a_file_is_fetched_verified_and_not_hashed_again(tmp_path: Path) -> None:
    data = os.urandom(300_000)
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "m.gguf").write_bytes(data)
    with RangeServer(tmp_path / "served") as server:
        mirror = sync(tmp_path, server)
        wanted = item(tmp_path, data)
        mirror.converge_sync([wanted])
        assert mirror.status["7"] == "held"
        assert mirror.report() == [{"version": 7, "dir": wanted["dir"], "state": "held"}]
        target = Path(wanted["dir"]) / "m.gguf"
        assert target.read_bytes() == data
        before = len(server.requests)
        MirrorSync(tmp_path / "state", [str(tmp_path / "models")], address=mirror.address).converge_sync([wanted])
        assert len(server.requests) == before  # a new agent trusts what it verified, by size and mtime


def test_a_wrong_digest_leaves_nothing_where_the_source_points(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "m.gguf").write_bytes(data)
    with RangeServer(tmp_path / "served") as server:
        mirror = sync(tmp_path, server)
        wanted = item(tmp_path, data, sha256="0" * 64)
        mirror.converge_sync([wanted])
    assert mirror.status["7"].startswith("failed: m.gguf: digest mismatch for m.gguf: the mirror's manifest gives")
    assert not (Path(wanted["dir"]) / "m.gguf").exists()


def test_a_directory_outside_model_dirs_and_a_path_that_leaves_are_refused(tmp_path: Path) -> None:
    with RangeServer(tmp_path) as server:
        mirror = sync(tmp_path, server)
        mirror.converge_sync([item(tmp_path, b"x", folder=tmp_path / "elsewhere")])
        assert mirror.status["7"].startswith(
            f"refused: {tmp_path / 'elsewhere'} is not inside this node's model_dirs ({tmp_path / 'models'}); "
        )
        assert mirror.report() == [
            {
                "version": 7,
                "dir": str(tmp_path / "elsewhere"),
                "state": "refused",
                "message": mirror.status["7"].removeprefix("refused: "),
            }
        ]
        mirror.converge_sync([item(tmp_path, b"x", path="../../escape.gguf")])
        assert mirror.status["7"].startswith("failed: '../../escape.gguf': not a path inside the version")
        assert server.requests == []


def test_a_symlink_out_of_model_dirs_and_a_name_no_file_system_takes_are_refused(tmp_path: Path) -> None:
    """The control plane names a directory inside model_dirs, but a symlink there leads out; or a
    file whose name is longer than a file system takes: refused with the reason, nothing asked."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "models" / "mirror").mkdir(parents=True)
    (tmp_path / "models" / "mirror" / "acme--m").symlink_to(outside, target_is_directory=True)
    with RangeServer(tmp_path) as server:
        mirror = sync(tmp_path, server)
        mirror.converge_sync([item(tmp_path, b"x")])
        assert mirror.status["7"].startswith("refused: "), mirror.status["7"]
        mirror.converge_sync([item(tmp_path, b"x", folder=tmp_path / "models" / "m", path="n" * 300)])
        assert "has a name of 300 bytes; a file system takes 255" in mirror.status["7"]
        assert server.requests == []
    assert list(outside.iterdir()) == []


def test_a_redirect_from_the_control_plane_to_a_link_local_address_is_not_followed(tmp_path: Path) -> None:
    """A cloud's metadata service (169.254.169.254) is never asked, with the node's credential or not."""

    def answer(handler: Any, head: bool) -> None:
        handler.send_response(302)
        handler.send_header("Location", "http://169.254.169.254/latest/meta-data/iam/")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    server = LocalHTTP(answer)
    server.start()
    try:
        mirror = MirrorSync(
            tmp_path / "state",
            [str(tmp_path / "models")],
            address=lambda url: (f"{server.base}/{url}", {"Authorization": "Bearer node-token"}),
        )
        mirror.converge_sync([item(tmp_path, b"x")])
    finally:
        server.stop()
    assert "is a link-local address (169.254.169.254)" in mirror.status["7"], mirror.status["7"]


def test_a_version_no_longer_asked_for_is_no_longer_reported_and_a_long_reason_is_cut(tmp_path: Path) -> None:
    with RangeServer(tmp_path) as server:
        mirror = sync(tmp_path, server)
        files = [{"path": f"../{index:04d}-" + "x" * 150, "url": "x"} for index in range(40)]
        mirror.converge_sync([{"version": 7, "dir": str(tmp_path / "models" / "v"), "files": files}])
        (entry,) = mirror.report()
        assert entry["state"] == "failed" and len(entry["message"]) == MESSAGE_MAX
        mirror.converge_sync([])
        assert mirror.report() == []
