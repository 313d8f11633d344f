"""Racks, a hold and a power cap on a running cluster: placement, explain, `ctl facility`, the API and
the facility page agree.

Four real agents on captured CPU hosts say their rack and PDU in agent.yaml; one of them is moved
to another rack with `ctl label` (the stored label wins). Rack r1 is held, rack r2 capped below
what one more replica would draw; a model of three replicas spreads over what is left, explain
names each node's rack and why r1 and r2 were refused, and releasing the hold lets r1 take one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.test_fabrics import FAST
from tests.fleet import HOSTS, ControlPlane, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")

RACKS = {"c1": "r1", "c2": "r2", "c3": "r3", "c4": "r3"}


def settings(tmp: Path, rack: str) -> dict[str, Any]:
    engine = tmp / "fake-llama-server"
    if not engine.exists():
        engine.write_text(
            '#!/bin/sh\ncase "$1" in --version) echo "version: 1 (b6500)"; exit 0 ;; esac\nexec sleep 120\n'
        )
        engine.chmod(0o755)
    labels = {"llmgw.io/site": "dc1", "llmgw.io/rack": rack, "llmgw.io/pdu": f"{rack}-a"}
    return {"labels": labels, "engines": {"llama.cpp": str(engine)}}


def model(replicas: int, profile: dict[str, Any]) -> dict[str, Any]:
    return {"name": "m", "source": "/models/m", "replicas": replicas, "profiles": [profile]}


def placed(plane: ControlPlane, model: str, count: int) -> list[str] | None:
    replicas = plane.api("GET", f"models/{model}")["replicas"]
    nodes = [s["node"] for r in replicas for s in r["shards"] if r["state"] != "stopping"]
    return sorted(nodes) if len(nodes) == count else None


def test_holds_caps_and_spread_agree_across_placement_explain_ctl_and_the_page(tmp_path: Path) -> None:
    with ControlPlane(tmp_path, extra_env=FAST, local_agent=False) as plane:
        for name, rack in RACKS.items():
            # c4 says r4 in its agent.yaml; the operator keeps it in r3.
            plane.add_agent(name, HOSTS["cpu"], settings=settings(tmp_path, "r4" if name == "c4" else rack))
        for name in RACKS:
            plane.wait_for(lambda name=name: plane.node(name).get("status") == "ready", what=f"{name} ready")
        code, out, err = plane.ctl("label", "c4", "llmgw.io/rack=r3", "llmgw.io/pdu=r3-b")
        assert code == 0 and "location: dc1/r3 pdu r3-b" in out, err
        assert plane.node("c4")["location"]["rack"] == "r3"

        assert plane.ctl("facility", "hold", "rack=r1", "--reason", "PDU swap")[0] == 0
        # c2 draws nothing known; a 1 kW declared replica would pass r2's 500 W cap.
        code, out, err = plane.ctl("facility", "budget", "rack=r2", "--watts", "500")
        assert code == 0, err
        profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "power_watts": 1000}
        spec = tmp_path / "models.yaml"
        spec.write_text(
            yaml.safe_dump({"models": [{"name": "m", "source": "/models/m", "replicas": 2, "profiles": [profile]}]})
        )
        code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
        assert code == 0, err
        # Spread: one replica on each of r3's two PDUs, none on the held or the capped rack.
        assert plane.wait_for(lambda: placed(plane, "m", 2), timeout=60, what="two replicas") == ["c3", "c4"]

        code, out, _ = plane.ctl("model", "explain", "m")
        assert code == 0
        assert "c1: node c1 is in rack=r1, which is held: PDU swap" in out, out
        assert "c2: rack=r2: 0.0 kW of 0.5 kW drawn, this replica adds 1.0 kW" in out, out
        assert "rack r3; pdu r3-b" in out

        code, out, _ = plane.ctl("facility")
        rows = {line.split()[0]: line for line in out.splitlines()[1:] if "=" in line.split()[0]}
        assert "held: PDU swap" in rows["rack=r1"] and "0.5 kW" in rows["rack=r2"]
        assert rows["rack=r3"].split()[1:3] == ["2", "c3,c4"]
        api = {d["domain"]: d for d in plane.api("GET", "facility")["domains"]}
        assert api["rack=r2"]["cap_watts"] == 500 and api["rack=r1"]["hold"]["reason"] == "PDU swap"
        assert plane.browser is not None
        status, page = plane.browser.get("/facility/")
        assert status == 200 and 'data-hold="rack=r1"' in page and "c4" in page

        # Released: a third replica may go to r1 now (r3 already has two, r2 is still capped).
        assert plane.ctl("facility", "release", "rack=r1")[0] == 0
        spec.write_text(
            yaml.safe_dump({"models": [{"name": "m", "source": "/models/m", "replicas": 3, "profiles": [profile]}]})
        )
        assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
        assert plane.wait_for(lambda: placed(plane, "m", 3), timeout=60, what="three replicas") == ["c1", "c3", "c4"]
