"""A changed profile is rolled out to running replicas with the real agent and engine, and requests
sent all the while are all answered."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import alive
from tests.fleet import ControlPlane

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e


def _spec(weights: Path, parallel: int) -> dict:
    return {
        "models": [
            {
                "name": "tiny",
                "source": str(weights),
                "replicas": {"min": 1, "max": 2},
                "profiles": [
                    {
                        "name": "cpu",
                        "engine": "llama.cpp",
                        "accelerator": "cpu",
                        "memory": "512MB",
                        "cpu_cores": 0.5,
                        "parallel": parallel,
                        "context_size": 512,
                    }
                ],
            }
        ]
    }


def test_a_changed_profile_replaces_the_running_replica_while_requests_keep_being_answered(tmp_path: Path) -> None:
    from tests.enginebin import llama_server_path
    from tests.ggufgen import make_tiny_gguf

    engine = llama_server_path()
    if engine is None:
        pytest.skip("no llama-server binary (run scripts/ensure-llama-server)")
    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    spec = tmp_path / "models.yaml"
    spec.write_text(yaml.safe_dump(_spec(weights, 1)))
    with ControlPlane(tmp_path, extra_env={"LLMGW_LLAMA_SERVER": str(engine)}) as plane:
        assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0

        def ready_pids() -> list[int]:
            replicas = plane.api("GET", "models/tiny")["replicas"]
            return [r["shards"][0]["pid"] for r in replicas if r["state"] == "ready" and r["shards"][0]["pid"]]

        first = plane.wait_for(lambda: ready_pids() or None, timeout=120, what="tiny ready")[0]
        client = openai.OpenAI(base_url=plane.url + "/v1", api_key=plane.key, max_retries=0, timeout=60)
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        answers: list[str] = []
        stop = threading.Event()

        def keep_asking() -> None:
            while not stop.is_set():
                try:
                    client.chat.completions.create(
                        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                    )
                    answers.append("ok")
                except Exception as exc:  # noqa: BLE001 - counted, the assertion below says which
                    answers.append(f"{type(exc).__name__}: {exc}")

        asking = threading.Thread(target=keep_asking)
        asking.start()
        try:
            spec.write_text(yaml.safe_dump(_spec(weights, 2)))
            assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0

            def rolled() -> int | None:
                model = plane.api("GET", "models/tiny")
                ready = [r for r in model["replicas"] if r["state"] == "ready"]
                if model["status"]["rolling"] is None and len(ready) == 1 and ready[0]["shards"][0]["pid"] != first:
                    return ready[0]["shards"][0]["pid"]
                return None

            second = plane.wait_for(rolled, timeout=180, what="the replacement to take over")
        finally:
            stop.set()
            asking.join(timeout=90)
        command = Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")
        assert command[command.index(b"--parallel") + 1] == b"2"
        plane.wait_for(lambda: not alive(first) or None, timeout=60, what="the old engine to stop")
        failures = [a for a in answers if a != "ok"]
        assert answers and failures == [], failures[:3]

        # Deleted: no route serves it from the next request on, and its engine stops.
        assert plane.ctl("model", "delete", "tiny", "--yes")[0] == 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        plane.wait_for(lambda: not alive(second) or None, timeout=60, what="the deleted model's engine to stop")
        usage = plane.api("GET", "usage?group_by=model")
        assert any(row.get("group") == "tiny" for row in usage["results"])  # its history stays
