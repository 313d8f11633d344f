"""A fabric mapped through one of its own nodes, and a replica across nodes placed by the map.

Four agents on one InfiniBand fabric, each with six active ports. The fabric is a
rail-optimised fat tree of two scalable units (SUs) of two hosts, one leaf per rail in each
SU. Beat asks one node to run ibnetdiscover, the control plane parses the text, and the
placement of a replica across two nodes then keeps both in one SU, although by name the two
first nodes are in different ones. When the mapping node's ibnetdiscover fails, the request
says why and another node is asked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_fabrics import FAST, MASTER, agent_settings, apply_two_node_model
from tests.fabrics.fattree import fat_tree
from tests.fleet import HOSTS, ControlPlane, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")

FABRIC = f"ib:{MASTER}"
UP = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_7", "mlx5_9")
# Node name -> the host of the map it is: a1 and a2 sit in different SUs.
HOSTS_OF = {"a1": "gpu0001", "a2": "gpu0003", "a3": "gpu0002", "a4": "gpu0004"}


def test_a_fabric_is_mapped_by_its_own_node_and_a_replica_across_nodes_keeps_to_one_unit(tmp_path: Path) -> None:
    tree = fat_tree(
        pods=1, sus_per_pod=2, hosts_per_su=2, rails=len(UP), spines_per_pod=2, uplinks=2, cores_per_group=0
    )
    with ControlPlane(tmp_path, extra_env={**FAST, "LLMGW_FABRIC_MAP_INTERVAL": "5"}, local_agent=False) as plane:
        agents = {}
        for name, host in HOSTS_OF.items():
            agent = plane.add_agent(name, HOSTS["h100-ib"], settings=agent_settings(tmp_path), start=False)
            for rail, device in enumerate(UP):
                agent.set_port_guid(device, tree.port_guid[(host, rail)])
            agent.set_topology(tree.text)
            agents[name] = agent.start()
        for name in agents:
            plane.wait_for(lambda name=name: plane.node(name).get("status") == "ready", what=f"{name} ready")

        def mapped() -> dict[str, Any] | None:
            view = plane.api("GET", f"fabrics/{FABRIC}/topology")
            return view if view.get("map") else None

        view = plane.wait_for(mapped, timeout=90, what="the fabric mapped")
        counts = view["map"]["counts"]
        assert (counts["leaves"], counts["spines"], counts["hosts"]) == (2 * len(UP), 2, 4)
        assert view["map"]["rails"]["aligned"] is True
        assert view["mapped_from"] == "a1"  # the first ready node by name
        live = view["live"][tree.port_guid[("gpu0002", 0)]]
        assert (live["node"], live["port"], live["up"]) == ("a3", "mlx5_0/1", True)
        [request] = [
            r for r in plane.api("GET", "agent-requests?kind=ibnetdiscover")["results"] if r["state"] == "answered"
        ][:1]
        assert request["result"]["counts"]["switches"] == counts["switches"]

        apply_two_node_model(plane, tmp_path)

        def placed() -> set[str] | None:
            replicas = plane.api("GET", "models/big")["replicas"]
            shards = replicas[0]["shards"] if replicas else []
            return {s["node"] for s in shards} if len(shards) == 2 else None

        nodes = plane.wait_for(placed, timeout=60, what="the replica placed")
        assert nodes in ({"a1", "a3"}, {"a2", "a4"}), nodes
        code, out, _ = plane.ctl("model", "explain", "big")
        assert code == 0 and "leaf lf-p1-su1-r0, lf-p1-su1-r1" in out, out

        # ibnetdiscover breaks on the node that maps the fabric: the request fails with the reason,
        # and the next one goes to another node.
        agents["a1"].set_topology(None)

        def failed() -> dict[str, Any] | None:
            rows = plane.api("GET", "agent-requests?kind=ibnetdiscover&state=failed")["results"]
            return rows[0] if rows else None

        row = plane.wait_for(failed, timeout=60, what="a failed map request")
        assert row["node"] == "a1" and "discover failed" in row["error"]
        plane.wait_for(
            lambda: any(
                r["node"] != "a1" and r["state"] == "answered"
                for r in plane.api("GET", "agent-requests?kind=ibnetdiscover")["results"]
            ),
            timeout=60,
            what="another node asked",
        )
        agents["a1"].set_topology(tree.text)
        again = plane.api("POST", f"agent-requests/{row['id']}/retry", {})
        assert again["retry_of"] == row["id"] and again["state"] == "pending"
        plane.wait_for(
            lambda: (
                next(r for r in plane.api("GET", "agent-requests")["results"] if r["id"] == again["id"])["state"]
                == "answered"
            ),
            timeout=60,
            what="the retry answered",
        )
