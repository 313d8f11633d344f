"""Cards' fabric fields and IMEX as agents report them -> domains, ready trays, the snapshot, the
replicas at risk, the metrics; and `topo -m` -> the NVLink groups a shard's GPUs are chosen by."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.probes.nvlink import nvlink_groups as probe_groups
from agent.probes.nvlink import parse_topo_matrix
from apps.cluster.inventory import build_inventory, nvlink_groups
from apps.cluster.placement.gpus import choose_gpus
from apps.fabrics import nvlink
from apps.fabrics.metrics import FabricCollector
from tests.budget import examples
from tests.builders import make_model, make_node, make_replica

UUID = "3b4f1a2c-9d0e-4b7f-8a61-5c2d9e0f7a11"
DOMAIN = f"{UUID}.7"
ZEROS = "00000000-0000-0000-0000-000000000000"
IMEX_UP = {"installed": True, "state": "READY", "domain_state": "UP", "configured": True, "channels": [0]}


def fabric(state: str = "Completed", status: str | None = "Success", **kw: Any) -> dict[str, Any]:
    values = {"state": state, "status": status, "cluster_uuid": UUID, "clique_id": 7, "health_summary": "Healthy"}
    return {**values, "bandwidth": "Full", **kw}


def card(index: int, **kw: Any) -> dict[str, Any]:
    return {"index": index, "fabric": fabric(**kw)}


def tray_sample(cards: list[dict[str, Any]], imex: dict[str, Any] | None = IMEX_UP) -> dict[str, Any]:
    sample: dict[str, Any] = {"gpus": cards}
    if imex is not None:
        sample["imex"] = imex
    return sample


@pytest.mark.parametrize(
    ("fields", "joined", "problem"),
    [
        ({}, True, ""),
        ({"state": "In Progress", "status": "Success"}, False, "fabric In Progress"),  # Status means nothing yet
        ({"state": "Not Started", "status": None}, False, "fabric Not Started"),
        ({"status": "Insufficient Resources"}, False, "fabric status Insufficient Resources"),
        ({"health_summary": "Unhealthy"}, False, "fabric unhealthy"),  # it still prints a CliqueId
        ({"clique_id": None}, False, "no CliqueId"),
        ({"cluster_uuid": ZEROS, "clique_id": 0}, False, ""),  # one machine's NVSwitch: no domain, no error
    ],
)
def test_a_card_is_joined_only_when_completed_successful_healthy_and_in_a_domain(
    fields: dict[str, Any], joined: bool, problem: str
) -> None:
    found = nvlink.card_fabric(card(0, **fields))
    assert found is not None
    assert (found.joined, found.problem) == (joined, problem)


def test_no_fabric_or_not_supported_is_no_card_at_all() -> None:
    assert nvlink.card_fabric({"index": 0}) is None
    assert nvlink.card_fabric(card(0, state="Not Supported")) is None
    assert nvlink.card_fabric(card(0, state="N/A")) is None
    assert nvlink.read_node({"gpus": [{"index": 0}, {"index": 1, "fabric": None}]}) is None


def test_degraded_bandwidth_limited_capacity_or_a_health_fault_is_joined_but_degraded() -> None:
    slow = nvlink.card_fabric(card(0, bandwidth="Degraded"))
    limited = nvlink.card_fabric(card(1, health_summary="Limited Capacity"))
    fault = nvlink.card_fabric(card(2, health_faults=["Route Recovery in progress"]))
    for found in (slow, limited, fault):
        assert found is not None and found.joined and found.degraded
    assert fault is not None and fault.as_dict()["faults"] == ["Route Recovery in progress"]


def test_health_rows_an_older_driver_does_not_support_are_unknown_not_degraded() -> None:
    # GB200 on an early driver: Completed/Success in clique 4026, every Health row Not Supported.
    found = nvlink.card_fabric(card(0, clique_id=4026, health_summary="Not Supported", bandwidth="Not Supported"))
    assert found is not None and found.joined and not found.degraded
    assert (found.health, found.bandwidth) == (None, None)


@pytest.mark.parametrize(
    ("imex", "problem"),
    [
        (None, "IMEX not reported yet"),
        ({"installed": False, "channels": [0]}, "IMEX is not installed"),
        ({**IMEX_UP, "state": "WAITING_FOR_PEERS"}, "IMEX is WAITING_FOR_PEERS"),
        ({**IMEX_UP, "configured": False}, "IMEX has no node configuration"),
        (
            {
                **IMEX_UP,
                "domain_state": "DOWN",
                "nodes": [{"index": 0, "address": "10.0.0.1", "state": "READY"}, {"index": 1, "address": "10.0.0.2"}],
            },
            "IMEX domain DOWN (10.0.0.2)",
        ),
        ({**IMEX_UP, "channels": []}, "no IMEX channel"),
        ({**IMEX_UP, "channels": None}, "no IMEX channel"),
    ],
)
def test_a_tray_is_ready_only_with_imex_up_and_a_channel(imex: dict[str, Any] | None, problem: str) -> None:
    state = nvlink.read_node(tray_sample([card(i) for i in range(4)], imex))
    assert state is not None and state.domain == DOMAIN
    assert (state.ready, state.problems) == (False, [problem])
    whole = nvlink.read_node(tray_sample([card(i) for i in range(4)]))
    assert whole is not None and whole.ready and whole.problems == []


def test_cards_naming_two_domains_keep_the_tray_out() -> None:
    state = nvlink.read_node(tray_sample([card(0), card(1), card(2, clique_id=8), card(3, cluster_uuid=ZEROS)]))
    assert state is not None and state.domain == DOMAIN
    assert state.problems == ["its cards name 2 domains", "GPU 2: in no domain", "GPU 3: in no domain"]


def test_during_a_fabric_manager_restart_the_tray_stays_in_the_domain_it_named() -> None:
    lost = [card(i, state="In Progress", status=None, cluster_uuid=None, clique_id=None) for i in range(4)]
    assert nvlink.read_node(tray_sample(lost)).domain is None  # type: ignore[union-attr]
    state = nvlink.read_node(tray_sample(lost), {"nvlink_domain": DOMAIN})
    assert state is not None and state.domain == DOMAIN and not state.ready
    assert state.problems == [f"GPU {i}: fabric In Progress" for i in range(4)]
    assert nvlink.registered_domain([card(i) for i in range(4)]) == DOMAIN
    assert nvlink.registered_domain(lost) is None


def collect() -> dict[str, Metric]:
    return {m.name: m for m in text_string_to_metric_families(FabricCollector().text())}


@pytest.mark.django_db
def test_domains_their_trays_the_replicas_at_risk_and_the_metrics() -> None:
    t1 = make_node("t1", cards=[card(i) for i in range(4)], sample=tray_sample([card(i) for i in range(4)]))
    t2 = make_node("t2", cards=[card(i) for i in range(4)], sample=tray_sample([card(i) for i in range(4)]))
    dropped = [card(0), card(1), card(2, state="In Progress", status=None), card(3)]
    t3 = make_node("t3", cards=dropped, sample=tray_sample(dropped))
    hgx = [{"index": i, "fabric": fabric(cluster_uuid=ZEROS, clique_id=0)} for i in range(8)]
    make_node("hgx", cards=hgx, sample={"gpus": hgx})
    make_node("gone", cards=[card(0)], sample=tray_sample([card(0)]), sample_age=timedelta(minutes=10))
    make_node("plain", gpus=2)
    model = make_model("big", gpus=4)
    replica = make_replica(model, t1, also_on=[t3])
    replica.shards.update(env=dict(nvlink.MNNVL_ENV))
    make_replica(make_model("ib-only", gpus=4), t2, also_on=[t3])  # formed over InfiniBand: not MNNVL

    overview = nvlink.domains_overview()
    [domain] = overview["domains"]
    assert domain["domain"] == DOMAIN and domain["label"] == "3b4f1a2c…/7"
    assert [t["name"] for t in domain["nodes"]] == ["t1", "t2", "t3"]
    assert (domain["gpus"], domain["gpus_joined"], domain["nodes_ready"], domain["imex_up"]) == (12, 11, 2, 3)
    assert domain["at_risk"] == [
        {
            "replica": replica.pk,
            "model": "big",
            "state": "ready",
            "node": "t3",
            "problems": ["GPU 2: fabric In Progress"],
        }
    ]
    assert [t["name"] for t in overview["standalone"]] == ["hgx"]
    assert overview["stale"] == ["gone"]

    # The placement snapshot carries each tray's domain; the standalone and plain nodes none.
    inventory = build_inventory()
    extra = {n.name: n.extra.get("nvlink") for n in inventory.nodes.values()}
    assert extra["t1"] == {"domain": DOMAIN, "label": "3b4f1a2c…/7", "ready": True, "problems": []}
    assert extra["t3"]["ready"] is False and extra["t3"]["problems"] == ["GPU 2: fabric In Progress"]
    assert extra["hgx"] is None and extra["plain"] is None and extra["gone"] is None

    metrics = collect()
    joined = {(s.labels["node"], s.labels["gpu"]): s.value for s in metrics["llmgw_gpu_nvlink_joined"].samples}
    assert joined[("t3", "2")] == 0.0 and joined[("t1", "0")] == 1.0
    assert {node for node, _gpu in joined} == {"t1", "t2", "t3"}  # nothing for the HGX, plain or stale node
    imex = {s.labels["node"]: s.value for s in metrics["llmgw_imex_up"].samples}
    assert imex == {"t1": 1.0, "t2": 1.0, "t3": 1.0}

    # A tray whose fabric manager restarts names no domain: its cards are shown out of the one
    # it registered in (read from its hardware), not left out of the metrics.
    lost = [card(i, state="In Progress", status=None, cluster_uuid=None, clique_id=None) for i in range(4)]
    t4 = make_node("t4", cards=lost, sample=tray_sample(lost))
    t4.hardware = {**t4.hardware, "nvlink_domain": DOMAIN}
    t4.save(update_fields=["hardware"])
    restarting = {
        s.labels["gpu"]: (s.labels["domain"], s.value)
        for s in collect()["llmgw_gpu_nvlink_joined"].samples
        if s.labels["node"] == "t4"
    }
    assert restarting == {str(i): (DOMAIN, 0.0) for i in range(4)}


@pytest.mark.django_db
def test_a_tray_registering_remembers_the_domain_its_cards_named() -> None:
    from apps.cluster import enrolment

    node = make_node("t1", cards=[card(i) for i in range(4)])
    body = {"agent_version": "0.1.0", "hardware": {"gpus": [card(i) for i in range(4)]}}
    enrolment.register_node(node.pk, body)
    node.refresh_from_db()
    assert node.hardware["nvlink_domain"] == DOMAIN
    # It registers again while its fabric manager restarts: the domain it named is kept.
    lost = [card(i, state="In Progress", status=None, cluster_uuid=None, clique_id=None) for i in range(4)]
    enrolment.register_node(node.pk, {"agent_version": "0.1.0", "hardware": {"gpus": lost}})
    node.refresh_from_db()
    assert node.hardware["nvlink_domain"] == DOMAIN


def linked(pairs: list[tuple[int, int]], cards: int) -> dict[str, Any]:
    """The registration of a node whose cards are bridged in `pairs`, as its agent reads topo -m."""
    lines = ["\t" + "\t".join(f"GPU{i}" for i in range(cards)) + "\tCPU Affinity\tNUMA Affinity"]
    for i in range(cards):
        cells = [" X " if i == j else ("NV2" if (i, j) in pairs or (j, i) in pairs else "PHB") for j in range(cards)]
        lines.append(f"GPU{i}\t" + "\t".join(cells) + "\t0-15\t0")
    topology = parse_topo_matrix("\n".join(lines) + "\n")
    groups = probe_groups(topology)
    return {"gpu_topology": {"gpus": [{"index": g.index, "group": groups[g.index]} for g in topology.gpus]}}


def test_nvlink_groups_follow_the_links_and_unknown_is_empty() -> None:
    assert nvlink_groups(linked([(0, 1), (2, 3)], 4)) == {0: "nvl0", 1: "nvl0", 2: "nvl2", 3: "nvl2"}
    assert nvlink_groups(linked([(0, 1), (1, 2)], 4)) == {0: "nvl0", 1: "nvl0", 2: "nvl0", 3: "nvl3"}
    assert nvlink_groups({}) == {}
    assert nvlink_groups({"gpu_topology": "garbage"}) == {}
    assert nvlink_groups({"gpu_topology": {"gpus": [{"index": 0}, "x", {"index": "1", "group": "a"}]}}) == {}


@pytest.mark.django_db
def test_a_shard_of_two_cards_takes_a_linked_pair_not_the_lowest_free_indices() -> None:
    # Four cards bridged in pairs (0-1, 2-3), card 1 taken: by lowest index the shard would get 0
    # and 2, which share no NVLink.
    node = make_node("pairs", gpus=4, hardware=linked([(0, 1), (2, 3)], 4))
    inventory = build_inventory()
    snapshot = inventory.nodes[node.pk]
    assert [slot.nvlink_group for slot in snapshot.gpus] == ["nvl0", "nvl0", "nvl2", "nvl2"]
    snapshot.gpus[1].claimed_by = "other"
    inventory = type(inventory)({node.pk: snapshot})
    assert choose_gpus(inventory, node.pk, snapshot.gpus[0].gpu_class, 2) == (2, 3)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
fabric_fields = st.fixed_dictionaries(
    {},
    optional={
        key: json_values | st.sampled_from(["Completed", "In Progress", "Success", UUID, ZEROS, "N/A"])
        for key in ("state", "status", "cluster_uuid", "clique_id", "health_summary", "bandwidth")
    },
)
samples = st.fixed_dictionaries(
    {},
    optional={
        "gpus": st.lists(
            st.fixed_dictionaries(
                {}, optional={"index": st.integers(0, 8) | json_values, "fabric": fabric_fields | json_values}
            ),
            max_size=5,
        )
        | json_values,
        "imex": st.fixed_dictionaries(
            {},
            optional={
                k: json_values for k in ("installed", "state", "domain_state", "configured", "nodes", "channels")
            },
        )
        | json_values,
    },
)


@settings(max_examples=examples(300), deadline=None)
@given(sample=samples | json_values, hardware=st.dictionaries(st.just("nvlink_domain"), json_values) | json_values)
def test_whatever_a_sample_holds_reading_it_never_raises(sample: Any, hardware: Any) -> None:
    state = nvlink.read_node(sample, hardware if isinstance(hardware, dict) else None)
    if state is not None:
        state.as_dict()
        assert isinstance(state.ready, bool)


@settings(max_examples=examples(300), deadline=None)
@given(sample=samples)
def test_a_sample_whose_cards_may_name_no_domain_is_in_none(sample: dict[str, Any]) -> None:
    # The metrics skip reading such a node card by card: that must lose no domain.
    if not nvlink.may_name_domain(sample):
        state = nvlink.read_node(sample)
        assert state is None or state.domain is None
    assert nvlink.may_name_domain(tray_sample([card(0)]))
    assert not nvlink.may_name_domain(tray_sample([card(0, cluster_uuid=ZEROS, clique_id=0)]))
