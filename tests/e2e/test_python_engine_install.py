"""A GPU node builds vLLM when the operator names a version: the control plane reads vLLM's and
uv's releases from a server speaking GitHub's API and tells the node; the node's agent (its own
process) fetches uv, resolves and installs against a package index of ours with real uv, checks
the environment and reports it. A build choice the node's driver cannot meet is said, and the
environment that works stays."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.engine_releases import ReleaseServer
from tests.fleet import FIXTURES, HOSTS, ControlPlane, fixtures_available
from tests.python_index import SimpleIndex, engine_wheel, torch_wheel, uv_tarball

UV = Path(sys.executable).parent / "uv"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not fixtures_available(), reason=f"no captured fixtures at {FIXTURES}"),
    pytest.mark.skipif(not UV.is_file(), reason="uv is not installed in the test environment (dev extra)"),
]

FAST = {"LLMGW_AGENT_HEARTBEAT_SECONDS": "1", "LLMGW_AGENT_MISSED_HEARTBEATS": "5"}


def test_a_gpu_node_builds_vllm_and_keeps_it_when_a_build_choice_cannot_be_met(tmp_path: Path) -> None:
    import subprocess

    uv_version = subprocess.run([str(UV), "--version"], capture_output=True, text=True, check=True).stdout.split()[1]
    index = tmp_path / "index"
    engine_wheel(index, "0.11.0")
    torch_wheel(index, "2.9.0", available=True, cuda="12.9")
    torch = tmp_path / "torch"
    torch_wheel(torch, "2.9.0+cu130", available=True, cuda="13.0")
    wheel = engine_wheel(tmp_path / "release", "0.11.0", variant="cu130")
    uv, sidecar = uv_tarball(tmp_path / "uv", UV)
    with (
        ReleaseServer("vllm-project/vllm", also=("astral-sh/uv",)) as github,
        SimpleIndex(index) as pypi,
        SimpleIndex(torch) as pytorch,
    ):
        github.add("v0.11.0", wheel)
        github.add(uv_version, uv, repo="astral-sh/uv")
        github.add(uv_version, sidecar, repo="astral-sh/uv")
        env = {
            **FAST,
            "LLMGW_ENGINE_RELEASES_API": github.url,
            "LLMGW_TORCH_INDEX_URL": pytorch.url,
            "LLMGW_PYTHON_ENGINE_FREE_GB": "0.001",
        }
        with ControlPlane(tmp_path, extra_env=env, local_agent=False) as plane:
            assert plane.ctl("engine", "set", "vllm", "0.11.0")[0] == 0
            plane.add_agent(
                "gpu1", HOSTS["h100x8"], settings={"tools": {"package-index": pypi.url, "python": sys.executable}}
            )
            plane.wait_for(lambda: plane.node("gpu1").get("status") == "ready", what="gpu1 ready")

            def vllm() -> dict | None:
                node = plane.node("gpu1")
                return next((e for e in node.get("engines") or [] if e["name"] == "vllm"), None)

            # Driver 535: CUDA 13 is passed over, the index's CUDA 12.9 build is installed and checked.
            installed = plane.wait_for(vllm, what="gpu1 reporting vLLM", timeout=180)
            assert installed == {"name": "vllm", "version": "0.11.0 (cu129)"}
            assert f"/repos/astral-sh/uv/releases/tags/{uv_version}" in github.requests
            assert "/repos/vllm-project/vllm/releases/tags/v0.11.0" in github.requests

            # The operator asks for CUDA 13 on this node: its driver cannot run it, and it says so.
            code, out, _ = plane.ctl("engine-build", "gpu1", "cu13")
            assert code == 0 and "vLLM/SGLang build cu13" in out, out

            def word() -> str | None:
                return (plane.node("gpu1").get("engine_status") or {}).get("vllm")

            status = plane.wait_for(word, what="gpu1's word on the cu13 build", timeout=60)
            assert status == ("unavailable: CUDA 13.0 (cu130): needs NVIDIA driver 580 or newer, this node has 535"), (
                status
            )
            assert vllm() == {"name": "vllm", "version": "0.11.0 (cu129)"}  # the working one stays
            node = plane.node("gpu1")
            assert node["status"] == "ready"  # what vLLM cannot do is not a fault of the node
