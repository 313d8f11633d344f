"""Power caps on racks and PDUs: declared, derived and measured draw; A/B feeds; the refusal with
its numbers; server.yaml's budgets; unknown draw said to be unknown."""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.inventory import build_inventory, replica_request
from apps.cluster.models import Node
from apps.cluster.placement import explain, place
from apps.facility import power, services
from apps.facility.models import Budget
from tests.builders import make_model, make_node, make_replica

RACK = "llmgw.io/rack"
pytestmark = pytest.mark.django_db


def sample(watts_per_card: float | None, cards: int = 8, rapl: float | None = 400.0) -> dict[str, Any]:
    gpus = [{"index": i, "gpu_class": "H100-80GB"} for i in range(cards)]
    if watts_per_card is not None:
        for gpu in gpus:
            gpu["power_draw_w"] = watts_per_card
    found: dict[str, Any] = {"gpus": gpus}
    if rapl is not None:
        found["cpu_package_power_w"] = rapl
    return found


def test_an_ab_fed_racks_cap_is_one_feed_not_their_sum() -> None:
    [ab, single, two] = power.apply_budgets(
        [
            {
                "domain": "rack=r1",
                "feeds": [{"name": "A", "watts": 17300}, {"name": "B", "watts": 17300}],
                "redundant": True,
            },
            {"domain": "rack=r2", "watts": 15000},
            {"domain": "pdu=p1", "feeds": [{"watts": 7000}, {"watts": 8000}]},
        ],
        source="api",
        replace=False,
    )
    assert (ab.cap_watts, single.cap_watts, two.cap_watts) == (17300, 15000, 15000)
    assert two.feeds == [{"name": "A", "watts": 7000}, {"name": "B", "watts": 8000}]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"domain": "rack=r1", "wats": 100}, "Unknown key(s) wats"),
        ({"domain": "rack=r1", "watts": 0}, "Expected whole watts from 1"),
        ({"domain": "rack=r1", "watts": True}, "Expected whole watts from 1"),
        ({"domain": "shelf=1", "watts": 100}, "LEVEL=NAME"),
        ({"domain": "rack=r1"}, "Give the cap as watts, or the feeds"),
        ({"domain": "rack=r1", "feeds": [{"name": "A"}]}, "Expected a list of {name, watts}"),
    ],
)
def test_a_bad_budget_is_refused_whole_and_writes_nothing(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(power.BudgetError) as refused:
        power.apply_budgets([{"domain": "rack=r9", "watts": 1000}, entry], source="api", replace=False)
    assert message in str(refused.value)
    assert not Budget.objects.exists()


def test_server_yaml_states_its_whole_set_and_leaves_the_apis_alone(tmp_path: Any) -> None:
    power.apply_budgets([{"domain": "rack=api", "watts": 5000}], source="api", replace=False)
    path = tmp_path / "server.yaml"
    path.write_text(
        "facility:\n  budgets:\n    - {domain: rack=r1, watts: 15000}\n    - {domain: row=3, watts: 90000}\n"
    )
    assert len(power.apply_server_budgets(str(path)) or []) == 2
    path.write_text("facility:\n  budgets:\n    - {domain: rack=r1, watts: 14000}\n")
    power.apply_server_budgets(str(path))
    assert power.caps() == {"rack=api": 5000, "rack=r1": 14000}
    path.write_text("models: []\n")
    assert power.apply_server_budgets(str(path)) is None  # no facility: left as they are
    path.write_text("facility:\n  budget: []\n")
    with pytest.raises(power.BudgetError, match="budgets"):
        power.apply_server_budgets(str(path))


def test_a_nodes_draw_is_the_most_of_what_is_measured_and_what_its_shards_declare_or_derive() -> None:
    measured = make_node("m", gpus=8, sample=sample(500.0))
    declared = make_node("d", gpus=8, sample=sample(None, rapl=None))
    derived = make_node("t", gpus=8, sample=sample(None, rapl=None))
    unknown = make_node("u", gpus=8, sample=sample(None, rapl=None))
    model = make_model("big", gpus=2)
    model.profiles.update(power_watts=2500)
    make_replica(model, declared, gpu_indices=(0, 1))
    plain = make_model("plain", gpus=2)
    make_replica(plain, derived, gpu_indices=(0, 1))
    nodes = {n.pk: Node.objects.get(pk=n.pk) for n in (measured, declared, derived, unknown)}
    draws = power.node_draws(nodes)
    assert draws[measured.pk] == 8 * 500 + 400  # every card measured, and RAPL
    assert draws[declared.pk] == 2500  # declared beats the cards' 2 x 700 W
    assert draws[derived.pk] == 1400  # nothing declared or measured: the TDP
    assert draws[unknown.pk] is None  # no shard, no reading: unknown, not zero


def test_a_shard_that_would_pass_the_cap_is_refused_with_the_numbers() -> None:
    full = make_node("full", gpus=8, labels={RACK: "r12"}, sample=sample(1725.0, rapl=400.0))  # 14.2 kW
    make_node("spare", gpus=8, labels={RACK: "r13"}, sample=sample(None, rapl=None))
    power.apply_budgets([{"domain": "rack=r12", "watts": 15000}], source="api", replace=False)
    model = make_model("m", gpus=2)  # 2 x H100: 1.4 kW by TDP
    inventory = build_inventory()
    request = replica_request(model)
    result = place(inventory, request)
    assert result.placement is not None and result.placement.shards[0].node_name == "spare"
    verdicts = {v.node_name: v for e in explain(inventory, request) for v in e.nodes}
    assert [r.message for r in verdicts["full"].reasons] == [
        "rack=r12: 14.2 kW of 15.0 kW drawn, this replica adds 1.4 kW"
    ]
    # Declared draw counts over the TDP; an unknown one is not refused.
    model.profiles.update(power_watts=700)
    assert place(build_inventory(), replica_request(model)).placement.shards[0].node_name == "spare"  # type: ignore[union-attr]
    overview = {d["domain"]: d for d in services.facility_overview()["domains"]}
    assert (overview["rack=r12"]["cap_watts"], overview["rack=r12"]["drawn_watts"]) == (15000, 14200.0)
    assert overview["rack=r13"]["cap_watts"] is None
    assert full.pk


def test_replicas_placed_one_after_another_count_against_the_cap() -> None:
    make_node("a", gpus=8, labels={RACK: "r1"}, sample=sample(None, rapl=None))
    power.apply_budgets([{"domain": "rack=r1", "watts": 3000}], source="api", replace=False)
    model = make_model("m", gpus=2)
    inventory = build_inventory()
    placed = 0
    for i in range(3):
        request = replica_request(model)
        request.replica_id = f"r{i}"
        result = place(inventory, request)
        if result.placement is None:
            assert any(
                r.message == "rack=r1: 2.8 kW of 3.0 kW drawn, this replica adds 1.4 kW" for r in result.rejections
            )
            break
        inventory.apply_request(result.placement, request)
        placed += 1
    assert placed == 2


def test_unknown_draw_is_said_in_the_overview() -> None:
    make_node("a", gpus=8, labels={RACK: "r1"}, sample=sample(None, rapl=None))
    make_node("b", gpus=8, labels={RACK: "r1"}, sample=sample(600.0, rapl=200.0))
    power.apply_budgets([{"domain": "rack=r1", "watts": 20000}], source="api", replace=False)
    [rack] = [d for d in services.facility_overview()["domains"] if d["domain"] == "rack=r1"]
    assert (rack["drawn_watts"], rack["draw_unknown"]) == (8 * 600 + 200, 1)


def test_measured_draw_is_the_highest_reading_of_the_last_five_minutes() -> None:
    from django.utils import timezone

    from apps.cluster.history import append_histories

    node = make_node("w", gpus=8, labels={RACK: "r1"}, sample=sample(300.0, rapl=100.0))
    now = timezone.now().timestamp()
    for age, watts in ((900, 1000.0), (120, 650.0), (30, 300.0)):  # fifteen minutes ago, two, half a minute
        append_histories({node.pk: {**sample(watts, rapl=200.0), "taken_at": now - age}})
    draws = power.node_draws({node.pk: Node.objects.get(pk=node.pk)})
    assert draws[node.pk] == 8 * 650 + 200  # the peak within the window; the older one is past it
    make_replica(make_model("m", gpus=8), node, gpu_indices=tuple(range(8)))
    overview = {d["domain"]: d for d in services.facility_overview()["domains"]}
    assert overview["rack=r1"]["cap_watts"] is None
    assert power.node_draws({node.pk: Node.objects.get(pk=node.pk)})[node.pk] == 8 * 700  # TDP beats 650 W


def test_a_nodes_base_counts_with_its_shards_and_alone() -> None:
    base = "llmgw.io/base-watts"
    busy = make_node("busy", gpus=8, labels={base: "2000"}, sample=sample(None, rapl=None))
    idle = make_node("idle", gpus=8, labels={base: "1800"}, sample=sample(None, rapl=None))
    typo = make_node("typo", gpus=8, labels={base: "lots"}, sample=sample(None, rapl=None))
    make_replica(make_model("m", gpus=2), busy, gpu_indices=(0, 1))
    nodes = {n.pk: Node.objects.get(pk=n.pk) for n in (busy, idle, typo)}
    draws = power.node_draws(nodes)
    assert draws[busy.pk] == 2000 + 2 * 700  # its base and its shard's TDP
    assert draws[idle.pk] == 1800  # powered on with nothing placed: its base
    assert draws[typo.pk] is None  # a base that is not a number says nothing
