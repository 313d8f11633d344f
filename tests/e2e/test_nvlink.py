"""GB200 trays in one multi-node NVLink domain, through a dropped card, IMEX down and a fabric
manager restart.

Four real agents on captured-shape GB200 trays (four cards each, domain 3b4f…/7, also on one
InfiniBand fabric). A replica across two trays is formed inside the domain and told to use
multi-node NVLink. Then one of its trays loses a card's fabric: the replica keeps running and
is reported at risk; IMEX stops on another tray; the fabric manager restarts and every card is
out for a while, so a new replica falls back to InfiniBand; the cards come back and the domain
is whole again. The API, the metrics, explain and the page follow each step.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_fabrics import FABRIC, FAST, agent_settings, metric
from tests.fleet import GB200_CLUSTER, HOSTS, ControlPlane, fabric_block, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")

DOMAIN = f"{GB200_CLUSTER}.7"
TRAY = (GB200_CLUSTER, 7, 4)
NAMES = ("t1", "t2", "t3", "t4")


def apply(plane: ControlPlane, tmp: Path, gpu_class: str, *names: str) -> None:
    """Declare models of one replica of two trays (four cards each) on vLLM (the fake engine)."""
    profile = {"name": "2x4", "engine": "vllm", "accelerator": gpu_class, "gpus_per_shard": 4, "nodes_per_replica": 2}
    models = [{"name": name, "source": f"/models/{name}", "replicas": 1, "profiles": [profile]} for name in names]
    spec = tmp / "models.yaml"
    spec.write_text(yaml.safe_dump({"models": models}))
    code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
    assert code == 0, err


def domain(plane: ControlPlane) -> dict[str, Any] | None:
    found = [d for d in plane.api("GET", "nvlink")["domains"] if d["domain"] == DOMAIN]
    return found[0] if found else None


def tray(plane: ControlPlane, name: str) -> dict[str, Any]:
    found = domain(plane) or {"nodes": []}
    return next((t for t in found["nodes"] if t["name"] == name), {})


def shards_of(plane: ControlPlane, model: str) -> list[dict[str, Any]] | None:
    replicas = plane.api("GET", f"models/{model}")["replicas"]
    shards = replicas[0]["shards"] if replicas else []
    return shards if len(shards) == 2 else None


def test_trays_are_placed_inside_their_domain_and_followed_through_failures(tmp_path: Path) -> None:
    with ControlPlane(tmp_path, extra_env=FAST, local_agent=False) as plane:
        settings = {**agent_settings(tmp_path), "gpu_check_interval": 1, "sample_interval": 1}
        agents = {name: plane.add_agent(name, HOSTS["gb200-ib"], settings=settings) for name in NAMES}
        for name in agents:
            plane.wait_for(lambda name=name: plane.node(name).get("status") == "ready", what=f"{name} ready")

        whole = plane.wait_for(
            lambda: (d := domain(plane)) and d["nodes_ready"] == 4 and d, timeout=60, what="the domain whole"
        )
        assert (whole["gpus"], whole["gpus_joined"], whole["imex_up"]) == (16, 16, 4)
        assert whole["label"] == "3b4f1a2c…/7" and whole["clique_id"] == "7"
        assert [t["name"] for t in whole["nodes"]] == list(NAMES)
        assert metric(plane, "llmgw_gpu_nvlink_joined", node="t1", gpu="2") == (
            {"domain": DOMAIN, "state": "Completed"},
            1.0,
        )
        assert metric(plane, "llmgw_imex_up", node="t3") == ({"state": "READY", "domain_state": "UP"}, 1.0)
        # Inside a tray, topo -m linked all four cards, and the node page shows the matrix.
        node = plane.node("t1")
        gpu_class = node["gpus"][0]["gpu_class"]

        apply(plane, tmp_path, gpu_class, "big")
        shards = plane.wait_for(lambda: shards_of(plane, "big"), timeout=60, what="the replica placed")
        for shard in shards:
            assert shard["env"]["NCCL_MNNVL_ENABLE"] == "1" and shard["env"]["NCCL_CUMEM_ENABLE"] == "1"
            assert "NCCL_IB_HCA" not in shard["env"]
        placed_on = sorted(s["node"] for s in shards)
        code, out, _ = plane.ctl("model", "explain", "big")
        assert code == 0 and "nvlink 3b4f1a2c…/7" in out, out

        # One card of a tray the replica runs on loses its fabric: that tray is out, the replica is
        # reported at risk and keeps running.
        first = placed_on[0]
        agents[first].set_fabrics(TRAY, {2: fabric_block(None, None, state="In Progress")})
        out_tray = plane.wait_for(
            lambda: (t := tray(plane, first)) and not t["ready"] and t, timeout=60, what="the tray out"
        )
        assert out_tray["problems"] == ["GPU 2: fabric In Progress"]
        assert [g["joined"] for g in out_tray["gpus"]] == [True, True, False, True]
        at_risk = domain(plane)["at_risk"]
        assert [(r["model"], r["node"]) for r in at_risk] == [("big", first)]
        assert metric(plane, "llmgw_gpu_nvlink_joined", node=first, gpu="2")[1] == 0.0
        replica = plane.api("GET", "models/big")["replicas"][0]
        assert replica["state"] not in ("stopping", "stopped", "failed")
        assert sorted(s["node"] for s in replica["shards"]) == placed_on

        # IMEX stops on another tray (waiting for peers), its channel gone too.
        others = [n for n in NAMES if n not in placed_on]
        agents[others[0]].set_imex("WAITING_FOR_PEERS", channel=False)
        imex_out = plane.wait_for(
            lambda: (t := tray(plane, others[0])) and not t["ready"] and t, timeout=60, what="IMEX down"
        )
        assert imex_out["problems"] == ["IMEX is WAITING_FOR_PEERS"]
        assert metric(plane, "llmgw_imex_up", node=others[0]) == (
            {"state": "WAITING_FOR_PEERS", "domain_state": "UP"},
            0.0,
        )
        # The fabric manager restarts: every card of every tray is out at once, and a second replica
        # of two trays can only be formed over InfiniBand.
        for name in NAMES:
            agents[name].set_fabrics(TRAY, {i: fabric_block(None, None, state="In Progress") for i in range(4)})
        plane.wait_for(lambda: (d := domain(plane)) and d["gpus_joined"] == 0 and d, timeout=60, what="every card out")
        apply(plane, tmp_path, gpu_class, "big", "second")
        second = plane.wait_for(lambda: shards_of(plane, "second"), timeout=60, what="the second replica placed")
        for shard in second:
            assert "NCCL_MNNVL_ENABLE" not in shard["env"]
            assert shard["env"]["NCCL_IB_HCA"].startswith("=mlx5_")
        code, out, _ = plane.ctl("model", "explain", "second")
        assert code == 0 and re.search(r"nvlink 3b4f1a2c…/7: GPU 0: fabric In Progress", out), out
        assert f"fabric ib-a ({FABRIC})" in out
        # The first replica still runs.
        assert sorted(s["node"] for s in plane.api("GET", "models/big")["replicas"][0]["shards"]) == placed_on

        # The fabric manager is back and IMEX with it: the domain is whole again.
        for name in NAMES:
            agents[name].set_fabrics(TRAY)
        agents[others[0]].set_imex("READY")
        back = plane.wait_for(
            lambda: (d := domain(plane)) and d["nodes_ready"] == 4 and d, timeout=60, what="the domain back"
        )
        assert back["at_risk"] == [] and back["gpus_joined"] == 16

        # The page draws the rack and the node page its matrix.
        assert plane.browser is not None
        status, page = plane.browser.get("/fabrics/nvlink/")
        assert status == 200
        assert f'data-domain="{DOMAIN}"' in page and page.count('class="nvl-tray nvl-ready"') == 4
        status, node_page = plane.browser.get("/nodes/t1/")
        assert status == 200, node_page[-3000:]
        assert 'data-field="nvlink-matrix"' in node_page and "NV18" in node_page and "mlx5_0" in node_page
