"""The suite finds again the processes it started: an engine an agent started in a session of its
own outlived the agent the fleet tests killed (tests/e2e/test_gpu_time.py left a stand-in vLLM
running an hour after the suite); now the agent's whole following is killed with it, and the
session's end reports and kills whatever a test still left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests import processes
from tests.fleet import FleetAgent

# An "agent" that starts an "engine" in a session of its own, as the supervisor does, says its pid
# and waits to be killed.
AGENT = """
import subprocess, sys, time
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
print(engine.pid, flush=True)
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    for _ in range(100):
        if not processes._alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_every_process_a_test_starts_carries_the_sessions_mark() -> None:
    mark = os.environ[processes.RUN_MARK]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    try:
        assert any(left.pid == child.pid for left in processes.leftovers())
        assert processes.marked(processes.RUN_MARK, mark + "-another-session") == []
    finally:
        child.kill()
        child.wait()
    assert all(left.pid != child.pid for left in processes.leftovers())


def test_a_fleet_agent_is_finished_with_the_engines_it_started(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    env = {**os.environ, processes.OWNER_MARK: processes.owner(config)}
    agent = FleetAgent(name="a", config_path=config, env=env, log_path=tmp_path / "agent.log")
    agent.process = subprocess.Popen(  # type: ignore[assignment]
        [sys.executable, "-c", AGENT], env=env, stdout=subprocess.PIPE, start_new_session=True
    )
    assert agent.process.stdout is not None
    engine = int(agent.process.stdout.readline())
    try:
        agent.stop(signal.SIGKILL)  # what the fleet tests did: the engine outlived its agent
        assert agent.process.poll() is not None and processes._alive(engine)
        agent.finish()
        assert _gone(engine), "the agent's engine still runs"
    finally:
        processes.kill_marked(processes.OWNER_MARK, env[processes.OWNER_MARK])


def test_a_data_directorys_mark_is_the_same_for_each_llmgw_up_on_it(tmp_path: Path) -> None:
    assert processes.owner(tmp_path / "data") == processes.owner(tmp_path / "data" / ".." / "data")
    assert processes.owner(tmp_path / "data") != processes.owner(tmp_path / "other")
