"""`llmgw web` says nothing it need not: its start, a browser's first pages (with the favicon it
asks for), the API's docs and schema (in English and Turkish), static files and the agent's bundle
(streamed answers, under ASGI) log no warning and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, Browser, free_port, llmgw_env

pytestmark = pytest.mark.e2e

PASSWORD = "quiet horse battery staple"


def _manage(env: dict[str, str], *args: str) -> None:
    argv = [sys.executable, "-m", "llmgw", "manage", *args]
    subprocess.run(argv, env=env, cwd=REPO, check=True, timeout=300, capture_output=True)


def _wait_healthy(url: str, web: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert web.poll() is None, "llmgw web exited"
        time.sleep(0.1)
    pytest.fail("llmgw web did not answer /healthz")


def _fetch(url: str, method: str = "GET") -> tuple[int, bytes]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _browse(url: str) -> None:
    browser = Browser(url)
    status, page = browser.post_form("/login/", {"username": "quiet@example.com", "password": PASSWORD})
    assert status == 200, page[:300]
    icons = re.findall(r'<link rel="icon" href="([^"]+)"', page)
    assert len(icons) == 2, "the console names its icon, so browsers need not guess /favicon.ico"
    assets = icons + re.findall(r'(?:href|src)="(/static/[^"]+\.(?:css|js))"', page)
    for asset in assets:
        assert _fetch(url + asset)[0] == 200, asset
        assert _fetch(url + asset, method="HEAD")[0] == 200, asset
    status, body = _fetch(url + "/favicon.ico")
    assert status == 200 and body[:4] == b"\0\0\1\0", "an ICO file"
    status, body = _fetch(url + "/install/llmgw-agent.pyz")
    assert status == 200 and body[:2] == b"PK" and len(body) > 100_000, "the whole zip, streamed"
    for language in ("en", "tr"):
        for path in ("/api/v1/docs", "/api/v1/schema"):
            status, body = browser.get(path, headers={"Accept-Language": language})
            assert status == 200, (path, body[:300])


def test_the_web_process_starts_and_serves_its_first_pages_without_a_warning(tmp_path: Path) -> None:
    port = free_port()
    env = llmgw_env(tmp_path / "data", port, DJANGO_SUPERUSER_PASSWORD=PASSWORD)
    _manage(env, "migrate", "-v0")
    _manage(env, "collectstatic", "--noinput", "-v0")
    _manage(env, "createsuperuser", "--noinput", "--email", "quiet@example.com")
    log_path = tmp_path / "web.log"
    with log_path.open("wb") as log:
        web = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "web"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            _wait_healthy(f"http://127.0.0.1:{port}", web)
            _browse(f"http://127.0.0.1:{port}")
        finally:
            web.terminate()
            web.wait(timeout=30)
    lines = log_path.read_text(errors="replace").splitlines()
    assert any("Application startup complete" in line for line in lines), lines[:20]
    loud = [line for line in lines if re.search(r"warn|error|traceback|not found", line, re.IGNORECASE)]
    assert not loud, "\n".join(loud)
