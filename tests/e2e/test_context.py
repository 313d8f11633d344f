"""A model declared with no context, served by the real llama-server under `llmgw up`: the engine's
own context reaches the gateway, and a 30 MB prompt is refused at once with the numbers instead
of reaching the engine (which held it for a minute before)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.enginebin import llama_server_path, missing_reason
from tests.fleet import ControlPlane

pytestmark = [pytest.mark.e2e]


@pytest.mark.skipif(llama_server_path() is None, reason=missing_reason())
def test_a_prompt_past_the_engines_own_context_is_refused_before_the_engine(tmp_path: Path) -> None:
    from tests.ggufgen import make_tiny_gguf

    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    spec = tmp_path / "models.yaml"
    profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "512MB", "cpu_cores": 1}
    spec.write_text(yaml.safe_dump({"models": [{"name": "open", "source": str(weights), "profiles": [profile]}]}))
    with ControlPlane(tmp_path, extra_env={"LLMGW_LLAMA_SERVER": str(llama_server_path())}) as plane:
        assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0

        def context() -> int | None:
            replicas = plane.api("GET", "models/open")["replicas"]
            return next((s.get("context_tokens") for r in replicas for s in r["shards"] if r["state"] == "ready"), None)

        tokens = plane.wait_for(context, timeout=120, what="the engine's context reported")
        plane.wait_for(lambda: plane.serves("open"), timeout=60, what="open served")
        prompt = [{"role": "user", "content": "é" * (15 * 2**20)}]  # 30 MB of UTF-8, within the body limit
        body = json.dumps({"model": "open", "messages": prompt}, ensure_ascii=False).encode()
        request = urllib.request.Request(
            f"{plane.url}/v1/chat/completions",
            data=body,
            headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
        )
        started = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=120)  # noqa: S310 - our own loopback server
        took = time.monotonic() - started
        error = json.loads(refused.value.read())["error"]
    assert refused.value.code == 400 and error["code"] == "context_length_exceeded"
    assert f"more than the model's context of {tokens} tokens" in error["message"]
    print(f"\n30 MB prompt refused in {took:.2f} s (engine context {tokens} tokens)")
