"""Ports as agents report them -> physical fabrics, snapshot attachments, NCCL's environment; and
the requests that map a fabric, refused at once for an agent too old to answer."""

from __future__ import annotations

import base64
import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from agent.fabrics import FabricWatcher
from agent.probes.infiniband import read_ports
from agent.probes.sysfs import SysfsReader
from apps.cluster import agent_requests
from apps.cluster.choices import NodeStatus
from apps.cluster.inventory import build_inventory
from apps.cluster.models import AgentRequest, Node
from apps.fabrics import maps, services
from apps.fabrics.models import FabricMap, MasterChange
from tests.agent.fixturefiles import fixture_files
from tests.fabrics.fattree import fat_tree

pytestmark = pytest.mark.django_db

SM_A, SM_A2, SM_B = "0x000000000000000a", "0x00000000000000a2", "0x000000000000000b"


def node(name: str, *ports: dict[str, Any], sample: dict[str, Any] | None = None, **kw: Any) -> Node:
    row = Node.objects.create(
        name=name, status=NodeStatus.READY, features=["ibnetdiscover.v1"], sample=sample or {}, **kw
    )
    services.record_fabrics(row.pk, {"ports": list(ports), "declared": ["ib-a"]})
    return row


def ib(device: str, sm: str | None = SM_A, *, up: bool = True, fabric: str = "ib-a", **kw: Any) -> dict[str, Any]:
    port = {"device": device, "port": 1, "fabric": fabric, "link_layer": "InfiniBand", "up": up, "rate_gbps": 200.0}
    if sm:
        port["sm_guid"] = sm
    return {**port, **kw}


def managers(master: str, *guids: str) -> dict[str, Any]:
    return {"subnet_managers": [{"via": "mlx5_0/1", "master": master, "managers": [{"guid": g} for g in guids]}]}


def attachments(name: str) -> list[dict[str, Any]]:
    inventory = build_inventory()
    snapshot = next(n for n in inventory.nodes.values() if n.name == name)
    return snapshot.extra["fabrics"]  # type: ignore[no-any-return]


def test_ports_on_one_subnet_manager_set_are_one_fabric_named_by_its_lowest_guid() -> None:
    # One node sees the master, the other (mid-failover) the standby: still one fabric.
    node("n1", ib("mlx5_0", SM_A2), sample=managers(SM_A2, SM_A, SM_A2))
    node("n2", ib("mlx5_0", SM_A), sample=managers(SM_A, SM_A, SM_A2))
    overview = services.fabrics_overview()
    [fabric] = overview["fabrics"]
    assert fabric["id"] == f"ib:{SM_A}" and fabric["nodes"] == ["n1", "n2"]
    assert [p["code"] for p in overview["problems"]] == ["masters_disagree"]
    assert attachments("n1")[0]["identity"] == attachments("n2")[0]["identity"] == f"ib:{SM_A}"


def test_a_node_whose_adapters_for_one_name_sit_on_two_fabrics_is_a_problem_not_a_group() -> None:
    node("split", ib("mlx5_0", SM_A), ib("mlx5_1", SM_B))
    [att] = attachments("split")
    assert att["identity"] is None
    assert att["problem"] == f"its adapters for ib-a sit on 2 fabrics: mlx5_0 on ib:{SM_A}; mlx5_1 on ib:{SM_B}"


def test_nccl_gets_the_exact_adapters_of_the_fabric_the_replica_was_formed_on() -> None:
    row = node(
        "n1",
        *(ib(f"mlx5_{i}") for i in (0, 1, 10, 11)),
        ib("mlx5_2", up=False),
        ib("mlx5_5", SM_B, fabric="ib-b"),
    )
    env = services.shard_env(row.pk, (f"ib:{SM_A}",))
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_10,mlx5_11"
    assert services.shard_env(row.pk, (f"ib:{SM_B}",))["NCCL_IB_HCA"] == "=mlx5_5"
    assert services.shard_env(row.pk, None) == {}


def test_roce_ports_are_a_fabric_by_their_ip_network_and_nccl_gets_their_netdevs() -> None:
    port = {"link_layer": "Ethernet", "network": "10.1.0.0/24", "netdev": "ens1f0np0"}
    row = node("r1", ib("mlx5_0", None, fabric="roce", **port))
    [att] = attachments("r1")
    assert (att["kind"], att["identity"]) == ("roce", "roce:10.1.0.0/24")
    env = services.shard_env(row.pk, ("roce:10.1.0.0/24",))
    assert env == {
        "NCCL_IB_HCA": "=mlx5_0",
        "NCCL_IB_DISABLE": "0",
        "NCCL_IB_ROCE_VERSION_NUM": "2",
        "NCCL_IB_ADDR_FAMILY": "AF_INET",
        "NCCL_SOCKET_IFNAME": "=ens1f0np0",
    }


def test_a_change_of_master_is_kept_and_listed_for_a_day() -> None:
    row = node("n1", ib("mlx5_0", SM_A), sample=managers(SM_A, SM_A, SM_A2))
    services.record_fabrics(row.pk, {"ports": [ib("mlx5_0", SM_A2)]})
    [change] = MasterChange.objects.all()
    assert (change.port, change.previous, change.master) == ("mlx5_0/1", SM_A, SM_A2)
    [fabric] = services.fabrics_overview()["fabrics"]
    assert [(c["previous"], c["master"]) for c in fabric["master_changes"]] == [(SM_A, SM_A2)]


def test_the_map_gives_each_node_its_leaves_and_marks_a_short_cable() -> None:
    tree = fat_tree(pods=1, sus_per_pod=2, hosts_per_su=2, rails=2, spines_per_pod=2, uplinks=2, cores_per_group=0)
    for index, host in enumerate(("gpu0001", "gpu0002", "gpu0003")):
        node(
            f"n{index + 1}",
            *(ib(f"mlx5_{r}", port_guid=tree.port_guid[(host, r)]) for r in range(2)),
        )
    mapper = Node.objects.get(name="n1")
    row = agent_requests.create(mapper, "ibnetdiscover", {"fabric": f"ib:{SM_A}", "device": "mlx5_0", "port": 1})
    claimed = agent_requests.claim(mapper.pk)
    assert [c["request_id"] for c in claimed] == [row.request_id]
    text = base64.b64encode(gzip.compress(tree.text.encode())).decode()
    answered = agent_requests.record_response(
        mapper.pk, {"request_id": row.request_id, "ok": True, "result": {"text_gz": text}}
    )
    assert answered is not None and answered.state == AgentRequest.State.ANSWERED
    assert answered.result["counts"]["leaves"] == 4
    assert FabricMap.objects.count() == 1
    leaves = {n: attachments(n)[0]["leaf_name"] for n in ("n1", "n2", "n3")}
    assert leaves == {
        "n1": "lf-p1-su1-r0, lf-p1-su1-r1",
        "n2": "lf-p1-su1-r0, lf-p1-su1-r1",
        "n3": "lf-p1-su2-r0, lf-p1-su2-r1",
    }


def map_fabric(mapper: Node, text: str) -> None:
    """The mapper's agent answers an ibnetdiscover request with ``text``."""
    row = agent_requests.create(mapper, "ibnetdiscover", {"fabric": f"ib:{SM_A}", "device": "mlx5_0", "port": 1})
    agent_requests.claim(mapper.pk)
    packed = base64.b64encode(gzip.compress(text.encode())).decode()
    answered = agent_requests.record_response(
        mapper.pk, {"request_id": row.request_id, "ok": True, "result": {"text_gz": packed}}
    )
    assert answered is not None and answered.state == AgentRequest.State.ANSWERED


def test_the_fabric_page_and_api_say_which_rail_plan_was_inferred(client: Any, api: Any, alice: Any) -> None:
    # Two units of four hosts, each host's four adapters over two planes; gpu0002 has two crossed.
    tree = fat_tree(pods=1, sus_per_pod=2, hosts_per_su=4, planes=2, swap_host="gpu0002", cores_per_group=0)
    map_fabric(node("n1", ib("mlx5_0", port_guid=tree.port_guid[("gpu0001", 0)])), tree.text)
    api.force_authenticate(alice)
    rails = api.get(f"/api/v1/fabrics/ib:{SM_A}/topology").json()["map"]["rails"]
    assert rails["plan"] == {"adapters": 4, "leaves": 2, "planes": [[0, 2], [1, 3]], "rails_per_leaf": 2, "hosts": 7}
    assert (rails["members"], rails["not_members"]) == (8, {"one_adapter": 0, "storage": 0, "management": 0})
    assert [(b["host"], b["rail"], b["leaf_rails"]) for b in rails["breaks"]] == [
        ("gpu0002", 0, [1, 3]),
        ("gpu0002", 1, [0, 2]),
    ]
    client.force_login(alice)
    page = " ".join(client.get(f"/fabrics/ib:{SM_A}/").content.decode().split())
    assert "Rail plan inferred from 7 of 8 hosts: adapters per host 4, leaves per host 2, rails per leaf 2." in page
    assert "Rails that share a leaf: 0+2, 1+3." in page
    assert "Not rail members: 0 hosts with one adapter, 0 storage and 0 management hosts." in page
    assert "2 adapters break their rails." in page


def test_the_fabric_page_says_when_a_switch_tier_is_unknown_and_no_plan_was_inferred(client: Any, alice: Any) -> None:
    tree = fat_tree(pods=3, hosts_per_su=2, rails=1, spines_per_pod=4, uplinks=4, cores_per_group=0)
    spines = sorted(g for g, tier in tree.tiers.items() if tier == "spine")
    odd = ["", "vendid=0x2c9", "devid=0xd2f0", 'Switch\t37 "S-0000000000000abc"\t\t# "odd" base port 0 lid 99 lmc 0']
    chosen = [g for pod in range(3) for g in spines[pod * 4 : pod * 4 + 2]]
    odd += [f'[{i + 1}]\t"S-{g[2:]}"[30]\t\t# "sp" lid 3 4xHDR' for i, g in enumerate(chosen)]
    map_fabric(node("n1", ib("mlx5_0")), tree.text + "\n".join(odd) + "\n")
    client.force_login(alice)
    page = " ".join(client.get(f"/fabrics/ib:{SM_A}/").content.decode().split())
    assert "The tier of 1 switch cannot be told from its cabling." in page
    assert "No rail plan: no two hosts with two or more adapters are cabled alike." in page
    assert "Not rail members: 6 hosts with one adapter, 0 storage and 0 management hosts." in page


def test_a_request_to_an_agent_too_old_to_answer_is_refused_at_once() -> None:
    old = node("old", ib("mlx5_0"))
    Node.objects.filter(pk=old.pk).update(features=["heartbeat.v1"], agent_version="0.9.0")
    old.refresh_from_db()
    with pytest.raises(agent_requests.RequestRefused) as refused:
        agent_requests.create(old, "ibnetdiscover", {"fabric": f"ib:{SM_A}"})
    assert "version 0.9.0" in str(refused.value) and "ibnetdiscover.v1" in str(refused.value)
    assert AgentRequest.objects.count() == 0
    # The beat task skips it and asks nobody, since no other node is on the fabric.
    assert maps.map_fabrics() == []


def test_an_unanswered_request_times_out_and_a_retry_is_a_new_row() -> None:
    n1 = node("n1", ib("mlx5_0"))
    row = agent_requests.create(
        n1, "ibnetdiscover", {"fabric": f"ib:{SM_A}", "device": "mlx5_0", "port": 1}, timeout_s=60
    )
    agent_requests.claim(n1.pk)
    assert agent_requests.expire(timezone.now()) == 0
    assert agent_requests.expire(timezone.now() + timezone.timedelta(seconds=61)) == 1
    row.refresh_from_db()
    assert row.state == AgentRequest.State.TIMED_OUT and row.error == "No answer within 60 s."
    again = agent_requests.retry(row)
    assert again.retry_of_id == row.pk and again.state == AgentRequest.State.PENDING
    with pytest.raises(agent_requests.RequestRefused):
        agent_requests.retry(again)


def test_a_bad_answer_fails_the_request_with_why_and_keeps_no_map() -> None:
    n1 = node("n1", ib("mlx5_0"))
    row = agent_requests.create(n1, "ibnetdiscover", {"fabric": f"ib:{SM_A}", "device": "mlx5_0", "port": 1})
    agent_requests.claim(n1.pk)
    failed = agent_requests.record_response(
        n1.pk, {"request_id": row.request_id, "ok": True, "result": {"text_gz": "%%%"}}
    )
    assert failed is not None and failed.state == AgentRequest.State.FAILED
    assert failed.error.startswith("The answer could not be used")
    assert FabricMap.objects.count() == 0


def test_status_says_which_models_each_fabric_holds_a_shared_filer_once(api: Any, alice: Any) -> None:
    from apps.catalog.models import Model

    Model.objects.create(name="llama", source="/filer/llama", min_replicas=0, max_replicas=1)
    Model.objects.create(name="qwen", source="/local/qwen", min_replicas=0, max_replicas=1)
    filer = {"mount_point": "/filer", "fstype": "nfs4", "shared": True, "weights": ["/filer/llama"]}
    local = {"mount_point": "/local", "fstype": "ext4", "shared": False, "weights": ["/local/qwen"]}
    node("n1", ib("mlx5_0"), sample={"storage": [filer]})
    node("n2", ib("mlx5_0"), sample={"storage": [filer, local]})
    node("n3", ib("mlx5_0", SM_B), sample={"storage": [local]})
    assert services.fabric_weights() == {
        f"ib:{SM_A}": [{"model": "llama", "copies": 1}, {"model": "qwen", "copies": 1}],
        f"ib:{SM_B}": [{"model": "qwen", "copies": 1}],
    }
    api.force_authenticate(alice)
    body = api.get("/api/v1/status").json()
    assert body["fabrics"][f"ib:{SM_B}"] == [{"model": "qwen", "copies": 1}]


def test_the_cluster_page_lists_each_fabric_with_its_master_and_standbys(client: Any, alice: Any) -> None:
    node("n1", ib("mlx5_0"), sample=managers(SM_A, SM_A, SM_A2))
    client.force_login(alice)
    page = client.get("/cluster/").content.decode()
    section = page[page.index('data-section="fabrics"') :]
    section = section[: section.index("</section>")]
    assert f"ib:{SM_A}" in section and f"<code>{SM_A}</code>" in section
    assert "<td>1</td></tr>" in section  # one standby
    empty = services.fabrics_overview()
    assert empty["fabrics"][0]["standbys"] == 1


def test_nccl_bootstraps_over_the_interface_holding_the_nodes_address() -> None:
    row = node("n1", ib("mlx5_0"), address="10.0.0.5")
    services.record_fabrics(
        row.pk,
        {"ports": [ib("mlx5_0")], "interfaces": {"lo": ["127.0.0.1"], "eno1": ["10.0.0.5"], "ib0": ["192.168.9.5"]}},
    )
    assert services.shard_env(row.pk, (f"ib:{SM_A}",))["NCCL_SOCKET_IFNAME"] == "=eno1"
    # Without the agent's interfaces, NCCL picks its own (it leaves out lo and docker*).
    services.record_fabrics(row.pk, {"ports": [ib("mlx5_0")]})
    assert "NCCL_SOCKET_IFNAME" not in services.shard_env(row.pk, (f"ib:{SM_A}",))


def test_the_explain_page_names_each_nodes_fabric(client: Any, alice: Any) -> None:
    from apps.catalog.models import Model, Profile

    model = Model.objects.create(name="big", source="/models/big", min_replicas=0, max_replicas=1)
    Profile.objects.create(
        model=model, name="2x8", engine="vllm", accelerator="H100-80GB", gpus_per_shard=8, nodes_per_replica=2
    )
    node("n1", ib("mlx5_0"))
    client.force_login(alice)
    page = client.get("/models/big/explain").content.decode()
    assert f'data-field="notes">fabric ib-a (ib:{SM_A}) · leaf -</div>' in page


@pytest.mark.parametrize("tree", fixture_files("sysfs-infiniband", "*.json*"))
def test_each_captured_ports_figures_are_in_the_metrics_with_their_labels(tree: Path) -> None:
    from apps.fabrics.metrics import FabricCollector

    watcher = FabricWatcher("/nonexistent", [], runner=None)  # type: ignore[arg-type]
    ports = [watcher._port_dict(p) for p in read_ports(SysfsReader(json.loads(tree.read_text()))).ports]
    assert ports
    Node.objects.create(name='gpu"1', status=NodeStatus.READY, sample={"ib_ports": ports}, sampled_at=timezone.now())
    Node.objects.create(name="stale", status=NodeStatus.READY, sample={"ib_ports": ports})  # never sampled: absent
    families = {f.name: f for f in text_string_to_metric_families(FabricCollector().text())}

    def value(family: str, port: dict[str, Any], **labels: str) -> float:
        where = {"node": 'gpu"1', "device": port["device"], "port": str(port["port"])}
        [found] = [s.value for s in families[family].samples if s.labels == {**where, **labels}]
        return found

    for port in ports:
        state = {
            "link_layer": port["link_layer"],
            "state": port["state_name"],
            "phys_state": port["phys_state_name"],
        }
        assert value("llmgw_ib_port_active", port, **state) == (1.0 if port["up"] else 0.0)
        if "rate_gbps" in port:
            assert value("llmgw_ib_port_rate_gbps", port) == port["rate_gbps"]
        for name, count in [*((n, port[n]) for n in ("xmit_bytes", "rcv_bytes") if n in port), *port["errors"].items()]:
            assert value("llmgw_ib_port_counter", port, counter=name) == count
        assert value("llmgw_ib_port_flaps", port) == 0.0
    assert all(s.labels["node"] != "stale" for f in families.values() for s in f.samples)
