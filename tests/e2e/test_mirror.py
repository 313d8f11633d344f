"""The mirror in a real `llmgw up` (its web, worker and beat): `ctl mirror add` takes several URLs
and refuses a repository page with the reason; the worker fetches from a Hub of ours through the
Hub's redirect to its storage host; `ctl mirror` shows each file held, and the manifest is given."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

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
