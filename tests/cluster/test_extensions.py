"""The registry through which the cluster app hears of the apps above it: empty, every slot answers
"unknown" and the cluster app's pages and messages leave those parts out; filled by the installed
apps' ready() (once, however often it runs), the node page and the cluster page show their parts."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.test import Client
from django.utils import timezone

from apps.cluster import reconciler, views
from apps.cluster.extensions import EXTENSIONS, Extensions
from apps.cluster.models import Node
from apps.cluster.placement import NodeSnapshot
from tests.builders import make_node

PORT = {"device": "mlx5_0", "port": 1, "fabric": "ib-a", "link_layer": "InfiniBand", "up": True, "rate_gbps": 200.0}
TOPOLOGY = {"gpus": [{"index": 0, "group": "a", "paths": {"1": "NV18"}}, {"index": 1, "group": "a"}]}


def test_an_empty_registry_answers_unknown_for_every_slot() -> None:
    empty = Extensions()
    node = Node(name="gpu1", labels={"llmgw.io/rack": "r12"})
    snapshots = {1: NodeSnapshot(id=1, name="gpu1", ready=True)}
    empty.snapshot(snapshots, {})
    assert snapshots[1].extra == {}
    assert empty.shard_env(1, ("ib:0x1",)) == {}
    assert empty.waiting({"m1", "m2"}) == {"m1": None, "m2": None}  # not zero: not known
    assert empty.registered_domain([{"index": 0}]) is None
    assert empty.node_location(node) == {}
    assert empty.location_labels() == []
    assert empty.held_draining() == []
    assert empty.node_fetches() is None
    assert empty.node_page(node) == {}
    assert empty.cluster_page() == {}
    assert empty.record_report("fabrics", 1, {"ports": []}) is False
    assert empty.request_handler("ibnetdiscover") is None


def test_registering_twice_leaves_one_of_each() -> None:
    registry = Extensions()

    def part(snapshots: dict[int, NodeSnapshot], rows: dict[int, Node]) -> None:
        for snapshot in snapshots.values():
            snapshot.extra["seen"] = snapshot.extra.get("seen", 0) + 1

    def env(node_id: int, group: tuple[str, ...] | None) -> dict[str, str]:
        return {"NCCL_IB_HCA": "=mlx5_0"}

    for _ in range(2):
        registry.add_snapshot_part(part)
        registry.add_shard_env(env)
        registry.add_node_panel("ports", lambda node: ["mlx5_0/1"])
    snapshots = {1: NodeSnapshot(id=1, name="gpu1", ready=True)}
    registry.snapshot(snapshots, {})
    assert snapshots[1].extra == {"seen": 1}
    assert registry.shard_env(1, None) == {"NCCL_IB_HCA": "=mlx5_0"}
    assert registry.node_page(Node(name="gpu1")) == {"ports": ["mlx5_0/1"]}


def test_the_installed_apps_fill_it_once_however_often_ready_runs() -> None:
    before = (len(EXTENSIONS.snapshot_parts), len(EXTENSIONS.shard_env_parts))
    for label in ("fabrics", "facility", "mirror"):
        apps.get_app_config(label).ready()
    assert (len(EXTENSIONS.snapshot_parts), len(EXTENSIONS.shard_env_parts)) == before
    assert {"ports", "nvlink"} <= EXTENSIONS.node_panels.keys()
    assert "fabrics" in EXTENSIONS.cluster_panels
    assert "fabrics" in EXTENSIONS.node_reports
    assert EXTENSIONS.request_handler("ibnetdiscover") is not None
    assert [level for level, _label in EXTENSIONS.location_labels()] == ["site", "room", "row", "rack", "pdu"]
    assert EXTENSIONS.drain_holds is not None and EXTENSIONS.mirror_fetches is not None


@pytest.mark.django_db
def test_the_node_page_shows_the_fabrics_and_location_parts_of_the_installed_apps(client: Client, alice: Any) -> None:
    node = make_node("gpu1", gpus=2, labels={"llmgw.io/rack": "r12"})
    Node.objects.filter(pk=node.pk).update(
        sample={**(node.sample or {}), "ib_ports": [PORT]},
        sampled_at=timezone.now(),
        hardware={**node.hardware, "gpu_topology": TOPOLOGY},
    )
    client.force_login(alice)
    page = client.get("/nodes/gpu1/").content.decode()
    assert 'data-section="fabric-ports"' in page and "mlx5_0/1" in page
    assert 'data-section="nvlink"' in page and 'data-field="nvlink-matrix"' in page
    assert 'id="location-rack"' in page and 'value="r12"' in page


@pytest.mark.django_db
def test_without_the_apps_above_it_the_cluster_app_leaves_their_parts_out(
    client: Client, alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make_node("gpu1", gpus=2, labels={"llmgw.io/rack": "r12"})
    Node.objects.filter(pk=node.pk).update(
        sample={**(node.sample or {}), "ib_ports": [PORT]},
        hardware={**node.hardware, "gpu_topology": TOPOLOGY},
    )
    monkeypatch.setattr(views, "EXTENSIONS", Extensions())
    monkeypatch.setattr(reconciler, "EXTENSIONS", Extensions())
    client.force_login(alice)
    page = client.get("/nodes/gpu1/")
    assert page.status_code == 200
    text = page.content.decode()
    assert 'data-section="fabric-ports"' not in text and 'data-section="nvlink"' not in text
    assert 'id="location-rack"' not in text
    assert client.post("/nodes/gpu1/location", {"rack": "r13"}).status_code == 404
    assert Node.objects.get(pk=node.pk).labels == {"llmgw.io/rack": "r12"}
    cluster = client.get("/cluster/")
    assert cluster.status_code == 200 and 'data-section="fabrics"' not in cluster.content.decode()
    # No mirror: the desired state says nothing of it, and the agent keeps the list it had.
    assert "mirror" not in reconciler.desired_message(Node.objects.get(pk=node.pk), 1)
