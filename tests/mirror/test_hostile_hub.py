"""The mirror against a hostile Hub of ours (tests/mirror/hubserver.py): a commit id that climbs out
of the mirror, files it cannot check, content swapped for other bytes or an endless stream,
redirects to this machine's own services, names no file system takes, and a worker killed in the
middle of a fetch. Each ends in a clear state with the reason; nothing outside the mirror is
written, read or deleted; and one bad file never stops the queue for the others."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from agent.safepath import UnsafePath
from apps.mirror import services
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorFile, MirrorVersion
from apps.mirror.tasks import start_mirror_fetches
from tests.localhttp import LocalHTTP
from tests.mirror.conftest import gguf
from tests.mirror.hubserver import HubServer, Repo, git_blob_sha1

pytestmark = pytest.mark.django_db

ESCAPE = "../../../../../../../../../../tmp/llmgw-escape/commit"


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A file outside every folder llmgw owns, which must stay as it is."""
    folder = tmp_path / "outside"
    folder.mkdir()
    keep = folder / "keep.gguf"
    keep.write_bytes(b"do not touch")
    yield keep
    assert keep.read_bytes() == b"do not touch"


@pytest.fixture
def control_plane(settings: Any) -> Iterator[LocalHTTP]:
    """A stand-in for this control plane's own web process, which must never be asked anything."""
    asked: list[str] = []

    def answer(handler: Any, head: bool) -> None:
        asked.append(handler.path)
        body = b"llmgw_secret_metric 1\n"
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = LocalHTTP(answer)
    server.start()
    server.asked = asked  # type: ignore[attr-defined]
    settings.LISTEN = ("127.0.0.1", server.httpd.server_address[1])
    try:
        yield server
    finally:
        server.stop()
    assert asked == [], f"the control plane was asked {asked}"


def source(hub: HubServer, repo: str, path: str) -> str:
    return f"{hub.url}/{repo}/resolve/main/{path}"


def only_file(repo: str) -> MirrorFile:
    return MirrorFile.objects.select_related("version").get(version__repo=repo)


# ----------------------------------------------------------------------------------------- paths


def test_a_commit_id_that_leaves_the_mirror_is_refused_and_nothing_is_written(
    hub: HubServer, eager: Any, outside: Path
) -> None:
    hub.add(Repo("evil/climb", {"e.gguf": gguf()}, commit=ESCAPE))
    with pytest.raises(MirrorError, match="a commit id is 40 hexadecimal characters"), eager(execute=True):
        services.add_sources([source(hub, "evil/climb", "e.gguf")])
    assert not MirrorVersion.objects.exists()
    assert not Path("/tmp/llmgw-escape").exists()


def test_a_row_that_names_a_path_outside_is_never_written_nor_deleted(
    hub: HubServer, eager: Any, outside: Path
) -> None:
    """Rows written before commits were checked: fetching fails with the reason, and removing the
    version removes the rows but not the file outside that its path names."""
    climb = os.path.relpath(outside.parent, Path(services.settings.MIRROR_DIR) / "evil--climb")
    version = MirrorVersion.objects.create(repo="evil/climb", commit=climb, name="keep.gguf", kind="gguf")
    data = b"x" * 100
    file = MirrorFile.objects.create(
        version=version, path="keep.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    with pytest.raises(UnsafePath, match=r"has an empty, '\.' or '\.\.' component"):
        file.local_path  # noqa: B018 - the property is the check
    MirrorFile.objects.filter(pk=file.pk).update(state=MirrorFile.State.DOWNLOADING)
    services.fetch_one(file.pk)
    file.refresh_from_db()
    assert file.state == MirrorFile.State.FAILED and "cannot be kept in the mirror" in file.error
    assert services.remove_version(version) == 0
    assert not MirrorVersion.objects.filter(pk=version.pk).exists()


def test_a_version_folder_that_is_a_symlink_out_of_the_mirror_is_refused(
    hub: HubServer, eager: Any, outside: Path, settings: Any
) -> None:
    repo = hub.add(Repo("evil/link", {"keep.gguf": gguf()}))
    folder = Path(settings.MIRROR_DIR) / "evil--link"
    folder.mkdir(parents=True)
    (folder / repo.commit).symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(MirrorError, match="leads outside"), eager(execute=True):
        services.add_sources([source(hub, "evil/link", "keep.gguf")])


def test_names_no_file_system_takes_are_refused_and_the_queue_goes_on(
    hub: HubServer, eager: Any, settings: Any
) -> None:
    long_name = "a" * 301 + ".gguf"  # 306 bytes: ENAMETOOLONG
    hub.add(Repo("evil/long", {long_name: gguf(), "ok.gguf": gguf()}))
    with pytest.raises(MirrorError, match="has a name of 306 bytes; a file system takes 255"), eager(execute=True):
        services.add_sources([source(hub, "evil/long", long_name)])
    # 253 bytes fit a file system, but not with the suffix it is written under until verified.
    with pytest.raises(MirrorError, match=r"a name of 253 bytes \(at most 250\)"):
        services._safe_path("b" * 248 + ".gguf")
    for bad in ("a\x00b.gguf", "a\\b.gguf", "dir/../b.gguf", "/etc/x.gguf"):
        with pytest.raises(MirrorError, match="not a file path inside a repository"):
            services._safe_path(bad)
    # A row with such a name from before: it fails with the reason, the slot is given back, beat's
    # task does not raise, the honest file behind it is fetched, and the version can be removed.
    version = MirrorVersion.objects.create(
        repo="evil/long", commit=hub.repos["evil/long"].commit, name="x", kind="gguf"
    )
    bad = MirrorFile.objects.create(version=version, path=long_name, size=10, sha256="0" * 64)
    with eager(execute=True):
        (honest,) = services.add_sources([source(hub, "evil/long", "ok.gguf")])
        start_mirror_fetches()
    bad.refresh_from_db()
    assert bad.state == MirrorFile.State.FAILED and "306 bytes" in bad.error, bad.error
    assert honest.files.get().state == MirrorFile.State.HELD
    assert not MirrorFile.objects.filter(state=MirrorFile.State.DOWNLOADING).exists()
    services.remove_version(version)


# ------------------------------------------------------------------------------- what is checked


def test_a_small_file_with_no_listed_size_is_checked_against_its_git_blob_id(hub: HubServer, eager: Any) -> None:
    config = b'{"architectures": ["LlamaForCausalLM"]}'
    hub.add(Repo("acme/plain", {"config.json": config}))
    hub.unsized.add("config.json")
    with eager(execute=True):
        services.add_sources([source(hub, "acme/plain", "config.json")])
    file = only_file("acme/plain")
    assert file.size is None and file.blob_id == git_blob_sha1(config)
    assert file.state == MirrorFile.State.HELD, file.error
    assert file.local_path.read_bytes() == config and file.sha256 == hashlib.sha256(config).hexdigest()


def test_swapped_bytes_of_a_file_with_no_listed_size_are_refused(hub: HubServer, eager: Any) -> None:
    hub.add(Repo("evil/swap", {"config.json": b'{"a": 1}'}))
    hub.unsized.add("config.json")
    hub.swap["config.json"] = b'{"a": 2, "from": "another server"}'
    with eager(execute=True):
        services.add_sources([source(hub, "evil/swap", "config.json")])
    file = only_file("evil/swap")
    assert file.state == MirrorFile.State.FAILED
    assert "digest mismatch for config.json: the Hub gives git blob" in file.error
    assert not file.local_path.exists() and not file.part_path.exists()
    with pytest.raises(MirrorError, match="0 of 1 files are held"):
        services.manifest(file.version)


def test_an_endless_stream_for_a_file_with_no_listed_size_is_cut_at_the_bound(
    hub: HubServer, eager: Any, settings: Any
) -> None:
    settings.MIRROR_UNSIZED_MAX_MB = 1
    hub.add(Repo("evil/zeros", {"tokenizer.json": b"{}"}))
    hub.unsized.add("tokenizer.json")
    hub.endless.add("tokenizer.json")
    with eager(execute=True):
        services.add_sources([source(hub, "evil/zeros", "tokenizer.json")])
    file = only_file("evil/zeros")
    assert file.state == MirrorFile.State.FAILED
    assert "has no listed size and the server sent more than the 1,048,576 bytes" in file.error
    assert not file.part_path.exists()


def test_an_unsized_file_counts_at_the_bound_against_free_space(
    hub: HubServer, eager: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add(Repo("acme/plain", {"config.json": b"{}"}))
    hub.unsized.add("config.json")
    settings.MIRROR_UNSIZED_MAX_MB = 10
    monkeypatch.setattr(services, "space", lambda: services.Space(free=5 * 2**20, used=0, reserve=0))
    with pytest.raises(MirrorError, match="this needs 10 MB, 5.2 MB is free"):
        services.add_sources([source(hub, "acme/plain", "config.json")])


def test_a_file_with_neither_digest_is_refused(hub: HubServer) -> None:
    hub.add(Repo("evil/nodigest", {"notes.txt": b"hello"}))
    original = hub.repos["evil/nodigest"].entry

    def no_blob(path: str) -> dict[str, Any]:
        entry = original(path)
        entry["oid"] = "not-a-blob-id"
        return entry

    hub.repos["evil/nodigest"].entry = no_blob  # type: ignore[method-assign]
    with pytest.raises(MirrorError, match="neither a sha256 nor a git blob id for notes.txt"):
        services.add_sources([source(hub, "evil/nodigest", "notes.txt")])


# ------------------------------------------------------------------------------------ redirects


@pytest.mark.parametrize(
    "where",
    [
        "{control}/metrics",  # the control plane's own /metrics
        "http://localhost:{port}/metrics",  # the same, by another name
        "http://169.254.169.254/latest/meta-data/",  # a cloud's metadata service
        "file:///etc/passwd",
        "ftp://example.org/x",
    ],
)
def test_a_redirect_to_this_machines_own_services_is_not_followed(
    hub: HubServer, eager: Any, control_plane: LocalHTTP, where: str
) -> None:
    hub.add(Repo("evil/redirect", {"config.json": b"{}"}))
    hub.redirect["config.json"] = where.format(control=control_plane.base, port=control_plane.httpd.server_address[1])
    with eager(execute=True):
        services.add_sources([source(hub, "evil/redirect", "config.json")])
    file = only_file("evil/redirect")
    assert file.state == MirrorFile.State.FAILED, file.error
    assert "redirect" in file.error and file.attempts == 1, file.error


def test_the_hubs_api_is_not_followed_to_the_control_plane(hub: HubServer, control_plane: LocalHTTP) -> None:
    hub.redirect["api"] = f"{control_plane.base}/metrics"
    with pytest.raises(MirrorError, match="is the control plane itself"):
        services.add_sources([source(hub, "acme/tiny-GGUF", "tiny-Q4_K_M.gguf")])


def test_redirects_to_the_hubs_own_storage_are_followed_without_the_token(
    hub: HubServer, eager: Any, settings: Any, control_plane: LocalHTTP
) -> None:
    """The Hub on 127.0.0.1 sends its files from another port of 127.0.0.1: the operator pointed
    llmgw at that host, so it is followed (but the token stays with the Hub)."""
    settings.HF_TOKEN = "hf_secret"
    with eager(execute=True):
        (version,) = services.add_sources([source(hub, "acme/tiny-GGUF", "tiny-Q4_K_M.gguf")])
    assert version.files.get().state == MirrorFile.State.HELD
    assert any(method == "STORAGE GET" for method, _p, _r in hub.requests)


# --------------------------------------------------------------------------- a worker killed


def database_url() -> str:
    config = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{config['NAME']}"
    return f"postgres://{config['USER']}@{config['HOST'] or '127.0.0.1'}:{config['PORT'] or 5432}/{config['NAME']}"


@pytest.mark.django_db(transaction=True)
def test_a_fetch_whose_worker_is_killed_resumes_from_its_part_with_a_range_request(
    hub: HubServer, eager: Any, settings: Any, tmp_path: Path
) -> None:
    """A worker process is killed (SIGKILL) in the middle of a file. The row stays downloading
    until it stops reporting; then it is queued again, and the next fetch asks only for the bytes
    after those its .part holds, and the file is held and verified."""
    data = gguf(pad=3_000_000)
    hub.add(Repo("acme/big", {"big.gguf": data}))
    hub.pause_after["big.gguf"] = 1_000_000
    version = MirrorVersion.objects.create(repo="acme/big", commit=hub.repos["acme/big"].commit, name="b", kind="gguf")
    file = MirrorFile.objects.create(
        version=version, path="big.gguf", size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    from django.utils import timezone

    MirrorFile.objects.filter(pk=file.pk).update(state=MirrorFile.State.DOWNLOADING, started_at=timezone.now())
    env = {
        **os.environ,
        "LLMGW_DATABASE_URL": database_url(),
        "LLMGW_HF_ENDPOINT": hub.url,
        "LLMGW_MIRROR_DIR": str(settings.MIRROR_DIR),
        "LLMGW_MIRROR_RESERVE_GB": "0",
        "DJANGO_SETTINGS_MODULE": "llmgw.settings",
    }
    code = f"import django; django.setup(); from apps.mirror.services import fetch_one; fetch_one({file.pk})"
    worker = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 60
        while not MirrorFile.objects.get(pk=file.pk).bytes_done and time.monotonic() < deadline:
            assert worker.poll() is None, "the worker ended before it was killed"
            time.sleep(0.05)
        assert MirrorFile.objects.get(pk=file.pk).bytes_done, "the worker never reported progress"
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        hub.go_on.set()
    held = file.local_path.with_name("big.gguf.part").stat().st_size
    assert 0 < held <= 1_000_000
    assert services.resume_interrupted() == 0  # it reported a moment ago: not yet taken for dead
    time.sleep(1.1)
    assert services.resume_interrupted(older_than_s=1.0) == 1
    hub.requests.clear()
    with eager(execute=True):
        services.start_fetches()
    file.refresh_from_db()
    assert file.state == MirrorFile.State.HELD, file.error
    assert file.local_path.read_bytes() == data
    assert ("STORAGE GET", "/blobs/acme/big/big.gguf", f"bytes={held}-") in hub.requests
