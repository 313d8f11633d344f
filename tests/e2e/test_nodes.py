"""A GPU node joins a running llmgw, is measured, cordoned, lost and found again."""

from __future__ import annotations

import signal
import urllib.request

import pytest

from agent.probes.nvidia import parse_nvidia_smi_text
from agent.probes.procfs import parse_meminfo
from tests.fleet import FIXTURES, HOSTS, ControlPlane, fixtures_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not fixtures_available(), reason=f"no captured fixtures at {FIXTURES}"),
]

FAST = {"LLMGW_AGENT_HEARTBEAT_SECONDS": "1", "LLMGW_AGENT_MISSED_HEARTBEATS": "3"}


def test_a_gpu_node_joins_is_measured_cordoned_lost_and_found(tmp_path) -> None:
    spec = HOSTS["h100x8"]
    expected = parse_nvidia_smi_text((FIXTURES / spec.nvidia_text).read_text())  # type: ignore[operator]
    memory = parse_meminfo((FIXTURES / spec.meminfo).read_text()).total_bytes

    with ControlPlane(tmp_path, extra_env=FAST) as plane:
        code, out, err = plane.ctl("node", "add", "gpu9", "--label", "rack=r1")
        assert code == 0, err
        assert "token: llmgwe_" in out and "llmgw agent --config" in out

        gpu = plane.add_agent("gpu1", spec)
        plane.wait_for(lambda: plane.node("gpu1").get("status") == "ready", what="gpu1 ready")
        nodes = plane.wait_for(
            lambda: (
                [n for n in plane.api("GET", "nodes")["results"] if n["status"] == "ready"]
                if len([n for n in plane.api("GET", "nodes")["results"] if n["status"] == "ready"]) == 2
                else None
            ),
            what="the local node and gpu1 ready",
        )
        assert {n["name"] for n in nodes} >= {"gpu1"}

        detail = plane.node("gpu1")
        assert detail["summary"]["gpu_count"] == 8
        assert detail["summary"]["gpu_classes"] == ["H100-80GB"]
        assert detail["summary"]["memory_total_bytes"] == memory
        assert detail["summary"]["cpus"] == 8  # the /proc/stat of this fixture host lists 8 CPUs

        code, out, _ = plane.ctl("nodes")
        assert code == 0
        header, *rows = out.splitlines()
        assert header.split() == ["NAME", "STATUS", "CPU", "MEM", "GPU", "DISK", "ENGINES", "LOCATION", "AGE"]
        gpu_row = next(row.split() for row in rows if row.startswith("gpu1 "))
        assert gpu_row[1] == "ready"
        assert gpu_row[4] == "8×H100-80GB"
        assert gpu_row[5] == "-"  # no model directories configured: disk unknown, not 0
        # Its agent.yaml names no engine and it has installed none: it says what it waits for.
        line = next(row for row in rows if row.startswith("gpu1 "))
        assert "llama.cpp waiting: the control plane" in line, line
        assert len(rows) == 2

        # The node page shows each H100's temperature and power.
        status, page = plane.browser.get("/nodes/gpu1/")  # type: ignore[union-attr]
        assert status == 200
        first = expected.gpus[0]
        assert f"{first.temperature_gpu_c}" in page
        assert "H100-80GB" in page

        # Metrics carry them, labelled by node and card.
        with urllib.request.urlopen(plane.url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        line = next(
            m
            for m in metrics.splitlines()
            if m.startswith("llmgw_gpu_temperature_celsius{") and 'node="gpu1"' in m and 'gpu="0"' in m
        )
        assert float(line.rsplit(" ", 1)[1]) == float(first.temperature_gpu_c)  # type: ignore[arg-type]
        assert any(m.startswith("llmgw_gpu_power_draw_watts{") and 'node="gpu1"' in m for m in metrics.splitlines())
        assert 'llmgw_node_up{node="gpu1"} 1.0' in metrics

        # A cordon survives the agent's restart.
        assert plane.ctl("node", "cordon", "gpu1", "--reason", "fan noise")[0] == 0
        registered = plane.node("gpu1")["registered_at"]
        gpu.stop()
        gpu.start()
        plane.wait_for(lambda: plane.node("gpu1")["registered_at"] != registered, what="gpu1 re-registered")
        after = plane.node("gpu1")
        assert after["cordoned"] is True and after["cordon_reason"] == "fan noise"

        # Killed, the node becomes unreachable after the grace; back, it is ready again.
        gpu.stop(signal.SIGKILL)
        plane.wait_for(lambda: plane.node("gpu1")["status"] == "unreachable", timeout=30, what="gpu1 unreachable")
        with urllib.request.urlopen(plane.url + "/metrics", timeout=30) as response:
            assert 'llmgw_node_up{node="gpu1"} 0.0' in response.read().decode()
        gpu.start()
        plane.wait_for(lambda: plane.node("gpu1").get("status") == "ready", timeout=60, what="gpu1 ready again")

        # Revoked, its connection is closed and it cannot come back.
        assert plane.ctl("node", "revoke", "gpu1")[0] == 0
        plane.wait_for(lambda: "refused this node" in gpu.log(), timeout=30, what="the agent told it was cut off")
        assert plane.node("gpu1")["status"] == "revoked"


def test_a_used_enrollment_token_is_refused_with_the_reason(tmp_path) -> None:
    with ControlPlane(tmp_path, local_agent=False) as plane:
        first = plane.add_agent("cpu1", HOSTS["cpu"])
        plane.wait_for(lambda: plane.node("cpu1").get("status") == "ready", what="cpu1 ready")
        # A second agent given the same (now used) token is refused and says why.
        second = plane.add_agent("cpu2", HOSTS["cpu"], start=False)
        token = first.config_path.read_text().split("token: ")[1].split()[0]
        second.config_path.write_text(
            second.config_path.read_text().replace(second.config_path.read_text().split("token: ")[1].split()[0], token)
        )
        second.start()
        assert second.process is not None
        assert second.process.wait(timeout=60) == 1
        assert "already used" in second.log()
