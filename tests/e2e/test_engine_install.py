"""A node with no engine joins: the control plane reads the release from a server speaking
GitHub's API, the node installs the build for its hardware, serves a model with it, and loses it
at the next re-check once an upgrade takes a library away."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from llmgw.cli.up import stop_local_engines
from tests.engine_releases import LAUNCH_LIBRARY, ReleaseServer, have_cc, llama_tarball
from tests.enginebin import llama_server_path, missing_reason
from tests.fleet import FIXTURES, HOSTS, ControlPlane, fixtures_available

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(llama_server_path() is None, reason=missing_reason()),
    pytest.mark.skipif(not fixtures_available(), reason=f"no captured fixtures at {FIXTURES}"),
    pytest.mark.skipif(not have_cc(), reason="needs cc to build the engine's dynamically linked launcher"),
]

FAST = {"LLMGW_AGENT_HEARTBEAT_SECONDS": "1", "LLMGW_AGENT_MISSED_HEARTBEATS": "5"}


def chat(url: str, key: str) -> int:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_node_from_nothing_installs_its_engine_serves_and_loses_it_with_a_library(tmp_path: Path) -> None:
    from tests.ggufgen import make_tiny_gguf

    server = llama_server_path()
    assert server is not None
    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    with contextlib.ExitStack() as stack, ReleaseServer() as github:
        release = llama_tarball(tmp_path / "release", "b1", server=server, launcher=True)
        env = {**FAST, "LLMGW_ENGINE_RELEASES_API": github.url}
        with ControlPlane(tmp_path, extra_env=env, local_agent=False) as plane:
            assert plane.ctl("engine", "set", "llama.cpp", "b1")[0] == 0
            agent = plane.add_agent("cpu1", HOSTS["cpu"], settings={"engine_recheck_interval": 3})
            state = Path(agent.config_path).parent / "state"
            # Engines outlive their agent by design: the one this node starts is stopped at the end.
            stack.callback(stop_local_engines, state)
            plane.wait_for(lambda: plane.node("cpu1").get("status") == "ready", what="cpu1 ready")

            # The releases API has no such release yet: the node says so in its own words.
            def word() -> str | None:
                text = (plane.node("cpu1").get("engine_status") or {}).get("llama.cpp", "")
                return text if "cannot read" in text else None

            status = plane.wait_for(word, what="the node's word on its engine")
            assert status.startswith("waiting: the control plane cannot read release b1: HTTP 404"), status
            github.add("b1", release)
            code, out, _ = plane.ctl("engine", "refresh")
            assert code == 0 and re.search(r"llama\.cpp\s+b1\s+\d+ assets", out), out
            node = plane.wait_for(
                lambda: (n := plane.node("cpu1"))["engines"] and n,
                what="cpu1 reporting its installed engine",
                timeout=120,
            )
            # What runs, as its --version says: "b1" is only the tag the archive was published under
            said = subprocess.run([str(server), "--version"], capture_output=True, text=True, check=True, timeout=60)
            line = next(x for x in (said.stdout + said.stderr).splitlines() if x.startswith("version:"))
            running = line.removeprefix("version:").strip() + ", cpu-x64"
            assert node["engines"] == [{"name": "llama.cpp", "version": running}]
            assert node["engine_status"] == {}
            code, out, _ = plane.ctl("nodes")
            assert f"llama.cpp {running}" in out
            # nothing but the release listing (control plane) and the archive (node) was asked for
            assert github.requests[0] == "/repos/ggml-org/llama.cpp/releases/tags/b1"
            assert any(r.endswith("llama-b1-bin-ubuntu-x64.tar.gz") for r in github.requests)

            spec = tmp_path / "tiny.yaml"
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
                                        "context_size": 256,
                                    }
                                ],
                            }
                        ]
                    }
                )
            )
            assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
            plane.wait_for(
                lambda: plane.api("GET", "models/tiny")["status"]["ready"] == 1, what="tiny ready", timeout=120
            )
            assert chat(plane.url, plane.key) == 200

            # The console asks the node's agent to run `llmgw doctor` and shows its answer.
            browser = plane.browser
            assert browser is not None
            _, page = browser.get("/nodes/cpu1/")
            assert 'data-action="doctor"' in page and 'data-engine-row="llama.cpp"' in page
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
            assert token
            request = urllib.request.Request(
                plane.url + "/nodes/cpu1/doctor/run",
                data=urllib.parse.urlencode({"csrfmiddlewaretoken": token.group(1)}).encode(),
                headers={"Referer": plane.url + "/nodes/cpu1/", "HX-Request": "true"},
            )
            with browser.opener.open(request, timeout=30) as answer:
                assert answer.status == 200

            def checks() -> str | None:
                _, fragment = plane.browser.get("/nodes/cpu1/doctor", headers={"HX-Request": "true"})  # type: ignore[union-attr]
                return fragment if 'data-check="engine llama.cpp"' in fragment else None

            fragment = plane.wait_for(checks, what="the node's doctor checks on its page", timeout=60)
            assert re.search(r'data-check="engine llama.cpp" data-status="pass"', fragment), fragment
            assert re.search(r'data-check="avx2" data-status="pass"', fragment), fragment
            assert re.search(r'data-check="control plane" data-status="pass"', fragment), fragment

            # An upgrade takes a library away: at the next re-check the node withdraws the engine,
            # says why, and is no longer offered it.
            install = state / "engines" / "llama.cpp" / "b1-cpu-x64"
            (install / "llama-b1" / LAUNCH_LIBRARY).unlink()
            node = plane.wait_for(
                lambda: (n := plane.node("cpu1"))["engines"] == [] and n,
                what="the engine withdrawn after its re-check",
                timeout=60,
            )
            status = node["engine_status"]["llama.cpp"]
            assert f"missing shared libraries: {LAUNCH_LIBRARY}" in status
            code, out, _ = plane.ctl("model", "explain", "tiny")
            assert code == 0 and "does not run the llama.cpp engine yet: failed: re-check of b1" in out, out
