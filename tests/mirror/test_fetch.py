"""Fetching into the mirror from a Hub-compatible server of ours (tests/mirror/hubserver.py), through
huggingface_hub for the listing and Range requests for the bytes: whole files verified against the
Hub's digests, sets fetched whole, interrupted downloads resumed, and every fault ending in a clear
state and message with nothing half-downloaded held."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from apps.mirror import services
from apps.mirror.hub import MirrorError, group_files, parse_source, repo_files, search
from apps.mirror.models import MirrorFile, MirrorVersion
from tests.mirror.hubserver import HubServer

pytestmark = pytest.mark.django_db


def test_search_pages_and_a_repositorys_files_come_through_huggingface_hub(hub: HubServer) -> None:
    found = search("acme", limit=10)
    assert [r["id"] for r in found] == ["acme/tiny-GGUF", "acme/tiny", "acme/other"]  # two pages of 2
    assert any("cursor=2" in path for _m, path, _r in hub.requests)
    commit, files = repo_files("acme/tiny-GGUF")
    assert commit == hub.repos["acme/tiny-GGUF"].commit
    by_path = {f.path: f for f in files}
    data = hub.repos["acme/tiny-GGUF"].files
    assert by_path["tiny-Q4_K_M.gguf"].sha256 == hashlib.sha256(data["tiny-Q4_K_M.gguf"]).hexdigest()
    assert by_path["README.md"].sha256 is None and by_path["README.md"].blob_id
    groups = {(g.kind, g.name): [f.path for f in g.files] for g in group_files(files)}
    assert groups == {
        ("gguf", "Q4_K_M"): ["tiny-Q4_K_M.gguf"],
        ("gguf", "Q8_0"): ["tiny-Q8_0.gguf"],
        ("projector", "mmproj-tiny-f16.gguf"): ["mmproj-tiny-f16.gguf"],
        ("split", "big"): ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"],
    }


def test_sources_are_read_and_a_repository_page_is_refused_with_the_reason() -> None:
    assert parse_source("https://huggingface.co/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf") == (
        "acme/tiny-GGUF",
        "main",
        "tiny-Q4_K_M.gguf",
    )
    assert parse_source("https://hub.local/acme/tiny/blob/v1/sub/model.safetensors")[2] == "sub/model.safetensors"
    assert parse_source("hf://acme/tiny-GGUF@v2/tiny-Q8_0.gguf") == ("acme/tiny-GGUF", "v2", "tiny-Q8_0.gguf")
    for page in ("https://huggingface.co/acme/tiny-GGUF", "https://huggingface.co/acme/tiny-GGUF/tree/main"):
        with pytest.raises(MirrorError, match="is a repository page, not a file"):
            parse_source(page)
    with pytest.raises(MirrorError, match="not a Hub URL"):
        parse_source("ftp://x/y")


def test_a_gguf_is_fetched_verified_and_its_manifest_given_once_held(hub: HubServer, eager: Any) -> None:
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    (file,) = version.files.all()
    assert file.state == MirrorFile.State.HELD, file.error
    data = hub.repos["acme/tiny-GGUF"].files["tiny-Q4_K_M.gguf"]
    assert file.local_path.read_bytes() == data and file.bytes_done == len(data)
    assert services.manifest(version) == {
        "repo": "acme/tiny-GGUF",
        "commit": hub.repos["acme/tiny-GGUF"].commit,
        "name": "tiny-Q4_K_M.gguf",
        "kind": "gguf",
        "files": [{"path": "tiny-Q4_K_M.gguf", "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}],
    }
    # The bytes came from the storage host the Hub redirected to, without the Hub's token.
    assert any(method == "STORAGE GET" for method, _p, _r in hub.requests)


def test_a_split_set_and_a_safetensors_set_are_fetched_whole(hub: HubServer, eager: Any) -> None:
    with eager(execute=True):
        split, tensors = services.add_sources(
            [
                f"{hub.url}/acme/tiny-GGUF/resolve/main/big-00002-of-00002.gguf",
                f"{hub.url}/acme/tiny/resolve/main/model.safetensors.index.json",
            ]
        )
    assert sorted(f.path for f in split.files.all()) == ["big-00001-of-00002.gguf", "big-00002-of-00002.gguf"]
    assert sorted(f.path for f in tensors.files.all()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]  # README.md is not part of the set
    assert {f.state for f in MirrorFile.objects.all()} == {MirrorFile.State.HELD}
    from apps.mirror.safetensors import check_set

    digests = {f.path: f.sha256 for f in tensors.files.all()}
    assert check_set(tensors.folder, digests) == []
    assert len(services.manifest(tensors)["files"]) == 5
    # A shard changed on disk after it was held: the set is no longer whole, and no manifest is given.
    shard_path = tensors.folder / "model-00002-of-00002.safetensors"
    shard_path.write_bytes(shard_path.read_bytes()[:-4])
    with pytest.raises(MirrorError, match="the safetensors set is not whole: model-00002-of-00002.safetensors is"):
        services.manifest(tensors)


def test_no_manifest_while_a_file_is_missing(hub: HubServer) -> None:
    (version,) = services.add_sources([f"{hub.url}/acme/tiny/resolve/main/config.json"])
    with pytest.raises(MirrorError, match=r"0 of 5 files are held \(5 queued\)"):
        services.manifest(version)


def test_a_truncated_download_is_resumed_with_a_range_request(hub: HubServer, eager: Any) -> None:
    name = "tiny-Q8_0.gguf"
    size = len(hub.repos["acme/tiny-GGUF"].files[name])
    hub.truncate[name] = 200_000
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/{name}"])
    file = version.files.get()
    assert file.state == MirrorFile.State.FAILED  # three tries, each cut at the same byte
    assert file.error == f"interrupted at 200,000 of {size:,} bytes"
    assert file.local_path.with_name(name + ".part").stat().st_size == 200_000  # kept for a resume
    del hub.truncate[name]
    with eager(execute=True):
        services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/{name}"])  # fetch again
    file.refresh_from_db()
    assert file.state == MirrorFile.State.HELD, file.error
    assert ("STORAGE GET", f"/blobs/acme/tiny-GGUF/{name}", "bytes=200000-") in hub.requests
    assert file.local_path.read_bytes() == hub.repos["acme/tiny-GGUF"].files[name]


@pytest.mark.parametrize("fault", ["lie", "change"])
def test_a_digest_that_does_not_match_is_never_held(hub: HubServer, eager: Any, fault: str) -> None:
    repo = hub.repos["acme/tiny-GGUF"]
    if fault == "lie":
        repo.lie_sha256["tiny-Q4_K_M.gguf"] = "ab" * 32
    else:
        hub.change_after["tiny-Q4_K_M.gguf"] = 100_000  # the file changed on the Hub mid-download
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    file = version.files.get()
    assert file.state == MirrorFile.State.FAILED
    assert file.error.startswith("digest mismatch for tiny-Q4_K_M.gguf: the Hub gives sha256 ")
    assert not file.local_path.exists() and not file.local_path.with_name(file.local_path.name + ".part").exists()
    with pytest.raises(MirrorError, match="0 of 1 files are held"):
        services.manifest(version)


def test_a_repository_that_disappears_and_a_missing_file_are_refused(hub: HubServer) -> None:
    with pytest.raises(MirrorError, match="the repository has no file nope.gguf"):
        services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/nope.gguf"])
    hub.gone.add("acme/other")
    with pytest.raises(MirrorError, match="cannot read acme/other at main from"):
        services.add_sources([f"{hub.url}/acme/other/resolve/main/x.gguf"])
    assert not MirrorVersion.objects.exists()


def test_a_fetch_that_would_not_fit_is_refused_before_it_starts(hub: HubServer, settings: Any) -> None:
    settings.MIRROR_RESERVE_GB = 10**9  # more than any disk has free
    with pytest.raises(MirrorError) as caught:
        services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    text = str(caught.value)
    assert text.startswith("not enough space in the mirror") and "this needs 300 kB" in text and "is free" in text
    assert not MirrorVersion.objects.exists() and not any(m == "STORAGE GET" for m, _p, _r in hub.requests)


def test_only_the_limit_downloads_at_once(hub: HubServer, settings: Any) -> None:
    settings.MIRROR_CONCURRENT_FETCHES = 2
    queue = Path(settings.CELERY_QUEUE_DIR)  # the SQLite default's broker: a folder
    for folder in (queue / "messages", queue / "control"):
        folder.mkdir(parents=True, exist_ok=True)
    (version,) = services.add_sources([f"{hub.url}/acme/tiny/resolve/main/config.json"])  # 5 files
    services.start_fetches()  # no worker consumes the broker here: the states show the limit
    states = sorted(version.files.values_list("state", flat=True))
    assert states.count("downloading") == 2 and states.count("queued") == 3


def test_removing_a_version_frees_its_files(hub: HubServer, eager: Any) -> None:
    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    path = version.files.get().local_path
    from apps.catalog.models import Model

    model = Model.objects.create(
        name="tiny", source=services.node_path(version, "tiny-Q4_K_M.gguf"), min_replicas=0, max_replicas=1
    )
    with pytest.raises(MirrorError, match="is the source of tiny: change or delete those models first"):
        services.remove_version(version)
    model.delete()
    with eager(execute=True):
        freed = services.remove_version(version)
    assert freed == len(hub.repos["acme/tiny-GGUF"].files["tiny-Q4_K_M.gguf"])
    assert not path.exists() and not MirrorVersion.objects.exists()


def test_nodes_are_told_what_to_fetch_and_fetch_it_with_their_credential(
    hub: HubServer, eager: Any, client: Any
) -> None:
    from apps.catalog.models import Model
    from apps.cluster.enrolment import create_enrollment, enroll_node
    from apps.cluster.reconciler import desired_message

    with eager(execute=True):
        (version,) = services.add_sources([f"{hub.url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"])
    node, credential = enroll_node(create_enrollment("n1", actor=None).secret)
    assert desired_message(node, 1)["mirror"] == []  # no model is served from it yet
    source = services.node_path(version, "tiny-Q4_K_M.gguf")
    Model.objects.create(name="tiny", source=source, min_replicas=0, max_replicas=1)
    (wanted,) = desired_message(node, 2)["mirror"]
    assert wanted["dir"] == services.node_dir(version) and source.startswith(wanted["dir"] + "/")
    (file,) = wanted["files"]
    data = hub.repos["acme/tiny-GGUF"].files["tiny-Q4_K_M.gguf"]
    assert file == {
        "path": "tiny-Q4_K_M.gguf",
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "url": f"/api/v1/mirror-files/{version.pk}/tiny-Q4_K_M.gguf",
    }
    assert client.get(file["url"]).status_code == 401  # a node credential, or staff
    whole = client.get(file["url"], HTTP_AUTHORIZATION=f"Bearer {credential}")
    assert whole.status_code == 200 and b"".join(whole.streaming_content) == data
    part = client.get(file["url"], HTTP_AUTHORIZATION=f"Bearer {credential}", HTTP_RANGE="bytes=100-199")
    assert part.status_code == 206 and part["Content-Range"] == f"bytes 100-199/{len(data)}"
    assert b"".join(part.streaming_content) == data[100:200]
