"""A model grows under load and shrinks back when the load is gone, with the real llama.cpp engine."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import alive
from tests.e2e.test_models import llama_server
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e


class Load:
    """A few clients sending requests through the gateway without pause until stopped."""

    def __init__(self, url: str, key: str, clients: int) -> None:
        self.url, self.key = url, key
        self.stopped = threading.Event()
        self.replicas: set[str] = set()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]

    def client(self) -> None:
        body = json.dumps(
            {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 48, "ignore_eos": True}
        ).encode()
        while not self.stopped.is_set():
            request = urllib.request.Request(
                self.url + "/v1/chat/completions",
                data=body,
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    response.read()
                    self.statuses.append(response.status)
                    self.replicas.add(response.headers.get("x-llmgw-replica", ""))
            except urllib.error.HTTPError as exc:
                self.statuses.append(exc.code)

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(timeout=90)


@pytest.mark.skipif(llama_server() is None, reason="no llama-server binary (run scripts/ensure-llama-server)")
def test_a_busy_model_gets_a_second_replica_and_gives_it_back_when_quiet(tmp_path: Path) -> None:
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
                        "replicas": {"min": 1, "max": 2},
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "512MB",
                                "cpu_cores": 1,
                                "parallel": 1,
                                "context_size": 256,
                            }
                        ],
                    }
                ]
            }
        )
    )
    env = {"LLMGW_LLAMA_SERVER": llama_server() or "", "LLMGW_SCALE_DOWN_AFTER_SECONDS": "10"}
    pids: set[int] = set()

    def tiny(ready: int, live: int) -> dict | None:
        model = plane.api("GET", "models/tiny")
        pids.update(s["pid"] for r in model["replicas"] for s in r["shards"] if s.get("pid"))
        status = model["status"]
        live_now = len([r for r in model["replicas"] if r["state"] != "stopping"])
        return model if status["ready"] == ready and live_now == live else None

    try:
        with ControlPlane(tmp_path, extra_env=env) as plane:
            assert plane.ctl("model", "apply", "-f", str(models))[0] == 0
            plane.wait_for(lambda: tiny(1, 1), timeout=90, what="one replica ready")

            # One slot, three clients: requests wait in the gateway, which asks for a second replica.
            with Load(plane.url, plane.key, clients=3) as load:
                grown = plane.wait_for(lambda: tiny(2, 2), timeout=90, what="a second replica for the load")
                assert grown["load_replicas"] == 2 and grown["busy_at"] and grown["status"]["wanted"] == 2
                served = len(load.statuses)
                plane.wait_for(
                    lambda: len(load.replicas) == 2 and len(load.statuses) > served + 6,
                    timeout=60,
                    what="both replicas serving",
                )
            assert set(load.statuses) == {200}
            _code, shown, _err = plane.ctl("model", "show", "tiny")
            assert "2 ready of 2 wanted (1 always running, up to 2 under load)" in shown

            # Quiet for LLMGW_SCALE_DOWN_AFTER_SECONDS: back to the one always-running replica.
            quiet = plane.wait_for(lambda: tiny(1, 1), timeout=90, what="back to one replica")
            assert quiet["load_replicas"] == 0 and quiet["status"]["wanted"] == 1
    finally:
        for pid in pids:
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)
        time.sleep(0.2)
