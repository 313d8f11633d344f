"""A node joins with the one command `llmgw ctl node add` prints: the script and the agent come
from the control plane itself (no package index), it checks the node with doctor and starts the
agent, which enrols and reports ready. Run with the system's own Python, outside the project's
virtualenv, as on a fresh node."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

SYSTEM_PYTHON = next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 to play the fresh node's")
def test_a_node_joins_with_the_one_line_ctl_node_add_prints(tmp_path: Path) -> None:
    env = {"LLMGW_AGENT_HEARTBEAT_SECONDS": "1"}
    with ControlPlane(tmp_path, extra_env=env, local_agent=False) as plane:
        code, out, err = plane.ctl("node", "add", "edge1", "--label", "rack=r7")
        assert code == 0, err
        match = re.search(r"^  (curl -fsSL \S+/install/node\.sh \| sudo LLMGW_TOKEN=(\S+) sh)$", out, re.MULTILINE)
        assert match, out
        command = match.group(1).replace("| sudo LLMGW_TOKEN=", "| env LLMGW_TOKEN=")  # root already
        node = tmp_path / "node"
        # A fresh node: the system's PATH (its own python3, curl, sha256sum), nothing of the project's.
        node_env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(node),
            "LLMGW_PREFIX": str(node / "opt"),
            "LLMGW_CONFIG_DIR": str(node / "etc"),
            "LLMGW_STATE_DIR": str(node / "state"),
            "LLMGW_NO_SYSTEMD": "1",
            # The control plane reads no release here, so this CPU node would compile llama.cpp from
            # the sdist on its package index: keep it off any real one.
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        }
        done = subprocess.run(["sh", "-c", command], env=node_env, capture_output=True, text=True, timeout=120)
        pid_file = node / "state" / "agent.pid"
        try:
            assert done.returncode == 0, done.stderr
            assert re.search(r"llmgw: agent llmgw-agent \S+ installed in \S+ \(sha256 [0-9a-f]{64}\)", done.stderr)
            assert "llmgw: checking this node (llmgw doctor):" in done.stderr
            assert re.search(r"^pass  control plane\s+\S", done.stderr, re.MULTILINE), done.stderr
            assert re.search(r"^(pass|warn)  avx2\s+", done.stderr, re.MULTILINE), done.stderr
            config = (node / "etc" / "agent.yaml").read_text()
            assert (
                f"token: {match.group(2)}" in config and oct((node / "etc" / "agent.yaml").stat().st_mode)[-3:] == "600"
            )
            ready = plane.wait_for(
                lambda: (n := plane.node("edge1")).get("status") == "ready" and n, what="edge1 ready", timeout=60
            )
            assert ready["labels"] == {"rack": "r7"}
            # Running the line again keeps agent.yaml (the token was used) and the agent installed.
            again = subprocess.run(["sh", "-c", command], env=node_env, capture_output=True, text=True, timeout=120)
            assert "agent.yaml exists: kept as it is" in again.stderr, again.stderr
            first = ready["registered_at"]
            plane.wait_for(
                lambda: plane.node("edge1").get("registered_at") != first, what="edge1 back with the new agent"
            )
            agents = subprocess.run(
                ["pgrep", "-f", f"{node}/opt/llmgw-agent.pyz agent"], capture_output=True, text=True
            )
            assert len(agents.stdout.split()) == 1, agents.stdout  # restarted, not doubled
        finally:
            if pid_file.exists():
                for pid in pid_file.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGTERM)
