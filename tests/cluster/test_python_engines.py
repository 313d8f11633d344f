"""vLLM and SGLang, decided here and built by the nodes: the releases the control plane reads for
them (the engine's own and uv's), what each node is sent, its build choice (console, API, ctl),
and the version an older GPU gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent import protocol
from agent.install.manager import parse_desired_engines
from apps.accounts.models import AuditEvent
from apps.cluster import engines, reports
from apps.cluster.models import EngineRelease, Node
from apps.cluster.reconciler import desired_message
from tests.builders import make_node
from tests.conftest import make_user
from tests.engine_releases import ReleaseServer, sha256_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(db: Any) -> Any:
    from apps.accounts.choices import StaffRole

    return make_user("ops@example.com", role=StaffRole.OPERATOR)


def vllm_entry(node: Node) -> dict[str, Any]:
    (entry,) = [e for e in desired_message(node, 1)["engines"] if e["engine"] == "vllm"]
    return entry


def test_vllm_is_sent_with_its_wheels_and_uv_once_both_releases_are_read(settings: Any, tmp_path: Path) -> None:
    wheel = tmp_path / "vllm-0.11.0+cu130-cp38-abi3-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"wheel")
    uv = tmp_path / "uv-x86_64-unknown-linux-gnu.tar.gz"
    uv.write_bytes(b"uv")
    sidecar = tmp_path / (uv.name + ".sha256")
    sidecar.write_text(f"{sha256_of(uv)}  {uv.name}\n")
    node = make_node("g1", gpus=2)
    assert "vllm" not in {e["engine"] for e in desired_message(node, 1)["engines"]}  # no default: opt in
    engines.set_choice("vllm", "0.11.0")
    assert engines.wanted_versions() == {
        ("llama.cpp", engines.DEFAULT_VERSIONS["llama.cpp"]),
        ("vllm", "0.11.0"),
        ("uv", engines.UV_VERSION),
    }
    waiting = vllm_entry(node)
    assert waiting["note"] == "the control plane has not read release 0.11.0 yet" and "assets" not in waiting

    with ReleaseServer("vllm-project/vllm") as github:
        github.add("v0.11.0", wheel)
        settings.ENGINE_RELEASES_API = github.url
        engines.fetch_release("vllm", "0.11.0")
        assert github.requests == ["/repos/vllm-project/vllm/releases/tags/v0.11.0"]  # vLLM's tags start with v
    assert "assets" not in vllm_entry(node)  # uv's release is not read yet
    with ReleaseServer("astral-sh/uv") as github:
        github.add(engines.UV_VERSION, uv)
        github.add(engines.UV_VERSION, sidecar)
        settings.ENGINE_RELEASES_API = github.url
        engines.fetch_release("uv", engines.UV_VERSION)

    entry = vllm_entry(node)
    assert [a["name"] for a in entry["assets"]] == [wheel.name]
    assert [a["name"] for a in entry["uv"]["assets"]] == [uv.name, sidecar.name]
    assert entry["uv"]["version"] == engines.UV_VERSION
    assert entry | {"assets": None, "uv": None} == {
        "engine": "vllm",
        "version": "0.11.0",
        "build": "auto",
        "index_variant": "cu129",
        "torch_index": "https://download.pytorch.org/whl/{variant}",
        "min_compute": "7.0",  # 0.11 was still built for Volta
        "min_free_bytes": 25 * 10**9,
        "assets": None,
        "uv": None,
    }
    # The message passes the agent's schema, and the agent reads what it needs from it.
    message = protocol.parse_message(protocol.encode("desired", desired_message(node, 2)), expect="server")
    (item,) = [i for i in parse_desired_engines(message.body["engines"]) if i.engine == "vllm"]
    assert item.listed and item.python is not None
    assert item.python.uv_version == engines.UV_VERSION and len(item.python.uv_assets) == 2
    assert item.python.min_compute == (7, 0) and item.python.min_free_bytes == 25 * 10**9


def test_a_release_the_api_cannot_give_still_lets_nodes_install_the_index_build(settings: Any) -> None:
    node = make_node("g1", gpus=1)
    engines.set_choice("vllm", "0.11.0")
    engines.fetch_wanted_releases()  # the API (a closed port) is not there
    assert {(r.engine, r.version) for r in EngineRelease.objects.all()} >= {("vllm", "0.11.0"), ("uv", "0.13.9")}
    entry = vllm_entry(node)
    assert entry["assets"] == [] and entry["uv"]["assets"] == []
    assert entry["note"].startswith("the control plane cannot read vllm 0.11.0: cannot reach")
    assert entry["note"].endswith("the package index's build is used")


def test_older_gpus_get_the_newest_vllm_built_for_them_and_the_oldest_are_told_why() -> None:
    engines.set_choice("vllm", "0.30.0")
    h100 = make_node("h1", gpus=1)
    v100 = make_node("v1", cards=[{"index": 0, "gpu_class": "V100-32GB", "name": "Tesla V100-SXM2-32GB"}])
    p100 = make_node("p1", cards=[{"index": 0, "gpu_class": "P100-16GB", "name": "Tesla P100-PCIE-16GB"}])
    assert engines.choices_for(h100)["vllm"][0] == "0.30.0"
    version, why = engines.choices_for(v100)["vllm"]
    assert version == "0.11.0"
    assert why == "the newest vLLM built for compute capability 7.0 (0.30.0 needs 7.5 or newer)"
    assert vllm_entry(v100)["min_compute"] == "7.0" and "unsupported" not in vllm_entry(v100)
    entry = vllm_entry(p100)
    assert entry["version"] == "0.30.0"
    assert entry["unsupported"] == (
        "vllm 0.30.0 needs compute capability 7.5 or newer and no version llmgw knows is built for this node's 6.0"
    )
    assert ("vllm", "0.11.0") in engines.wanted_versions() and ("vllm", "0.30.0") in engines.wanted_versions()


def test_the_build_choice_through_the_api_and_the_cluster_page(
    api: Any, client: Any, operator: Any, django_capture_on_commit_callbacks: Any
) -> None:
    node = make_node("g1", gpus=2)
    engines.set_choice("vllm", "0.11.0")
    api.force_authenticate(operator)
    before = Node.objects.get(pk=node.pk).desired_version
    with django_capture_on_commit_callbacks(execute=True):
        answer = api.post("/api/v1/nodes/g1/engine-build", {"build": "cu129"}, format="json")
    assert answer.status_code == 200 and answer.json()["engine_build"] == "cu129"
    assert Node.objects.get(pk=node.pk).desired_version == before + 1  # the node hears at once
    assert vllm_entry(Node.objects.get(pk=node.pk))["build"] == "cu129"
    (event,) = AuditEvent.objects.filter(action="node.engine_build")
    assert event.changes == {"engine_build": ["auto", "cu129"]} and event.actor == operator
    bad = api.post("/api/v1/nodes/g1/engine-build", {"build": "cu118"}, format="json")
    assert bad.status_code == 400 and "cu118" in bad.content.decode()

    none = api.post("/api/v1/nodes/g1/engine-build", {"build": "none"}, format="json").json()
    assert none["engine_build"] == "none"
    node.refresh_from_db()
    assert engines.choices_for(node)["vllm"] == ("none", "this node's vLLM/SGLang build is set to none")
    assert "vllm" not in {e["engine"] for e in desired_message(node, 3)["engines"]}

    client.force_login(operator)
    page = client.get("/cluster/").content.decode()
    assert 'data-build-row="g1"' in page and '<option value="none" selected>' in page
    answer = client.post("/cluster/engine-build/g1", {"build": "cu13"})
    assert answer.status_code == 302 and answer["Location"].endswith("#engine-builds")
    node.refresh_from_db()
    assert node.engine_build == "cu13"
    client.post("/cluster/engine-build/g1", {"build": "cu999"})
    node.refresh_from_db()
    assert node.engine_build == "cu13"
    assert (
        "build: expected one of auto, cu13, cu129, none, got &#x27;cu999&#x27;"
        in client.get("/cluster/").content.decode()
    )


@pytest.mark.django_db(transaction=True)
def test_ctl_engine_build(live_server: Any, key_for: Any, monkeypatch: Any, tmp_path: Path, capsys: Any) -> None:
    from apps.accounts.choices import StaffRole
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    node = make_node("g1", gpus=1)
    reports.record_engines(node.pk, {"engines": ["llama.cpp"], "engine_status": {"vllm": "installing: resolving"}})
    assert main(["ctl", "--server", live_server.url, "--key", secret, "engine-build", "g1", "cu129"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == ["node g1: vLLM/SGLang build cu129", "  vllm installing: resolving"]
    assert Node.objects.get(pk=node.pk).engine_build == "cu129"


def test_a_viewer_cannot_change_a_build(api: Any) -> None:
    from apps.accounts.choices import StaffRole

    make_node("g1", gpus=1)
    api.force_authenticate(make_user("vic@example.com", role=StaffRole.VIEWER))
    assert api.post("/api/v1/nodes/g1/engine-build", {"build": "cu13"}, format="json").status_code == 403
