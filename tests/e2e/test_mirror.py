"""The mirror in a real `llmgw up` (its web, worker and beat): `ctl mirror add` takes several URLs
and refuses a repository page with the reason; the worker fetches from a Hub of ours through the
Hub's redirect to its storage host; `ctl mirror` shows each file held, and the manifest is given."""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import pytest

from tests.enginebin import llama_server_path, missing_reason
from tests.fleet import FIXTURES, HOSTS, ControlPlane, fixtures_available
from tests.mirror.ggufbytes import header
from tests.mirror.hubserver import HubServer, Repo

pytestmark = [pytest.mark.e2e]


def test_ctl_mirror_add_fetches_through_the_worker_and_the_manifest_follows(tmp_path: Path) -> None:
    model = header({"general.architecture": "llama", "llama.block_count": 2}) + os.urandom(3_000_000)
    files = {"tiny-Q4_K_M.gguf": model, "tiny-Q8_0.gguf": os.urandom(1_000_000), "README.md": b"# tiny\n"}
    with HubServer([Repo("acme/tiny-GGUF", files)]) as hub:
        env = {"LLMGW_HF_ENDPOINT": hub.url, "LLMGW_MIRROR_RESERVE_GB": "0"}
        with ControlPlane(tmp_path, extra_env=env, local_agent=False) as plane:
            code, _out, err = plane.ctl("mirror", "add", f"{hub.url}/acme/tiny-GGUF")
            assert code != 0 and "is a repository page, not a file" in err, err
            base = f"{hub.url}/acme/tiny-GGUF/resolve/main"
            code, out, err = plane.ctl("mirror", "add", f"{base}/tiny-Q4_K_M.gguf", f"{base}/tiny-Q8_0.gguf")
            assert code == 0, err

            def held() -> str | None:
                code, out, _ = plane.ctl("mirror")
                lines = [line for line in out.splitlines() if ".gguf" in line]
                return out if len(lines) == 2 and all(line.rstrip().endswith("held") for line in lines) else None

            out = plane.wait_for(held, what="both files held", timeout=90)
            assert "acme/tiny-GGUF" in out
            answer = plane.api("GET", "mirror")
            version = next(v for v in answer["versions"] if v["name"] == "tiny-Q4_K_M.gguf")
            manifest = plane.api("GET", f"mirror/{version['id']}/manifest")
            assert manifest["files"] == [
                {"path": "tiny-Q4_K_M.gguf", "size": len(model), "sha256": hashlib.sha256(model).hexdigest()}
            ]
            # The worker went to the storage host the Hub redirected it to.
            assert any(method == "STORAGE GET" for method, _path, _range in hub.requests)


@pytest.mark.skipif(llama_server_path() is None, reason=missing_reason())
@pytest.mark.skipif(not fixtures_available(), reason=f"no captured fixtures at {FIXTURES}")
def test_a_model_from_the_mirror_is_fetched_by_the_node_verified_and_served(tmp_path: Path) -> None:
    """Find it on the Hub, fetch it into the mirror, declare a model from it: the CPU node fetches
    the file from the control plane, checks it against the manifest, reports it held, and serves."""
    import json
    import urllib.request

    from llmgw.cli.up import stop_local_engines
    from tests.ggufgen import make_tiny_gguf

    server = llama_server_path()
    weights = make_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    models = tmp_path / "node-models"
    node_dir = models / "mirror"
    with HubServer([Repo("acme/tiny-GGUF", {"tiny-F32.gguf": weights})]) as hub, contextlib.ExitStack() as stack:
        env = {
            "LLMGW_HF_ENDPOINT": hub.url,
            "LLMGW_MIRROR_RESERVE_GB": "0",
            "LLMGW_MIRROR_NODE_DIR": str(node_dir),
            "LLMGW_AGENT_HEARTBEAT_SECONDS": "1",
        }
        with ControlPlane(tmp_path, extra_env=env, local_agent=False) as plane:
            agent = plane.add_agent(
                "cpu1", HOSTS["cpu"], settings={"engines": {"llama.cpp": str(server)}, "model_dirs": [str(models)]}
            )
            stack.callback(stop_local_engines, Path(agent.config_path).parent / "state")
            plane.wait_for(lambda: plane.node("cpu1").get("status") == "ready", what="cpu1 ready")
            assert [r["id"] for r in plane.api("GET", "mirror/search?q=tiny")["results"]] == ["acme/tiny-GGUF"]
            assert plane.ctl("mirror", "add", "hf://acme/tiny-GGUF/tiny-F32.gguf")[0] == 0
            plane.wait_for(
                lambda: all(v["state"] == "held" for v in plane.api("GET", "mirror")["versions"]) or None,
                what="the file held in the mirror",
            )
            (version,) = plane.api("GET", "mirror")["versions"]
            source = f"{node_dir}/acme--tiny-GGUF/{version['commit']}/tiny-F32.gguf"
            spec = tmp_path / "tiny.yaml"
            profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}
            profile["context_size"] = 256
            model = {"name": "tiny", "source": source, "replicas": 1, "profiles": [profile]}
            spec.write_text(json.dumps({"models": [model]}))
            assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
            plane.wait_for(
                lambda: plane.api("GET", "models/tiny")["status"]["ready"] == 1, what="tiny ready", timeout=120
            )
            assert Path(source).read_bytes() == weights  # fetched whole, where the source names it
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            request = urllib.request.Request(
                plane.url + "/v1/chat/completions",
                data=body.encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {plane.key}"},
            )
            with urllib.request.urlopen(request, timeout=60) as answer:
                assert answer.status == 200
            # The Hub served the file once, to the mirror; the node took it from the control plane.
            assert [m for m, _p, _r in hub.requests].count("STORAGE GET") == 1
