"""The fleet simulator: a scenario worked out by hand, the same decisions as the reconciler on the
database, and scenarios that are wrong said so with where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apps.cluster.choices import ReplicaState
from apps.sim import run, scenario
from tests.e2e.helpers import REPO

HERE = Path(__file__).resolve().parent
FIXTURES = Path(os.environ.get("LLMGW_FIXTURES_DIR") or REPO.parent / "shared" / "fixtures")


def small() -> scenario.Scenario:
    return scenario.parse((HERE / "small.yaml").read_text(), base=HERE, captures=FIXTURES)


def at(report: dict[str, Any], minute: float) -> dict[str, Any]:
    return next(s for s in report["steps"] if s["at"] == minute)


def test_the_small_scenario_comes_out_as_worked_out_by_hand() -> None:
    report = run.simulate(small())
    assert report["scenario"]["nodes"] == 4 and report["scenario"]["gpus"] == 32  # the capture's 8 cards a node
    start, lost, back, end = report["snapshots"]
    assert start["label"] == "start" and start["headroom"]["more_replicas"] == 8  # 32 cards / 4
    # Placed in the first pass, ready after ready_after (2 minutes).
    assert at(report, 0)["placed"] == 5 and at(report, 2)["ready"] == 5 and at(report, 9)["gpus_free"] == 4
    # Rack r01 lost: its three replicas fail...
    assert lost["event"] == "lose rack=r01" and lost["nodes_ready"] == 2
    assert lost["replicas"]["failed"] == 3
    # ... and a minute on, past the 10 s backoff, the critical replica preempts a standard one.
    assert at(report, 11)["preempted"] == 1 and report["preemptions"] == [{"at": 11.0, "replica": "small#5"}]
    assert at(report, 12) | {"at": 12.0} == {
        "at": 12.0,
        "ready": 1,
        "starting": 1,
        "pending": 3,
        "stopping": 0,
        "failed": 0,
        "placed": 1,
        "preempted": 0,
        "gpus_free": 0,
    }
    # Back: everything placed, the 4 free cards on one node that is not wholly free.
    assert back["replicas"]["starting"] == 3 and back["replicas"]["pending"] == 0
    assert end["replicas"] == {"ready": 5, "starting": 0, "pending": 0, "stopping": 0, "failed": 0}
    cls = end["classes"]["H100-80GB"]
    assert cls == {
        "gpus": 32,
        "free": 4,
        "free_on_whole_nodes": 0,
        "nodes_with_free": 1,
        "stranded": 0,
        "fragmentation": 1.0,
    }
    assert end["headroom"] == {"model": "small", "more_replicas": 1, "at_least": False}
    # Both big replicas ended on r02 (the preemption put the second there); the small ones on r01.
    assert end["per_rack"] == {"r01": {"replicas": 3, "gpus": 12}, "r02": {"replicas": 2, "gpus": 16}}
    # r01's cap: 2 x 1,500 W idle + 12 cards x 700 W (the H100's TDP).
    assert end["power"]["rack=r01"] == {"cap_w": 20000.0, "drawn_w": 11400.0, "headroom_w": 8600.0, "nodes_unknown": 0}


def test_a_pending_replica_says_why_and_its_free_cards_count_as_stranded() -> None:
    data = {
        "step": "1m",
        "duration": "3m",
        "node_types": {"gpu": {"gpus": {"class": "L40S", "count": 4}, "cpus": 64, "memory": "512GiB"}},
        "nodes": [{"type": "gpu", "count": 3}],
        "models": [
            {"name": "fits", "min": 2, "profiles": [{"accelerator": "L40S", "gpus": 3}]},
            {"name": "wide", "min": 1, "profiles": [{"accelerator": "L40S", "gpus": 2}]},
            {"name": "huge", "min": 1, "profiles": [{"accelerator": "L40S", "gpus": 4}]},
        ],
    }
    end = run.simulate(scenario.parse(data))["snapshots"][-1]
    # huge (4 cards) takes a whole node first? No: classes are equal, so models go by name: fits
    # takes 3 of two nodes, huge the third whole, wide finds 1 free card on each: pending.
    assert end["replicas"]["pending"] == 1
    (row,) = end["pending"]
    assert row["model"] == "wide" and row["reasons"] and row["reasons"][0]["code"]
    assert "free" in row["reasons"][0]["example"] or row["reasons"][0]["example"]
    assert end["gpus_stranded"] == 2 and end["classes"]["L40S"]["stranded"] == 2


def fleet_report(nodes: int, models: int, hours: int, *, sleep: bool = True, rebuild: bool = False) -> dict[str, Any]:
    """The bench's fleet simulated, timing left out. With `rebuild`, each step where claims changed
    builds the whole inventory anew instead of reading the capped nodes' draws again."""
    from bench.sim import scenario as fleet

    simulation = run.Simulation(scenario.parse(fleet(nodes=nodes, models=models, hours=hours), captures=FIXTURES))
    simulation.store.sleep = sleep
    if rebuild:

        def renew() -> None:
            simulation._contribute()
            simulation.store.rebuild()

        simulation._renew_draws = renew  # type: ignore[method-assign]
    out = simulation.run()
    out.pop("timing")
    return out


def test_sleeping_models_decide_exactly_what_a_full_pass_decides() -> None:
    slept, full = fleet_report(64, 40, 4), fleet_report(64, 40, 4, sleep=False)
    assert slept["preemptions"] == full["preemptions"]
    assert slept["steps"] == full["steps"]
    assert slept["snapshots"] == full["snapshots"]
    assert any(s["preempted"] for s in full["steps"]) or any(s["pending"] for s in full["steps"])


def test_power_draws_renewed_in_place_decide_what_a_rebuilt_inventory_decides() -> None:
    # Between events the simulation keeps its inventory and only reads the capped nodes' draws
    # again; here every such step builds the whole inventory anew instead, as the fleet's next
    # snapshot would be. A thousand capped nodes over ten hours see a replica released and
    # another made on one node in a step, which leaves the node's draw as it was.
    renewed, rebuilt = fleet_report(1000, 200, 10), fleet_report(1000, 200, 10, rebuild=True)
    assert renewed["steps"] == rebuilt["steps"]
    assert renewed["snapshots"] == rebuilt["snapshots"]


def test_a_replica_refused_for_power_is_placed_once_a_release_brings_the_racks_draw_down() -> None:
    # One rack of two 8-card H100 nodes, 1,500 W each idle, capped at 8.6 kW: 8 cards at 700 W.
    # "first" holds those 8 cards, so "second" is refused for power; at minute 5 first drops to one
    # replica, which stops and is released in the steps after, with no event on them: the draw the
    # next placement reads must follow, or second waits for ever.
    data = {
        "step": "1m",
        "duration": "12m",
        "ready_after": "1m",
        "node_types": {
            "h100": {"gpus": {"class": "H100-80GB", "count": 8}, "cpus": 64, "memory": "1TiB", "idle_watts": 1500}
        },
        "nodes": [{"type": "h100", "count": 2, "rack": {"size": 2, "pdus": 1}}],
        "models": [
            {
                "name": "first",
                "min": 2,
                "max": 2,
                "class": "critical",
                "profiles": [{"accelerator": "H100-80GB", "gpus": 4}],
            },
            {"name": "second", "min": 1, "profiles": [{"accelerator": "H100-80GB", "gpus": 4}]},
        ],
        "power": {"caps": {"rack=r01": "8.6kW"}},
        "events": [{"at": "5m", "set": {"model": "first", "min": 1, "max": 1}}],
    }
    report = run.simulate(scenario.parse(data))
    assert at(report, 4)["pending"] == 1
    (row,) = report["snapshots"][1]["pending"]
    assert row["model"] == "second" and row["reasons"][0]["code"] == "power_cap"
    placed = [s["at"] for s in report["steps"] if s["placed"]]
    assert placed[0] == 0 and len(placed) == 2 and 5 < placed[1] <= 8
    end = report["snapshots"][-1]
    assert end["replicas"]["pending"] == 0 and end["replicas"]["ready"] == 2
    assert end["power"]["rack=r01"]["drawn_w"] == 8600.0


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"modles": []}, "scenario.modles: unknown key (did you mean models?)"),
        ({"nodes": [{"type": "h200", "count": 2}]}, "nodes[0].type: no node type h200"),
        ({"nodes": [{"type": "gpu", "count": 0}]}, "nodes[0].count: must be a whole number of at least 1"),
        ({"events": [{"at": "5 minutes", "lose": {"rack": "r1"}}]}, "events[0].at: must be a duration"),
        ({"events": [{"at": "5m", "lose": {"rack": "r1"}, "hold": {"rack": "r1"}}]}, "events[0]: give exactly one"),
        ({"models": [{"name": "m", "min": 3, "max": 1, "profiles": [{"gpus": 1}]}]}, "models[0].max: (1) cannot be"),
        ({"models": [{"name": "m", "profiles": [{"gpus": 1}]}]}, "models[0].profiles[0].accelerator"),
        ({"report": {"model": "nope"}}, "report.model: no model nope"),
        ({"node_types": {"gpu": {"nvidia_smi": "../../etc/passwd"}}}, "node_types.gpu.nvidia_smi: no file"),
    ],
)
def test_a_wrong_scenario_is_refused_with_where_and_why(change: dict[str, Any], problem: str) -> None:
    data: dict[str, Any] = {
        "node_types": {"gpu": {"gpus": {"class": "H100-80GB", "count": 8}}},
        "nodes": [{"type": "gpu", "count": 2}],
        "models": [{"name": "m", "profiles": [{"accelerator": "H100-80GB", "gpus": 8}]}],
    }
    data.update(change)
    with pytest.raises(scenario.ScenarioError) as caught:
        scenario.parse(data, captures=FIXTURES / "nvidia-smi-q")
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_llmgw_sim_runs_a_file_and_says_what_is_wrong_with_another(tmp_path: Path) -> None:
    env = {**os.environ, "LLMGW_SIM_CAPTURES": str(FIXTURES)}
    done = subprocess.run(
        [sys.executable, "-m", "llmgw", "sim", str(HERE / "small.yaml"), "--out", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "lose rack=r01" in done.stdout.replace(": 2 nodes", "") or "lose" in done.stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["snapshots"][-1]["headroom"]["more_replicas"] == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [{type: gpu, count: 1}]\nmodels: []\nstep: fast\n")
    refused = subprocess.run(
        [sys.executable, "-m", "llmgw", "sim", str(bad)], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )
    assert refused.returncode == 2
    assert "scenario.step: must be a duration" in refused.stderr and "nodes[0].type: no node type gpu" in refused.stderr


# The same decisions as the reconciler on the database -------------------------------------------


def _db_state() -> dict[str, list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]]]:
    from apps.cluster.models import Replica

    found: dict[str, list[Any]] = {}
    for replica in Replica.objects.select_related("model").prefetch_related("shards__node"):
        shards = tuple(sorted((s.node.name, tuple(s.gpu_indices)) for s in replica.shards.all()))
        found.setdefault(replica.model.name, []).append((replica.state, shards))
    return {name: sorted(rows) for name, rows in found.items()}


def _sim_state(simulation: run.Simulation) -> dict[str, list[tuple[str, tuple[tuple[str, tuple[int, ...]], ...]]]]:
    nodes = simulation.store.nodes
    found: dict[str, list[Any]] = {}
    for replica in simulation.store.all_replicas():
        shards = tuple(sorted((nodes[s.node_id].name, tuple(s.gpu_indices)) for s in replica.shards))
        found.setdefault(replica.model.name, []).append((replica.state, shards))
    return {name: sorted(rows) for name, rows in found.items()}


@pytest.mark.django_db
def test_the_simulator_decides_what_the_reconciler_decides_on_the_same_fleet() -> None:
    from apps.catalog.models import Model
    from apps.cluster.reconciler import reconcile
    from apps.facility import services as facility
    from apps.sim.service import simulate_text
    from tests.builders import make_model, make_node

    for i in range(12):
        make_node(f"gpu{i:02d}", gpus=8, address=f"10.0.0.{i + 1}", labels={"llmgw.io/rack": f"r{i // 4}"})
    make_model("spare", replicas=6, gpus=4, capacity_class="opportunistic")
    make_model("steady", replicas=5, gpus=8)
    make_model("wide", replicas=3, max_replicas=5, gpus=2)
    reconcile()  # a fleet already running
    Model.objects.filter(name="wide").update(min_replicas=5)
    make_model("vital", replicas=4, gpus=8, capacity_class="critical")  # preempts what it outranks
    make_model("odd", replicas=2, gpus=3)
    make_model("never", replicas=1, gpus=16)  # bigger than any node: pending, with reasons
    facility.hold("rack", "r2", reason="PDU swap", actor=None)
    live = run.live_fleet()
    parsed = scenario.parse(
        {"from_cluster": True, "duration": "0m", "ready_after": "1d", "report": {"model": "odd"}},
        live=live["by_name"],
    )
    simulation = run.Simulation(parsed, live)
    report = simulation.run()
    reconcile()  # the real pass, on the database
    assert _sim_state(simulation) == _db_state()
    from apps.cluster.models import Replica

    db_pending = {
        r.model.name: sorted({j["code"] for j in r.rejections})
        for r in Replica.objects.filter(state=ReplicaState.PENDING).select_related("model")
    }
    sim_pending = {
        r.model.name: sorted({j["code"] for j in r.rejections})
        for r in simulation.store.all_replicas()
        if r.state == ReplicaState.PENDING
    }
    assert sim_pending == db_pending and "never" in db_pending
    held = {m.name for m in Model.objects.filter(held_until__isnull=False)}
    assert {m.name for m in simulation.store.by_id.values() if m.held_until} == held
    assert report["preemptions"] and held  # the case is one where preemption decides
    # The what-if path of the console starts from the same snapshot and changes nothing.
    before = _db_state()
    what = simulate_text({"from_cluster": True, "duration": "5m", "events": [{"at": "1m", "lose": {"rack": "r0"}}]})
    assert what["snapshots"][1]["nodes_ready"] == 8 and _db_state() == before
