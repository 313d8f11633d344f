"""The parts other apps add to placement's node snapshots (apps.cluster.extensions.SnapshotPart): the
fabrics and NVLink domain of each node (apps.fabrics) and its location, holds and power (apps.facility).
Each is declared once, as a TypedDict behind the SnapshotField its app's placement rules read; the live
snapshot (the apps' contribute_snapshots) and the simulator's fleet must both fill it in that shape,
so a key misspelt on either side fails here (and in mypy) rather than reading as "unknown"."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, NotRequired

import pytest

from apps.cluster.inventory import build_inventory
from apps.cluster.placement import NodeSnapshot, SnapshotField
from apps.fabrics.placement import FABRICS, NVLINK, FabricAttachment, NvlinkPart
from apps.facility import power
from apps.facility import services as facility
from apps.facility.placement import FACILITY, FacilityPart, HeldDomain
from apps.sim import run, scenario
from tests.builders import make_node
from tests.fabrics.test_nvlink_services import card, tray_sample
from tests.fabrics.test_services import SM_A, ib, managers
from tests.fabrics.test_services import node as fabric_node
from tests.sim.test_sim import FIXTURES

HERE = Path(__file__).resolve().parent


def keys(shape: Any) -> tuple[set[str], set[str]]:
    """A TypedDict's (required, optional) keys, read from its annotations (the modules that declare
    them postpone annotations, which leaves __required_keys__ counting NotRequired ones too)."""
    hints = typing.get_type_hints(shape, include_extras=True)
    optional = {name for name, hint in hints.items() if typing.get_origin(hint) is NotRequired}
    return set(hints) - optional, optional


def misshapen(value: Any, shape: Any) -> str | None:
    """Why `value` is not of the TypedDict `shape` (its keys), None when it is."""
    if not isinstance(value, dict):
        return f"not a mapping: {value!r}"
    required, optional = keys(shape)
    missing, unknown = required - set(value), set(value) - required - optional
    if missing or unknown:
        return f"missing {sorted(missing)}, unknown {sorted(unknown)} in {value!r}"
    return None


def parts(nodes: dict[int, NodeSnapshot], field: SnapshotField[Any]) -> list[Any]:
    return [value for node in nodes.values() if (value := field.get(node)) is not None]


def check(nodes: dict[int, NodeSnapshot]) -> None:
    fabrics = [a for found in parts(nodes, FABRICS) for a in found]
    nvlink = parts(nodes, NVLINK)
    places = parts(nodes, FACILITY)
    assert fabrics and nvlink and places, "every part is filled for some node"
    problems = [misshapen(a, FabricAttachment) for a in fabrics]
    problems += [misshapen(d, NvlinkPart) for d in nvlink]
    problems += [misshapen(f, FacilityPart) for f in places]
    problems += [misshapen(h, HeldDomain) for f in places for h in f["held"]]
    assert [p for p in problems if p] == []


@pytest.mark.django_db
def test_the_live_snapshot_fills_each_part_in_its_declared_shape() -> None:
    fabric_node("ib1", ib("mlx5_0", SM_A), sample=managers(SM_A, SM_A))
    tray = [card(i) for i in range(4)]
    make_node("t1", cards=tray, sample=tray_sample(tray))
    make_node("r1-a", gpus=8, labels={"llmgw.io/rack": "r1"})
    power.apply_budgets([{"domain": "rack=r1", "watts": 15000}], source="api", replace=False)
    facility.hold("rack", "r1", reason="PDU swap", actor=None)
    nodes = build_inventory().nodes
    check(nodes)
    [place] = [f for f in parts(nodes, FACILITY) if f["location"].get("rack") == "r1"]
    assert set(place) == {"location", "held", "caps", "draw_w"} and place["held"][0]["reason"] == "PDU swap"


def test_the_simulators_fleet_fills_each_part_in_its_declared_shape() -> None:
    fabric = "    fabric: {name: ib-a, per_leaf: 2}\n"
    data = (HERE.parent / "sim" / "small.yaml").read_text().replace(fabric, fabric + "    nvlink_domain: 2\n")
    simulation = run.Simulation(scenario.parse(data, base=HERE.parent / "sim", captures=FIXTURES))
    check(simulation.store.nodes)
    capped = [f for f in parts(simulation.store.nodes, FACILITY) if "caps" in f]
    assert capped and all(set(f) == {"location", "held", "caps", "draw_w"} for f in capped)
