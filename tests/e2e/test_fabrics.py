"""InfiniBand fabrics end to end: real agents on hosts laid out from sysfs captures, `llmgw up`,
and a replica across nodes placed by the physical fabric the ports are on.

Five GPU nodes all declare "ib-a". Four see one subnet manager (with a standby) and one sees
another: "ib-a" is two fabrics, and a replica across two nodes must take both from one. One of
the four trained its cables at 100 Gb/s where the rest run 200: it goes last. Then the master
fails over (the fabric keeps its name), and a cable is pulled and plugged back in.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.fleet import HOSTS, ControlPlane, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")

FAST = {"LLMGW_AGENT_HEARTBEAT_SECONDS": "1", "LLMGW_AGENT_MISSED_HEARTBEATS": "5"}
MASTER = "0x0002c90300a1b2c3"
STANDBY = "0x0002c90300a1b2d0"
OTHER = "0x0002c90300ffee01"
FABRIC = f"ib:{MASTER}"
UP_PORTS = "=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_7,mlx5_9"  # mlx5_6 and mlx5_8 are INIT on these hosts


def agent_settings(tmp: Path) -> dict[str, Any]:
    engine = tmp / "fake-vllm"
    if not engine.exists():
        engine.write_text('#!/bin/sh\ncase "$1" in --version) echo "0.11.0"; exit 0 ;; esac\nexec sleep 120\n')
        engine.chmod(0o755)
    return {
        "fabrics": [{"name": "ib-a"}],
        "fabric_check_interval": 2,
        "fabric_change_interval": 1,
        "engines": {"vllm": str(engine)},
    }


def apply_two_node_model(plane: ControlPlane, tmp: Path) -> None:
    """Declare "big": one replica of 8 H100s on each of two nodes (vLLM, which the fake engine is)."""
    profile = {"name": "2x8", "engine": "vllm", "accelerator": "H100-80GB", "gpus_per_shard": 8, "nodes_per_replica": 2}
    spec = tmp / "models.yaml"
    spec.write_text(
        yaml.safe_dump({"models": [{"name": "big", "source": "/models/big", "replicas": 1, "profiles": [profile]}]})
    )
    code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
    assert code == 0, err


def metrics(plane: ControlPlane) -> str:
    with urllib.request.urlopen(plane.url + "/metrics", timeout=30) as response:
        return response.read().decode()


def metric(plane: ControlPlane, name: str, **match: str) -> tuple[dict[str, str], float] | None:
    """The one series of `name` whose labels include `match` (its other labels, its value), or None
    while it is absent or still reads ACTIVE for a port the test brought down."""
    for line in metrics(plane).splitlines():
        found = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if not found:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', found.group(1)))
        if all(labels.get(k) == v for k, v in match.items()):
            rest = {k: v for k, v in labels.items() if k not in match}
            if rest.get("state") == "ACTIVE":
                return None
            return rest, float(found.group(2))
    return None


def fabric(plane: ControlPlane, identity: str) -> dict[str, Any] | None:
    return next((f for f in plane.api("GET", "fabrics")["fabrics"] if f["id"] == identity), None)


def test_nodes_are_grouped_by_physical_fabric_placed_on_one_and_followed_through_failover_and_a_pulled_cable(
    tmp_path: Path,
) -> None:
    with ControlPlane(tmp_path, extra_env=FAST, local_agent=False) as plane:
        settings = agent_settings(tmp_path)
        agents = {
            name: plane.add_agent(name, HOSTS[spec], settings=settings, start=False)
            for name, spec in (
                ("gpu1", "h100-ib"),
                ("gpu2", "h100-ib"),
                ("gpu3", "h100-ib-edr"),
                ("gpu4", "h100-ib"),
                ("gpu5", "h100-ib"),
            )
        }
        agents["gpu5"].set_subnet_managers(OTHER, (OTHER, 15, 3))
        for agent in agents.values():
            agent.start()
        for name in agents:
            plane.wait_for(lambda name=name: plane.node(name).get("status") == "ready", what=f"{name} ready")

        def both() -> Any:
            answer = plane.api("GET", "fabrics")
            ids = {f["id"]: f for f in answer["fabrics"]}
            if FABRIC in ids and f"ib:{OTHER}" in ids and len(ids[FABRIC]["nodes"]) == 4:
                return answer
            return None

        answer = plane.wait_for(both, timeout=60, what="two fabrics under ib-a")
        main = next(f for f in answer["fabrics"] if f["id"] == FABRIC)
        assert main["names"] == ["ib-a"] and main["nodes"] == ["gpu1", "gpu2", "gpu3", "gpu4"]
        assert main["ports"] == 6 * 3 + 8  # the EDR host has all eight ports up
        assert main["expected_gbps"] == 200.0
        assert {s["port"].split()[0] for s in main["short"]} == {"gpu3"}
        assert [(s["guid"], s.get("priority"), s["master"]) for s in main["subnet_managers"]] == [
            (MASTER, 14, True),
            (STANDBY, 10, False),
        ]
        codes = [p["code"] for p in answer["problems"]]
        messages = " | ".join(p["message"] for p in answer["problems"])
        assert "fabric name ib-a covers 2 fabrics" in messages
        assert f"fabric ib:{OTHER} has no standby subnet manager" in messages
        assert codes.count("no_sm") == 2 * 4  # two INIT ports on each of the four HDR hosts
        assert "gpu1 mlx5_6/1 has a link but no subnet manager brought it up (INIT)" in messages

        apply_two_node_model(plane, tmp_path)

        def placed() -> list[dict[str, Any]] | None:
            replicas = plane.api("GET", "models/big")["replicas"]
            shards = replicas[0]["shards"] if replicas else []
            return shards if len(shards) == 2 else None

        shards = plane.wait_for(placed, timeout=60, what="the replica placed across two nodes")
        # On one physical fabric, never the other node that calls its fabric ib-a, and not the node
        # whose cables trained short while two at full rate are free.
        assert {s["node"] for s in shards} <= {"gpu1", "gpu2", "gpu4"}
        for shard in shards:
            assert shard["env"]["NCCL_IB_HCA"] == UP_PORTS
        code, out, _ = plane.ctl("model", "explain", "big")
        assert code == 0
        assert "gpu5: " in out and f"fabric ib-a (ib:{OTHER})" in out
        assert re.search(rf"gpu3: .*fabric ib-a \({FABRIC}\)", out), out

        # The master fails over to the standby: the ports see a new master, the fabric keeps its name.
        for name in ("gpu1", "gpu2", "gpu3", "gpu4"):
            agents[name].set_subnet_managers(STANDBY, (MASTER, 14, 2), (STANDBY, 10, 3))

        def failed_over() -> Any:
            found = fabric(plane, FABRIC)
            # Every port of the four nodes sees the new master (and none the old one).
            if found and [(s["guid"], s["master"]) for s in found["subnet_managers"]] == [
                (MASTER, False),
                (STANDBY, True),
            ]:
                return found
            return None

        after = plane.wait_for(failed_over, timeout=60, what="the failover seen on every node")
        assert {(c["previous"], c["master"]) for c in after["master_changes"]} == {(MASTER, STANDBY)}
        assert len(after["master_changes"]) == 6 * 3 + 8  # every active port saw it once
        assert after["nodes"] == ["gpu1", "gpu2", "gpu3", "gpu4"]  # still one fabric, under its name
        problems = plane.api("GET", "fabrics")["problems"]
        assert any(p["code"] == "master_changed" for p in problems)
        assert f'llmgw_fabric_master_sm{{fabric="{FABRIC}",guid="{STANDBY}"}} 1.0' in metrics(plane)

        # A cable pulled from gpu1's mlx5_0, and plugged back in.
        agents["gpu1"].set_port("mlx5_0", "1: DOWN", "3: Disabled")
        plane.wait_for(lambda: (fabric(plane, FABRIC) or {}).get("ports") == 6 * 3 + 8 - 1, what="the port down")
        down = plane.wait_for(
            lambda: metric(plane, "llmgw_ib_port_active", node="gpu1", device="mlx5_0"), what="the metric"
        )
        assert down == ({"state": "DOWN", "phys_state": "Disabled", "link_layer": "InfiniBand", "port": "1"}, 0.0)
        assert metric(plane, "llmgw_ib_port_flaps_total", node="gpu1", device="mlx5_0")[1] == 1.0
        assert metric(plane, "llmgw_ib_port_rate_gbps", node="gpu3", device="mlx5_0")[1] == 100.0
        agents["gpu1"].set_port("mlx5_0", "4: ACTIVE", "5: LinkUp")
        plane.wait_for(lambda: (fabric(plane, FABRIC) or {}).get("ports") == 6 * 3 + 8, what="the port back up")
