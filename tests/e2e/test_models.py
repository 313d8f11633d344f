"""A tiny model declared on `llmgw up`, served by the real llama.cpp engine."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import alive, drop_pg_database
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e


def llama_server() -> str | None:
    try:
        from tests.enginebin import llama_server_path
    except ImportError:
        return None
    path = llama_server_path()
    return str(path) if path else None


def chat(endpoint: str, key: str | None) -> tuple[int, dict]:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(endpoint + "/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, {}


@pytest.mark.skipif(llama_server() is None, reason="no llama-server binary (run scripts/ensure-llama-server)")
def test_a_tiny_model_runs_refuses_strangers_and_survives_a_control_plane_restart(tmp_path: Path) -> None:
    from tests.ggufgen import make_tiny_gguf

    # Where `llmgw up`'s own agent looks for weights: it reports them held, and explain says so.
    (tmp_path / "data" / "models").mkdir(parents=True)
    weights = make_tiny_gguf(tmp_path / "data" / "models" / "tiny.gguf")
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
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 2,
                                "context_size": 512,
                            }
                        ],
                    },
                    {
                        "name": "huge",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "100TB",
                                "cpu_cores": 1,
                            }
                        ],
                    },
                ]
            }
        )
    )
    engine_pid = None
    plane = None
    # Held time counted every 2 s instead of each minute, so that the run sees it counted.
    env = {"LLMGW_LLAMA_SERVER": llama_server() or "", "LLMGW_HELD_TIME_SECONDS": "2"}
    try:
        # With --keep-engines: stopping it leaves the engine for the next `llmgw up` to adopt.
        with ControlPlane(tmp_path, extra_env=env, keep_database=True, up_args=["--keep-engines"]) as plane:
            assert plane.ctl("model", "apply", "-f", str(models))[0] == 0
            assert plane.ctl("model", "apply", "-f", str(models))[1].count("unchanged") == 2  # idempotent
            ready = plane.wait_for(
                lambda: (lambda m: m if m["status"]["ready"] == 1 else None)(plane.api("GET", "models/tiny")),
                timeout=90,
                what="tiny ready",
            )
            shard = ready["replicas"][0]["shards"][0]
            engine_pid = shard["pid"]
            node = plane.node(shard["node"])
            endpoint = f"http://{node.get('address') or '127.0.0.1'}:{shard['port']}"
            secret = _secret(plane, ready["replicas"][0]["id"])
            status, answer = chat(endpoint, secret)
            assert status == 200 and answer["usage"]["completion_tokens"] > 0
            assert chat(endpoint, None)[0] == 401
            assert chat(endpoint, "wrong")[0] == 401
            # The agent reads the engine's own /metrics with its next heartbeat; the control plane
            # exports it as llmgw_engine_*: the tokens the engine generated are those it answered.
            replica = ready["replicas"][0]["id"]
            generated = plane.wait_for(
                lambda: engine_figure(plane.url, "llmgw_engine_generation_tokens_total", replica),
                timeout=30,
                what="the engine's figures in /metrics",
            )
            assert generated == answer["usage"]["completion_tokens"]
            assert (
                engine_figure(plane.url, "llmgw_engine_prompt_tokens_total", replica)
                == (answer["usage"]["prompt_tokens"])
            )
            assert engine_figure(plane.url, "llmgw_engine_requests_running", replica) == 0

            # The replica's one claimed core, counted for the model from its placement to now: the
            # usage API's core-hours are the seconds since placed_at, less at most a few counts late.
            from datetime import datetime

            placed = datetime.fromisoformat(ready["replicas"][0]["placed_at"]).timestamp()
            time.sleep(5)
            row = next(r for r in plane.api("GET", "usage?group_by=model")["results"] if r["group"] == "tiny")
            held = time.time() - placed
            assert row["gpu_hours"] == {} and held - 12 <= row["core_hours"] * 3600 <= held + 1, (row, held)

            # Too big for the node: explain names the node, the memory it has and the memory needed.
            code, out, _err = plane.ctl("model", "explain", "huge")
            assert code == 0
            assert f"{shard['node']}:" in out and "needs 102400" in out and "GB of memory" in out
            assert plane.api("GET", "models/huge")["status"]["pending"] == 1
            # The node the agent runs on holds tiny's weights (it reported them), and its score is broken down.
            code, out, _err = plane.ctl("model", "explain", "tiny")
            line = next(line for line in out.splitlines() if line.strip().startswith(f"{shard['node']}: fits"))
            assert code == 0 and "(score " in line and "weights " in line and "holds the weights" in line, out
            assert plane.stop() == 0

        # The control plane (web, worker, agent) stopped; with --keep-engines, the engine did not.
        assert engine_pid and alive(engine_pid)
        with ControlPlane(tmp_path / "again", extra_env=env, reuse=plane) as again:
            model = again.wait_for(
                lambda: (
                    lambda m: (
                        m if m["status"]["ready"] == 1 and m["replicas"][0]["shards"][0]["state"] == "ready" else None
                    )
                )(again.api("GET", "models/tiny")),
                timeout=90,
                what="tiny adopted",
            )
            assert model["replicas"][0]["shards"][0]["pid"] == engine_pid
            assert chat(endpoint, secret)[0] == 200
    finally:
        if engine_pid and alive(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)
            time.sleep(0.2)
        if plane is not None and plane.running is not None and plane.running.database:
            drop_pg_database(plane.running.database)


def engine_figure(base: str, name: str, replica: int) -> float | None:
    """The value of `name` for the replica in llmgw's /metrics, None while it has none."""
    with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def _secret(plane: ControlPlane, replica_id: int) -> str:
    """The engine's key, as the gateway will read it (the API never shows it)."""
    import subprocess
    import sys

    code = (
        "import django; django.setup(); from apps.cluster.models import Shard; "
        f"print(Shard.objects.get(replica_id={replica_id}, rank=0).secret)"
    )
    assert plane.running is not None
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**plane.running.env, "DJANGO_SETTINGS_MODULE": "llmgw.settings"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    )
    return result.stdout.strip().splitlines()[-1]
