"""What a new node fetches: the install script and the agent's one-file bundle, checked by digest."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from apps.cluster.onboarding import agent_bundle, install_command, install_script

pytestmark = pytest.mark.django_db

SYSTEM_PYTHON = "/usr/bin/python3"


def test_the_script_and_the_bundle_are_served_to_anyone(client: Any, settings: Any, tmp_path: Path) -> None:
    settings.DATA_DIR = tmp_path
    script = client.get("/install/node.sh")
    assert script.status_code == 200 and script["Content-Type"].startswith("text/x-shellscript")
    text = script.content.decode()
    assert "SERVER=http://testserver\n" in text
    assert subprocess.run(["sh", "-n"], input=text, text=True, check=False).returncode == 0  # parses
    digest = client.get("/install/llmgw-agent.pyz.sha256").content.decode().split()[0]
    bundle = b"".join(client.get("/install/llmgw-agent.pyz").streaming_content)
    assert hashlib.sha256(bundle).hexdigest() == digest
    assert client.get("/install/other.pyz").status_code == 404
    assert client.post("/install/node.sh").status_code == 405
    # built once, again only when the agent's code changes
    first = agent_bundle()
    assert agent_bundle() == first


@pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason="no system python3")
def test_the_bundle_runs_on_the_systems_python_without_the_projects_packages(settings: Any, tmp_path: Path) -> None:
    settings.DATA_DIR = tmp_path
    bundle, _ = agent_bundle()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([SYSTEM_PYTHON, "-I", str(bundle), "version"], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("llmgw-agent "), done.stderr
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import yaml, websockets; "
        "print(yaml.__file__, websockets.__file__)"
    )
    found = subprocess.run([SYSTEM_PYTHON, "-I", "-c", probe, str(bundle)], env=env, capture_output=True, text=True)
    assert found.stdout.count("llmgw-agent.pyz") == 2, found.stdout + found.stderr  # its own copies


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    folder = tmp_path / "served"
    (folder / "install").mkdir(parents=True)
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(folder))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", folder / "install"
    httpd.shutdown()


def test_an_agent_whose_digest_differs_is_not_installed(served: tuple[str, Path], tmp_path: Path) -> None:
    url, folder = served
    (folder / "llmgw-agent.pyz").write_bytes(b"PK tampered")
    (folder / "llmgw-agent.pyz.sha256").write_text("0" * 64 + "  llmgw-agent.pyz\n")
    node = tmp_path / "node"
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LLMGW_TOKEN": "llmgwe_x",
        "LLMGW_PREFIX": str(node / "opt"),
        "LLMGW_CONFIG_DIR": str(node / "etc"),
        "LLMGW_STATE_DIR": str(node / "state"),
        "LLMGW_NO_SYSTEMD": "1",
    }
    done = subprocess.run(["sh"], input=install_script(url), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "the control plane says " + "0" * 64 + ": not installed" in done.stderr
    assert not (node / "opt" / "llmgw-agent.pyz").exists() and not (node / "etc" / "agent.yaml").exists()
    no_token = {k: v for k, v in env.items() if k != "LLMGW_TOKEN"}
    done = subprocess.run(["sh"], input=install_script(url), env=no_token, capture_output=True, text=True)
    assert done.returncode == 1 and "LLMGW_TOKEN is not set" in done.stderr


def test_the_command_quotes_what_it_is_given() -> None:
    assert install_command("https://llm.example.com/", "llmgwe_abc") == (
        "curl -fsSL https://llm.example.com/install/node.sh | sudo LLMGW_TOKEN=llmgwe_abc sh"
    )
