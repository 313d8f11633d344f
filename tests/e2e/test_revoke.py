"""A revoked node's agent stops its engines and stops knocking, with the real `llmgw up` and engine."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import alive
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e


def test_revoking_a_node_stops_its_engines_and_its_agent_waits_for_a_new_enrolment(tmp_path: Path) -> None:
    from tests.enginebin import llama_server_path
    from tests.ggufgen import make_tiny_gguf

    engine = llama_server_path()
    if engine is None:
        pytest.skip("no llama-server binary (run scripts/ensure-llama-server)")
    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    spec = tmp_path / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "tiny",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 1,
                                "context_size": 512,
                            }
                        ],
                    }
                ]
            }
        )
    )
    with ControlPlane(tmp_path, extra_env={"LLMGW_LLAMA_SERVER": str(engine)}) as plane:
        assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0

        def engine_pid() -> int | None:
            replicas = plane.api("GET", "models/tiny")["replicas"]
            ready = [r for r in replicas if r["state"] == "ready"]
            return ready[0]["shards"][0]["pid"] if ready and ready[0]["shards"][0]["pid"] else None

        pid = plane.wait_for(engine_pid, timeout=120, what="the tiny model's engine")
        assert alive(pid)
        listed = plane.api("GET", "nodes")
        node = (listed["results"] if isinstance(listed, dict) else listed)[0]["name"]
        plane.api("POST", f"nodes/{node}/revoke")
        plane.wait_for(lambda: not alive(pid), timeout=60, what="the revoked node's engine to stop")
        assert plane.running is not None
        plane.running.wait_for_line(r"refused this node", timeout=30)
        # It does not knock again with the credential the control plane refused.
        # The agent's INFO lines go to the log `llmgw up` writes, not to its terminal.
        log = Path(plane.running.env["LLMGW_DATA_DIR"]) / "logs" / "up.log"
        seen = log.stat().st_size
        time.sleep(6)
        with log.open(errors="replace") as handle:
            handle.seek(seen)
            later = handle.read()
        assert not re.search(r"reconnecting in|connection closed", later), later[-2000:]
        credential = Path(plane.running.env["LLMGW_DATA_DIR"]) / "agent" / "credential"
        assert not credential.exists() and credential.with_name("credential.refused").exists()
