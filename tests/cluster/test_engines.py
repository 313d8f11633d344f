"""Engines decided on the control plane: choices, server.yaml, releases read from a server that
speaks GitHub's API, what a node is sent, what it reports back, the API, ctl and the pages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent import protocol
from agent.bounded import size_text
from apps.accounts.models import AuditEvent
from apps.cluster import actions, engines, enrolment, reports
from apps.cluster.models import EngineChoice, EngineRelease, Node
from apps.cluster.placement.filters import engine as engine_filter
from apps.cluster.reconciler import desired_message
from tests.builders import make_node
from tests.conftest import make_user
from tests.engine_releases import ReleaseServer, sha256_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(db: Any) -> Any:
    from apps.accounts.choices import StaffRole

    return make_user("olga@example.com", role=StaffRole.OPERATOR, name="Olga")


def rules(data: Any) -> list[tuple[str, str, str, str]]:
    return [(r.engine, r.version, r.scope, r.match) for r in engines.parse_engine_config(data)]


def test_server_yaml_engines_are_read_strictly() -> None:
    assert rules({"llama.cpp": "b11070", "overrides": [{"gpu_class": "V100-16GB", "llama.cpp": "b10000"}]}) == [
        ("llama.cpp", "b11070", "all", ""),
        ("llama.cpp", "b10000", "gpu_class", "V100-16GB"),
    ]
    assert rules({"overrides": [{"label": "rack=r12", "llama.cpp": "none"}, {"node": "n3", "llama.cpp": "b1"}]}) == [
        ("llama.cpp", "none", "label", "rack=r12"),
        ("llama.cpp", "b1", "node", "n3"),
    ]
    for bad, fragment in (
        ({"llama.ccp": "b1"}, "unknown engine llama.ccp"),
        ({"llama.cpp": 11070}, "engines.llama.cpp: expected a release tag"),
        ({"llama.cpp": "b1; rm -rf /"}, "expected a release tag"),
        ({"overrides": [{"gpu_klass": "x", "llama.cpp": "b1"}]}, "exactly one of gpu_class, label or node"),
        ({"overrides": [{"node": "n1", "llama.cpp": "b1", "vlm": "1"}]}, "engines.overrides[0].vlm: unknown field"),
        ({"overrides": [{"label": "rack", "llama.cpp": "b1"}]}, "label: expected key=value"),
        ({"overrides": [{"node": "n1"}]}, "names no engine"),
        (["llama.cpp"], "expected a mapping"),
    ):
        with pytest.raises(engines.EngineConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            engines.parse_engine_config(bad)


def test_the_most_specific_choice_wins_and_a_disabled_engine_is_off() -> None:
    node = make_node("n1", gpus=2, labels={"rack": "r12"})
    assert engines.choices_for(node)["llama.cpp"][0] == engines.DEFAULT_VERSIONS["llama.cpp"]
    engines.apply_engine_config(
        {
            "llama.cpp": "b1",
            "overrides": [
                {"gpu_class": "H100-80GB", "llama.cpp": "b2"},
                {"label": "rack=r12", "llama.cpp": "b3"},
            ],
        }
    )
    assert engines.choices_for(node)["llama.cpp"][0] == "b3"
    engines.set_choice("llama.cpp", "b4", "node", "n1")
    assert engines.choices_for(node)["llama.cpp"][0] == "b4"
    other = make_node("n2", gpus=0)
    assert engines.choices_for(other)["llama.cpp"][0] == "b1"
    actions.set_disabled_engines(other, disable=["llama.cpp"], enable=[], actor=None)
    other.refresh_from_db()
    assert engines.choices_for(other)["llama.cpp"][0] == "none"
    assert desired_message(other, 1)["engines"] == []
    assert engines.wanted_versions() == {("llama.cpp", "b4")}
    # a node running the binary its agent.yaml names needs no release read for it
    Node.objects.filter(pk=node.pk).update(hardware={**node.hardware, "engine_sources": {"llama.cpp": "configured"}})
    assert engines.wanted_versions() == set()
    # server.yaml states the whole set: applying it again without the overrides drops them
    engines.apply_engine_config({"llama.cpp": "b1"})
    assert list(EngineChoice.objects.values_list("scope", flat=True)) == ["all"]
    assert AuditEvent.objects.filter(action="engine.remove").count() == 3  # gpu_class, label, node


def test_releases_are_read_once_from_the_releases_api_and_sent_to_the_nodes(settings: Any, tmp_path: Path) -> None:
    archive = tmp_path / "llama-b7-bin-ubuntu-x64.tar.gz"
    archive.write_bytes(b"not really an archive")
    node = make_node("n1")
    engines.set_choice("llama.cpp", "b7")
    first = desired_message(node, 1)["engines"]
    assert first == [
        {
            "engine": "llama.cpp",
            "version": "b7",
            "note": "the control plane has not read release b7 yet",
            "source": engines.SOURCE_BUILDS["llama.cpp"],  # compiled on a CPU node when nothing else can be had
            # it holds no archive of b7 either: the node is told the command that gives it one
            "fix": "on the control plane, run “llmgw engine-files fetch b7” where GitHub can be reached, or copy "
            "this node's archive of release b7 in with “llmgw engine-files add FILE”",
        }
    ]
    # nothing answers: the reason reaches the node, and it is not asked again for ten minutes
    engines.fetch_wanted_releases()
    (release,) = EngineRelease.objects.all()
    assert release.fetched_at is None and "cannot reach http://127.0.0.1:9/repos/ggml-org/llama.cpp" in release.error
    unreachable = desired_message(node, 2)["engines"][0]
    assert "the control plane cannot read release b7: cannot reach" in unreachable["note"]
    assert unreachable["unreachable"] is True
    # a CPU node that refuses an archive compiles in its place only where the operator allowed it
    assert "after_refusal" not in unreachable["source"]
    settings.ENGINE_SOURCE_AFTER_REFUSAL = True
    allowed = desired_message(node, 2)
    protocol.parse_message(protocol.encode("desired", allowed), expect="server")  # as the agent reads it
    assert allowed["engines"][0]["source"] == {**engines.SOURCE_BUILDS["llama.cpp"], "after_refusal": True}
    assert "after_refusal" not in engines.SOURCE_BUILDS["llama.cpp"]  # the shared table is left as it was
    settings.ENGINE_SOURCE_AFTER_REFUSAL = False
    with ReleaseServer() as github:  # an API that answers, but has no such release
        settings.ENGINE_RELEASES_API = github.url
        engines.fetch_release("llama.cpp", "b7")
        missing = desired_message(node, 2)["engines"][0]
        assert "HTTP 404" in missing["note"] and missing["unreachable"] is False
        settings.ENGINE_RELEASES_API = "http://127.0.0.1:9"
    engines.fetch_release("llama.cpp", "b7")
    assert engines.fetch_wanted_releases() == []
    with ReleaseServer() as github:
        github.add("b7", archive)
        settings.ENGINE_RELEASES_API = github.url
        settings.ENGINE_RELEASES_TOKEN = "ghp_test"
        EngineRelease.objects.update(tried_at=None)
        before = Node.objects.get(pk=node.pk).desired_version
        engines.fetch_wanted_releases()
        assert github.requests == ["/repos/ggml-org/llama.cpp/releases/tags/b7"]
    assert Node.objects.get(pk=node.pk).desired_version == before + 1  # the node hears of it
    (sent,) = desired_message(node, 3)["engines"]
    (asset,) = sent["assets"]
    assert asset["name"] == archive.name and asset["digest"] == "sha256:" + sha256_of(archive)
    assert asset["urls"] == [f"{github.url}/ggml-org/llama.cpp/releases/download/b7/{archive.name}"]
    # the message passes the agent's own schema
    protocol.parse_message(protocol.encode("desired", desired_message(node, 3)), expect="server")
    # once the control plane holds the file itself it is offered first, at its own address
    settings.ENGINE_FILES_DIR = str(tmp_path / "held")
    with open(archive, "rb") as handle:
        engines.store_file(archive.name, iter(lambda: handle.read(7), b""))
    assert desired_message(node, 4)["engines"][0]["assets"][0]["urls"][0] == f"/api/v1/engine-files/{archive.name}"


def test_an_unreachable_releases_api_is_logged_once_and_again_only_when_that_changes(
    settings: Any, tmp_path: Path, caplog: Any
) -> None:
    """The worker retries a failed read every ten minutes: offline, that was a warning every ten
    minutes for ever. It is said when the state changes (read, unreachable, refused), not per retry."""
    archive = tmp_path / "llama-b7-bin-ubuntu-x64.tar.gz"
    archive.write_bytes(b"not really an archive")

    def said() -> list[tuple[str, str]]:
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == engines.log.name]
        caplog.clear()
        return lines

    caplog.set_level("INFO", logger=engines.log.name)
    for _retry in range(3):  # offline: three retries, one line
        engines.fetch_release("llama.cpp", "b7")
    ((level, text),) = said()
    assert level == "WARNING" and "engine release llama.cpp b7: cannot reach http://127.0.0.1:9/" in text
    assert "tried again every 10 minutes; logged again only when this changes" in text
    with ReleaseServer() as github:
        settings.ENGINE_RELEASES_API = github.url
        engines.fetch_release("llama.cpp", "b7")  # reachable now, but no such release: a new state
        engines.fetch_release("llama.cpp", "b7")
        ((level, text),) = said()
        assert level == "WARNING" and "HTTP 404" in text
        github.add("b7", archive)
        engines.fetch_release("llama.cpp", "b7")
        ((level, text),) = said()
        assert level == "INFO" and text.startswith("engine release llama.cpp b7: read (it had failed: HTTP 404")
    settings.ENGINE_RELEASES_API = "http://127.0.0.1:9"
    engines.fetch_release("llama.cpp", "b7")
    engines.fetch_release("llama.cpp", "b7")
    assert [level for level, _text in said()] == ["WARNING"]


def test_a_hostile_release_listing_never_spoils_what_nodes_are_sent(settings: Any, tmp_path: Path) -> None:
    archive = tmp_path / "llama-b7-bin-ubuntu-x64.tar.gz"
    archive.write_bytes(b"not really an archive")
    node = make_node("n1")
    engines.set_choice("llama.cpp", "b7")
    with ReleaseServer() as github:
        github.add("b7", archive)
        honest = github.release("b7")["assets"][0]
        forged = [
            {**honest, "size": 2**70},
            {**honest, "name": "llama-b7-bin-ubuntu-vulkan-x64.tar.gz", "size": True},
            {**honest, "name": "llama-b7-bin-ubuntu-arm64.tar.gz", "size": -1, "browser_download_url": "x" * 5000},
            {**honest, "name": "llama-b7-bin-ubuntu-rocm-x64.tar.gz", "browser_download_url": "file:///etc/passwd"},
            {**honest, "name": "../../llama-b7.tar.gz"},
            {**honest, "name": "llama\x00.tar.gz"},
            {**honest, "name": "n" * 301},
        ]
        github.release = lambda tag: {"tag_name": tag, "assets": forged}  # type: ignore[method-assign]
        settings.ENGINE_RELEASES_API = github.url
        release = engines.fetch_release("llama.cpp", "b7")
    assert release.error == ""
    assert [(a["name"], a["size"], a["browser_download_url"] is not None) for a in release.assets] == [
        (archive.name, None, True),
        ("llama-b7-bin-ubuntu-vulkan-x64.tar.gz", None, True),
        ("llama-b7-bin-ubuntu-arm64.tar.gz", None, False),
        ("llama-b7-bin-ubuntu-rocm-x64.tar.gz", 21, False),
    ]
    # what the node is sent passes the agent's own schema
    protocol.parse_message(protocol.encode("desired", desired_message(node, 1)), expect="server")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "did not answer a release"),
        (b" " * (engines.MAX_LISTING_BYTES + 1), "the answer is larger than 16 MiB"),
    ],
)
def test_a_release_listing_too_deep_or_too_large_is_an_error_not_a_crash(
    settings: Any, body: bytes, reason: str
) -> None:
    with ReleaseServer() as github:
        github.answer = lambda handler: github._send(handler, 200, body, "application/json")  # type: ignore[method-assign]
        settings.ENGINE_RELEASES_API = github.url
        release = engines.fetch_release("llama.cpp", "b7")
    assert release.fetched_at is None and reason in release.error


def test_the_releases_api_is_not_followed_to_the_control_plane_and_keeps_its_token(settings: Any) -> None:
    """A releases API (hostile, or taken over) answers with a redirect to the control plane's own
    /metrics: it is not followed, and the token for the API is never sent to another host."""
    from tests.localhttp import LocalHTTP

    asked: list[tuple[str, str | None]] = []

    def plane(handler: Any, head: bool) -> None:
        asked.append((handler.path, handler.headers.get("Authorization")))
        handler.send_response(200)
        handler.send_header("Content-Length", "2")
        handler.end_headers()
        handler.wfile.write(b"{}")

    control = LocalHTTP(plane)
    control.start()
    try:
        with ReleaseServer() as github:

            def moved(handler: Any) -> None:
                handler.send_response(302)
                handler.send_header("Location", f"{control.base}/metrics")
                handler.send_header("Content-Length", "0")
                handler.end_headers()

            github.answer = moved  # type: ignore[method-assign]
            settings.ENGINE_RELEASES_API = github.url
            settings.ENGINE_RELEASES_TOKEN = "ghp_secret"
            settings.LISTEN = ("127.0.0.1", control.httpd.server_address[1])
            release = engines.fetch_release("llama.cpp", "b7")
    finally:
        control.stop()
    assert asked == []
    assert release.fetched_at is None and "is the control plane itself" in release.error, release.error


def test_engine_files_are_served_to_nodes_only(client: Any, settings: Any, tmp_path: Path) -> None:
    settings.ENGINE_FILES_DIR = str(tmp_path)
    engines.store_file("llama-b7-bin-ubuntu-x64.tar.gz", [b"abc", b"def"])
    node, credential = enrolment.enroll_node(enrolment.create_enrollment("n1", actor=None).secret)
    url = "/api/v1/engine-files/llama-b7-bin-ubuntu-x64.tar.gz"
    assert client.get(url).status_code == 401
    assert client.get(url, HTTP_AUTHORIZATION="Bearer llmgwn_wrong").status_code == 401
    answer = client.get(url, HTTP_AUTHORIZATION=f"Bearer {credential}")
    assert answer.status_code == 200 and b"".join(answer.streaming_content) == b"abcdef"
    missing = client.get("/api/v1/engine-files/nope.tar.gz", HTTP_AUTHORIZATION=f"Bearer {credential}")
    assert missing.status_code == 404 and "nope.tar.gz" in missing.json()["detail"]
    assert (
        client.get("/api/v1/engine-files/..%2F..%2Fsecret", HTTP_AUTHORIZATION=f"Bearer {credential}").status_code
        == 404
    )
    with pytest.raises(engines.EngineConfigError):
        engines.store_file("../escape", [b"x"])


def test_what_a_node_reports_of_its_engines_is_kept_and_refuses_with_its_words() -> None:
    node = make_node("n1", engines=())
    reports.record_engines(
        node.pk,
        {
            "engines": [],
            "engine_versions": {},
            "engines_probed": True,
            "engine_status": {"llama.cpp": "installing: downloading llama-b7-bin-ubuntu-x64.tar.gz (16 MB, 40 %)"},
        },
    )
    from apps.cluster.inventory import _snapshot

    node.refresh_from_db()
    snapshot = _snapshot(node)

    class Ctx:
        class profile:  # noqa: N801 - a stand-in for the placement context's profile
            engine = "llama.cpp"

    reason = engine_filter(Ctx, snapshot)  # type: ignore[arg-type]
    assert reason is not None
    assert reason.message() == (
        "node n1 does not run the llama.cpp engine yet: installing: downloading "
        "llama-b7-bin-ubuntu-x64.tar.gz (16 MB, 40 %)"
    )
    assert reports.record_engines(node.pk, {"engines": ["llama.cpp"], "engine_status": {}}) is True
    assert reports.record_engines(node.pk, {"engines": ["llama.cpp"], "engine_status": {}}) is False
    assert AuditEvent.objects.filter(action="node.engines").count() == 1


def test_the_engines_api_and_ctl(api: Any, operator: Any, capsys: Any) -> None:
    api.force_authenticate(operator)
    answer = api.get("/api/v1/engines").json()
    assert answer["defaults"] == engines.DEFAULT_VERSIONS and answer["choices"] == []
    answer = api.post(
        "/api/v1/engines",
        {"engine": "llama.cpp", "version": "b9", "scope": "gpu_class", "match": "L4-24GB"},
        format="json",
    )
    assert answer.status_code == 200
    assert answer.json()["choices"][0] | {"updated_at": None} == {
        "engine": "llama.cpp",
        "version": "b9",
        "scope": "gpu_class",
        "match": "L4-24GB",
        "updated_at": None,
    }
    again = api.post(
        "/api/v1/engines",
        {"engine": "llama.cpp", "version": "b10", "scope": "gpu_class", "match": "L4-24GB"},
        format="json",
    )
    assert again.status_code == 200 and again.json()["choices"][0]["version"] == "b10"  # set again, not refused
    bad = api.post("/api/v1/engines", {"engine": "llama.cpp", "version": "b9 b10"}, format="json")
    assert bad.status_code == 400 and "release tag" in json.dumps(bad.json())
    unknown = api.post("/api/v1/engines", {"engine": "ollama", "version": "1"}, format="json")
    assert unknown.status_code == 400
    assert api.post("/api/v1/engines/remove", {"engine": "llama.cpp"}, format="json").status_code == 404
    gone = api.post(
        "/api/v1/engines/remove", {"engine": "llama.cpp", "scope": "gpu_class", "match": "L4-24GB"}, format="json"
    )
    assert gone.status_code == 200 and gone.json()["choices"] == []
    assert AuditEvent.objects.filter(action__in=["engine.set", "engine.remove"], actor=operator).count() == 3
    make_node("n1")
    node = api.post("/api/v1/nodes/n1/engines", {"disable": ["llama.cpp"]}, format="json").json()
    assert node["disabled_engines"] == ["llama.cpp"] and node["engine_status"] == {}
    node = api.post("/api/v1/nodes/n1/engines", {"enable": ["llama.cpp"]}, format="json").json()
    assert node["disabled_engines"] == []
    made = api.post(
        "/api/v1/nodes/enrollments", {"name": "n2", "disabled_engines": ["llama.cpp"]}, format="json"
    ).json()
    joined, _ = enrolment.enroll_node(made["token"])
    assert joined.disabled_engines == ["llama.cpp"]


def test_a_viewer_reads_engines_but_cannot_change_them(api: Any) -> None:
    from apps.accounts.choices import StaffRole

    api.force_authenticate(make_user("vic@example.com", role=StaffRole.VIEWER))
    assert api.post("/api/v1/engines", {"engine": "llama.cpp", "version": "b9"}, format="json").status_code == 403


def test_the_pages_show_what_nodes_install_and_operators_set_versions_there(client: Any, operator: Any) -> None:
    node = make_node("n1", engines=())
    reports.record_engines(node.pk, {"engines": [], "engine_status": {"llama.cpp": "failed: cpu-x64: digest mismatch"}})
    client.force_login(operator)
    for url in ("/nodes/", "/cluster/", "/nodes/n1/"):
        page = client.get(url).content.decode()
        assert 'data-engine-status="llama.cpp">llama.cpp failed: cpu-x64: digest mismatch<' in page, url
    page = client.get("/nodes/n1/").content.decode()
    assert 'data-engine-row="llama.cpp"' in page and engines.DEFAULT_VERSIONS["llama.cpp"] in page
    answer = client.post(
        "/cluster/engines/set", {"engine": "llama.cpp", "version": "b5", "scope": "label", "match": "rack=r1"}
    )
    assert answer.status_code == 302
    assert EngineChoice.objects.get().match == "rack=r1"
    page = client.get("/cluster/").content.decode()
    assert 'data-rule="label:rack=r1"' in page and "not read yet" in page
    client.post("/cluster/engines/set", {"engine": "llama.cpp", "version": "b5 oops"})
    assert EngineChoice.objects.count() == 1
    page = client.get("/cluster/").content.decode()
    assert "expected a release tag" in page
    client.post("/cluster/engines/remove", {"engine": "llama.cpp", "scope": "label", "match": "rack=r1"})
    assert not EngineChoice.objects.exists()


# --------------------------------------------------------------------------- a site without GitHub

GPU_HARDWARE = {
    "arch": "x86_64",
    "driver_version": "580.65.06",
    "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "architecture": "Hopper"}],
    "engines": [],
}


def release_files(folder: Path, tag: str) -> dict[str, Path]:
    """A release's archives as llama.cpp names them (their bytes stand in: nodes do not run them here)."""
    folder.mkdir(parents=True, exist_ok=True)
    names = {
        "cpu": f"llama-{tag}-bin-ubuntu-x64.tar.gz",
        "arm": f"llama-{tag}-bin-ubuntu-arm64.tar.gz",
        "cuda": f"llama-{tag}-bin-ubuntu-cuda-12.8-x64.tar.gz",
        "cudart": f"cudart-llama-{tag}-bin-ubuntu-cuda-12.8-x64.tar.gz",
        "vulkan": f"llama-{tag}-bin-ubuntu-vulkan-x64.tar.gz",
    }
    files = {}
    for key, name in names.items():
        files[key] = folder / name
        files[key].write_bytes(f"{name} of {tag}\n".encode() * 100)
    return files


def offered_urls(node: Node, generation: int) -> dict[str, list[str]]:
    sent = desired_message(node, generation)
    protocol.parse_message(protocol.encode("desired", sent), expect="server")  # as the agent reads it
    return {asset["name"]: asset["urls"] for asset in sent["engines"][0].get("assets", [])}


def test_archives_the_control_plane_holds_are_offered_whatever_github_says(
    client: Any, operator: Any, settings: Any, tmp_path: Path, capsys: Any
) -> None:
    """Offline: GitHub cannot be reached and no listing was ever read. It once offered nothing
    (GPU nodes waited for ever, CPU nodes compiled for 18 minutes) even with the archive held."""
    from llmgw.cli import main

    settings.ENGINE_FILES_DIR = str(tmp_path / "held")
    cpu = make_node("cpu1", hardware={"arch": "x86_64", "engines": []})
    gpu = make_node("gpu1", gpus=1, hardware=GPU_HARDWARE)
    engines.set_choice("llama.cpp", "b7")
    engines.fetch_wanted_releases()  # cannot reach the releases API
    client.force_login(operator)
    # Neither a listing nor an archive: each node is told the command, and its page says so.
    for node in (cpu, gpu):
        sent = desired_message(node, 1)["engines"][0]
        assert "assets" not in sent and "llmgw engine-files fetch b7" in sent["fix"]
        page = client.get(f"/nodes/{node.name}/").content.decode()
        offer = page[page.index('data-engine-offer="llama.cpp"') :]
        assert "The control plane cannot read release b7 (cannot reach http://127.0.0.1:9/" in offer
        assert "holds no archive of it that suits this node: on the control plane, run" in offer
    # The CPU build is copied in: offered to the CPU node at the control plane's address, with the
    # digest it was stored with, and to no GPU node (it would never run it).
    files = release_files(tmp_path / "usb-stick", "b7")
    assert main(["engine-files", "add", str(files["cpu"])]) == 0
    size = files["cpu"].stat().st_size
    assert f"{files['cpu'].name}: {size} bytes, sha256 {sha256_of(files['cpu'])}" in capsys.readouterr().out
    sent = desired_message(cpu, 2)["engines"][0]
    assert sent["assets"] == [
        {
            "name": files["cpu"].name,
            "size": size,
            "digest": "sha256:" + sha256_of(files["cpu"]),
            "urls": [f"/api/v1/engine-files/{files['cpu'].name}"],
        }
    ]
    assert "fix" not in sent and "cannot read release b7" in sent["note"]
    assert "data-engine-offer" not in client.get("/nodes/cpu1/").content.decode()
    assert "fix" in desired_message(gpu, 2)["engines"][0]
    assert 'data-engine-offer="llama.cpp"' in client.get("/nodes/gpu1/").content.decode()
    # The old form of the command still adds, and `list` shows what is held.
    assert main(["engine-files", str(files["cuda"]), str(files["cudart"])]) == 0
    assert main(["engine-files", "list"]) == 0
    listed = capsys.readouterr().out
    size = files["cudart"].stat().st_size
    assert f"{files['cudart'].name}: {size} bytes, sha256 {sha256_of(files['cudart'])}" in listed
    assert set(offered_urls(gpu, 3)) == {files["cpu"].name, files["cuda"].name, files["cudart"].name}
    assert "fix" not in desired_message(gpu, 3)["engines"][0]
    # A listing read later that disagrees with a held copy: that copy is not offered, GitHub's is.
    with ReleaseServer() as github:
        other = release_files(tmp_path / "github", "b7")
        other["cpu"].write_bytes(b"another build")
        github.add("b7", other["cpu"])
        github.add("b7", other["cuda"])
        settings.ENGINE_RELEASES_API = github.url
        engines.fetch_release("llama.cpp", "b7")
        urls = offered_urls(cpu, 4)
    assert urls[files["cpu"].name] == [f"{github.url}/ggml-org/llama.cpp/releases/download/b7/{files['cpu'].name}"]
    assert urls[files["cuda"].name][0] == f"/api/v1/engine-files/{files['cuda'].name}"  # the same file: held first
    assert urls[files["cudart"].name] == [f"/api/v1/engine-files/{files['cudart'].name}"]  # not listed, held


def test_engine_files_fetch_takes_once_the_builds_the_fleet_needs(settings: Any, tmp_path: Path, capsys: Any) -> None:
    from llmgw.cli import main
    from tests.conftest import CLOSED_RELEASES_API

    settings.ENGINE_FILES_DIR = str(tmp_path / "held")
    files = release_files(tmp_path / "release", "b7")
    cpu = make_node("cpu1", hardware={"arch": "x86_64", "engines": []})
    arm = make_node("arm1", hardware={"arch": "aarch64", "engines": []})
    gpu = make_node("gpu1", gpus=1, hardware=GPU_HARDWARE)
    make_node("off1", hardware={"arch": "x86_64", "engines": []}, disabled_engines=["llama.cpp"])
    make_node("new1", hardware={})
    engines.set_choice("llama.cpp", "b7")
    with ReleaseServer() as github:
        for path in files.values():
            github.add("b7", path)
        settings.ENGINE_RELEASES_API = github.url
        assert main(["engine-files", "fetch", "b7"]) == 0
        out = capsys.readouterr().out
        size = size_text(files["cpu"].stat().st_size)
        assert f"{files['cpu'].name}: fetched: {size}, sha256 {sha256_of(files['cpu'])} (for cpu1)" in out
        assert f"{files['arm'].name}: fetched: " in out and "(for arm1)" in out
        assert f"{files['cuda'].name}: fetched: " in out and f"{files['cudart'].name}: fetched: " in out
        assert files["vulkan"].name not in out  # no node's best build
        assert "node off1: no archive of b7 needed: the engine is kept off this node" in out
        assert "node new1: no archive of b7 needed: it has not reported its hardware yet" in out
        assert sorted(engines.held_files()) == sorted(files[k].name for k in ("cpu", "arm", "cuda", "cudart"))
        fetched = [path for path in github.requests if path.startswith("/objects/")]
        assert len(fetched) == 4
        # Once is enough: asked again, nothing is downloaded.
        assert main(["engine-files", "fetch", "b7"]) == 0
        assert f"{files['cpu'].name}: held: " in capsys.readouterr().out
        assert [path for path in github.requests if path.startswith("/objects/")] == fetched
    # GitHub gone: every node has its archive from the control plane first.
    settings.ENGINE_RELEASES_API = CLOSED_RELEASES_API
    engines.fetch_release("llama.cpp", "b7")  # fails, and the listing read before is kept
    for node, key in ((cpu, "cpu"), (arm, "arm"), (gpu, "cuda"), (gpu, "cudart")):
        assert offered_urls(node, 2)[files[key].name][0] == f"/api/v1/engine-files/{files[key].name}"
        assert "fix" not in desired_message(node, 2)["engines"][0]


def test_engine_files_fetch_keeps_no_file_that_is_not_the_one_listed_and_says_why(
    settings: Any, tmp_path: Path, capsys: Any
) -> None:
    from llmgw.cli import main

    settings.ENGINE_FILES_DIR = str(tmp_path / "held")
    files = release_files(tmp_path / "release", "b7")
    make_node("cpu1", hardware={"arch": "x86_64", "engines": []})
    with pytest.raises(
        SystemExit, match="llmgw engine-files: cannot read release b7: cannot reach http://127.0.0.1:9/"
    ):
        main(["engine-files", "fetch", "b7"])
    with ReleaseServer() as github:
        for path in files.values():
            github.add("b7", path)
        github.digest_override[files["cpu"].name] = "sha256:" + "0" * 64
        settings.ENGINE_RELEASES_API = github.url
        assert main(["engine-files", "fetch", "b7", "--asset", files["vulkan"].name]) == 1
        out = capsys.readouterr().out
        assert f"{files['cpu'].name}: failed: {files['cpu'].name}: its sha256 is " in out
        assert "the release lists 000000000000" in out
        assert f"{files['vulkan'].name}: fetched: " in out  # named, though no node's build
        with pytest.raises(SystemExit, match="release b7 lists no llama-b7-bin-macos-arm64.zip"):
            main(["engine-files", "fetch", "b7", "--asset", "llama-b7-bin-macos-arm64.zip"])
    assert sorted(engines.held_files()) == [files["vulkan"].name]
    assert not list(Path(settings.ENGINE_FILES_DIR).glob(".*.part"))
    with pytest.raises(SystemExit, match="vllm is installed from the package index"):
        main(["engine-files", "fetch", "0.11.0", "--engine", "vllm"])


def test_a_refused_archive_stays_on_the_node_page_beside_what_the_node_really_runs(client: Any, operator: Any) -> None:
    """The node's refusal (an archive whose sha256 is not the published one) is its status on the
    node page and in placement's refusal; a compiled build in its place is shown as what it is."""
    from html import unescape

    from apps.cluster.inventory import _snapshot

    refused = "refused: llama-b7-bin-ubuntu-x64.tar.gz: digest mismatch: got 0a1b2c3d, expected 00000000"
    node = make_node("cpu1", engines=(), hardware={"arch": "x86_64"})
    engines.set_choice("llama.cpp", "b7")
    waiting = (
        f"{refused}; not compiled from llama-cpp-python 0.3.36 in its place: the control plane allows that only "
        "with LLMGW_ENGINE_SOURCE_AFTER_REFUSAL"
    )
    reports.record_engines(
        node.pk, {"engines": [], "engine_versions": {}, "engines_probed": True, "engine_status": {"llama.cpp": waiting}}
    )
    client.force_login(operator)

    def row() -> str:
        page = client.get("/nodes/cpu1/").content.decode()
        start = page.index('<tr data-engine-row="llama.cpp">')
        return unescape(page[start : page.index("</tr>", start)])

    assert ">b7</td>" in row() and "<td>-</td>" in row() and waiting in row()

    class Ctx:
        class profile:  # noqa: N801 - a stand-in for the placement context's profile
            engine = "llama.cpp"

    node.refresh_from_db()
    reason = engine_filter(Ctx, _snapshot(node))  # type: ignore[arg-type]
    assert reason is not None and waiting in reason.message()
    # Allowed to compile in its place: it runs the source build and says so, the refusal kept.
    compiled = "llama-cpp-python 0.3.36 source"
    kept = (
        f"{refused}; running llama.cpp compiled from llama-cpp-python 0.3.36 in its place, as the control plane "
        "allows (LLMGW_ENGINE_SOURCE_AFTER_REFUSAL)"
    )
    reports.record_engines(
        node.pk,
        {
            "engines": ["llama.cpp"],
            "engine_versions": {"llama.cpp": compiled},
            "engines_probed": True,
            "engine_status": {"llama.cpp": kept},
        },
    )
    assert ">b7</td>" in row() and f"<td>{compiled}</td>" in row() and kept in row()
