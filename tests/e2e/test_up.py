"""`llmgw up` from the outside, as a newcomer would run it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.helpers import REPO, Browser, alive, descendants, free_port, llmgw_env, llmgw_up

pytestmark = pytest.mark.e2e


def test_up_serves_sign_in_keys_api_admin_and_stops_every_child(tmp_path) -> None:
    with llmgw_up(tmp_path) as up:
        password = up.wait_for_line(r"created the first administrator (\S+) with password (\S+)")
        email, secret_password = password.group(1), password.group(2)
        up.wait_for_line(r"llmgw up: ready at ")

        with urllib.request.urlopen(up.url + "/readyz", timeout=30) as response:
            ready = json.load(response)
        scheduler = ready.pop("scheduler")  # which beat acts: the worker's, once it has taken the lease
        assert set(scheduler) == {"acting", "since", "renewed_at"}
        assert ready == {"ready": True, "database": "ok", "broker": "ok", "channel_layer": "ok"}

        browser = Browser(up.url)
        status, page = browser.post_form("/login/", {"username": email, "password": secret_password})
        assert status == 200 and 'data-count="nodes"' in page, page[:500]

        status, page = browser.post_form("/account/keys/", {"name": "e2e", "expires": "7"})
        key = re.search(r'id="new-key">(llmgw_[^<]+)<', page)
        assert key, page[:1000]
        status, body = browser.get("/api/v1/me", headers={"Authorization": f"Bearer {key.group(1)}"})
        assert status == 200
        assert json.loads(body)["email"] == email

        assert browser.get("/api/v1/schema")[0] == 200
        assert browser.get("/django-admin/")[0] == 200
        status, metrics = browser.get("/metrics")
        assert status == 200 and "llmgw_build_info" in metrics

        # The password was printed once and is not in the database in clear.
        assert sum(secret_password in line for line in up.lines) == 1

        children = descendants(up.process.pid)
        assert len(children) >= 2, up.lines
        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in children):
            time.sleep(0.2)
        assert [pid for pid in children if alive(pid)] == []


def test_up_refuses_a_taken_port_in_one_line(tmp_path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = llmgw_env(tmp_path, port)
        env.pop("LLMGW_REDIS_URL", None)
        result = subprocess.run(
            [sys.executable, "-m", "llmgw", "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"llmgw up: cannot start: port {port} on 127.0.0.1 is already in use by another program"
    )


def test_up_refuses_an_unreachable_redis_in_one_line(tmp_path) -> None:
    env = llmgw_env(tmp_path, free_port(), LLMGW_REDIS_URL="redis://127.0.0.1:1/0")
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.startswith("llmgw up: cannot start: Redis at redis://127.0.0.1:1/0 does not answer")
    assert len(result.stderr.strip().splitlines()) == 1


def test_up_refuses_an_unreachable_postgresql_in_one_line(tmp_path) -> None:
    env = llmgw_env(tmp_path, free_port(), LLMGW_DATABASE_URL="postgres://postgres@127.0.0.1:1/llmgw")
    env.pop("LLMGW_REDIS_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "up"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.startswith("llmgw up: cannot start: the database at 127.0.0.1 does not answer")
    assert os.path.exists(tmp_path / "secret_key")
