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
from tests.fleet import ControlPlane
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
def test_a_model_from_the_mirror_is_fetched_by_the_node_verified_and_served(tmp_path: Path) -> None:
    """The newcomer's road, from the command line: a fresh `llmgw up` with its defaults (its own
    agent, no LLMGW_MIRROR_NODE_DIR), a model found on the Hub, fetched into the mirror and declared
    from it: the node fetches the file from the control plane into <data dir>/models/mirror, checks
    it against the manifest, reports it held (three folders below its model directory) and serves.

    This test once passed while that road failed: it set LLMGW_MIRROR_NODE_DIR inside the model
    directory of an agent of its own, whose model directory did not exist when it registered, so
    the node reported no storage and placement, knowing nothing of its weights, placed the replica
    before the probe (which looked only at the top of the directory) could say the file was missing.
    Here the node reports its model directory before the model is declared, and the replica is
    placed only once the node says it holds the file."""
    import json
    import urllib.request

    from llmgw.cli.up import stop_local_engines
    from tests.ggufgen import make_tiny_gguf

    weights = make_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    with HubServer([Repo("acme/tiny-GGUF", {"tiny-F32.gguf": weights})]) as hub, contextlib.ExitStack() as stack:
        env = {"LLMGW_HF_ENDPOINT": hub.url, "LLMGW_MIRROR_RESERVE_GB": "0"}
        env["LLMGW_LLAMA_SERVER"] = str(llama_server_path())
        with ControlPlane(tmp_path, extra_env=env) as plane:
            data_dir = Path(plane.running.env["LLMGW_DATA_DIR"]).resolve()  # type: ignore[union-attr]
            stack.callback(stop_local_engines, data_dir / "agent")
            node = next(n["name"] for n in plane.api("GET", "nodes")["results"])

            def storage() -> list[str] | None:
                sample = plane.node(node).get("sample") or {}
                return [d for pool in sample.get("storage") or [] for d in pool["directories"]] or None

            assert plane.wait_for(storage, what="the node's model directory reported") == [str(data_dir / "models")]
            assert [r["id"] for r in plane.api("GET", "mirror/search?q=tiny")["results"]] == ["acme/tiny-GGUF"]
            assert plane.ctl("mirror", "add", "hf://acme/tiny-GGUF/tiny-F32.gguf")[0] == 0
            plane.wait_for(
                lambda: all(v["state"] == "held" for v in plane.api("GET", "mirror")["versions"]) or None,
                what="the file held in the mirror",
            )
            (version,) = plane.api("GET", "mirror")["versions"]
            source = f"{data_dir}/models/mirror/acme--tiny-GGUF/{version['commit']}/tiny-F32.gguf"
            spec = tmp_path / "tiny.yaml"
            profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}
            profile["context_size"] = 256
            model = {"name": "tiny", "source": source, "replicas": 1, "profiles": [profile]}
            spec.write_text(json.dumps({"models": [model]}))
            assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
            plane.wait_for(
                lambda: plane.api("GET", "models/tiny")["status"]["ready"] == 1, what="tiny ready", timeout=180
            )
            assert Path(source).read_bytes() == weights  # fetched whole, where the source names it
            sample = plane.node(node)["sample"]
            assert source in [w for pool in sample["storage"] for w in pool["weights"]]  # seen three folders down
            assert sample["mirror"] == [{"version": version["id"], "dir": str(Path(source).parent), "state": "held"}]
            (replica,) = plane.api("GET", "models/tiny")["replicas"]
            assert replica["failures"] == 0  # it never crash-looped
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
