"""A change made by the worker reaches the node's agent at once, not with its next heartbeat."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import alive
from tests.e2e.test_models import llama_server
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

# Far longer than the wait below: a shard list that arrives only with a heartbeat (or with the
# worker's minute-long resend) cannot pass this test. On Redis the worker's message travels through
# the channel layer; without Redis each connection looks for a change every 2 s.
HEARTBEAT_SECONDS = 240


@pytest.mark.skipif(llama_server() is None, reason="no llama-server binary (run scripts/ensure-llama-server)")
def test_a_placed_replica_reaches_its_agent_without_waiting_for_a_heartbeat(tmp_path: Path) -> None:
    from tests.ggufgen import make_tiny_gguf

    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    models = tmp_path / "models.yaml"
    models.write_text(
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
                                "memory": "512MB",
                                "cpu_cores": 1,
                            }
                        ],
                    }
                ]
            }
        )
    )
    env = {"LLMGW_LLAMA_SERVER": llama_server() or "", "LLMGW_AGENT_HEARTBEAT_SECONDS": str(HEARTBEAT_SECONDS)}
    pid = None
    try:
        with ControlPlane(tmp_path, extra_env=env) as plane:
            local = plane.wait_for(
                lambda: next(iter(plane.api("GET", "nodes")["results"]), None), timeout=60, what="the local node"
            )
            # Wait for the agent's first heartbeat after registering, so the next one is far away.
            plane.wait_for(lambda: plane.node(local["name"]).get("sampled_at"), timeout=60, what="a first sample")
            assert plane.ctl("model", "apply", "-f", str(models))[0] == 0

            def engine_pid() -> int | None:
                replicas = plane.api("GET", "models/tiny")["replicas"]
                shards = replicas[0]["shards"] if replicas else []
                return shards[0].get("pid") if shards else None

            pid = plane.wait_for(engine_pid, timeout=HEARTBEAT_SECONDS / 4, what="the engine started by the agent")
    finally:
        if pid and alive(pid):
            os.killpg(pid, signal.SIGKILL)
