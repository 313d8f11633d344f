"""GPU time and what it earned, on a fleet: a captured 8 x H100 node runs a team's model on four of
its cards, known traffic goes through the gateway for a known time, and the usage API's GPU-hours
per owner and model, tokens per GPU-hour and per watt-hour are compared with the same figures
worked out here from the placement time, the captured cards' power draw and the requests sent.

The node has no GPU to run vLLM on: its engine is a stand-in (standin_vllm.py) that takes vLLM's
command line and key and answers every chat with a fixed number of tokens, counted on a /metrics
page under vLLM's names, which the agent reads into llmgw_engine_*."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from agent.probes.nvidia import parse_nvidia_smi_text
from agent.sampler import _gpu_dict
from tests.e2e import standin_vllm
from tests.fleet import HOSTS, ControlPlane

pytestmark = pytest.mark.e2e

FIXTURES = Path(__file__).resolve().parents[3] / "shared" / "fixtures"
HELD_EVERY_S = 2
REQUESTS = 10


def _chat(plane: ControlPlane) -> dict:
    body = json.dumps({"model": "big", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    request = urllib.request.Request(
        plane.url + "/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _beats(plane: ControlPlane) -> float:
    """Heartbeats the control plane has handled (the one agent's), from its own /metrics."""
    text = urllib.request.urlopen(plane.url + "/metrics", timeout=30).read().decode()
    found = re.search(r'^llmgw_agent_messages_total\{type="heartbeat"\} (\S+)$', text, re.M)
    assert found, "no heartbeat count on /metrics"
    return float(found.group(1))


def test_gpu_hours_per_owner_and_tokens_per_watt_hour_match_what_the_fleet_did(tmp_path: Path) -> None:
    engine = tmp_path / "vllm"
    engine.write_text(f'#!/bin/sh\nexec {sys.executable} {Path(standin_vllm.__file__)} "$@"\n')
    engine.chmod(0o755)
    env = {"LLMGW_HELD_TIME_SECONDS": str(HELD_EVERY_S)}
    with ControlPlane(tmp_path, extra_env=env) as plane:
        org = plane.api("POST", "organizations", {"name": "Acme", "slug": "acme"})
        assert org["slug"] == "acme"
        agent = plane.add_agent("h100-a", HOSTS["h100x8"], settings={"engines": {"vllm": str(engine)}})
        profile = {"name": "4x", "engine": "vllm", "accelerator": "H100-80GB", "gpus_per_shard": 4}
        spec = tmp_path / "models.yaml"
        model = {"name": "big", "source": "/models/big", "replicas": 1, "owner": {"organization": "acme"}}
        spec.write_text(yaml.safe_dump({"models": [{**model, "profiles": [profile]}]}))
        code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
        assert code == 0, err
        ready = plane.wait_for(
            lambda: (lambda m: m if m["status"]["ready"] == 1 else None)(plane.api("GET", "models/big")),
            timeout=90,
            what="big ready on the H100 node",
        )
        replica = ready["replicas"][0]
        cards = replica["shards"][0]["gpu_indices"]
        assert len(cards) == 4
        placed = datetime.fromisoformat(replica["placed_at"]).timestamp()

        plane.wait_for(lambda: plane.serves("big"), timeout=60, what="big served by the gateway")
        for _ in range(REQUESTS):
            assert _chat(plane)["usage"]["completion_tokens"] == standin_vllm.COMPLETION_TOKENS
        time.sleep(4 * HELD_EVERY_S)

        # Prometheus scraping llmgw asks the engine nothing: the agent reads each engine's page
        # once a heartbeat, however often /metrics is scraped.
        interval = float(re.findall(r"heartbeat every (\d+) s", agent.log_path.read_text())[-1])
        engine = f"http://127.0.0.1:{replica['shards'][0]['port']}/standin/counts"
        pages_before, beats_before = (
            json.load(urllib.request.urlopen(engine, timeout=10))["metrics_pages"],
            _beats(plane),
        )
        for _ in range(5):
            urllib.request.urlopen(plane.url + "/metrics", timeout=30).read()
        time.sleep(2 * interval)  # a heartbeat or two
        pages = json.load(urllib.request.urlopen(engine, timeout=10))["metrics_pages"] - pages_before
        beats = _beats(plane) - beats_before
        assert beats >= 1 and 1 <= pages <= beats + 1, (pages, beats)  # +1: a page read for a heartbeat not yet counted

        by_model = plane.api("GET", "usage?group_by=model")["results"]
        by_owner = plane.api("GET", "usage?group_by=organization")["results"]
        held = time.time() - placed
        metrics = urllib.request.urlopen(plane.url + "/metrics", timeout=30).read().decode()

    # Worked out here: four cards from placement until now, less at most a few counts late.
    row = next(r for r in by_model if r["group"] == "big")
    card_time = row["gpu_hours"]["H100-80GB"] * 3600
    assert 4 * (held - 4 * HELD_EVERY_S - 3) <= card_time <= 4 * held, (row, held)
    owner = next(r for r in by_owner if r["group"] == org["id"])
    assert owner["gpu_hours"] == pytest.approx(row["gpu_hours"])
    tokens = REQUESTS * (standin_vllm.PROMPT_TOKENS + standin_vllm.COMPLETION_TOKENS)
    assert row["prompt_tokens"] + row["completion_tokens"] == tokens
    assert row["tokens_per_gpu_hour"] == pytest.approx(tokens / row["gpu_hours"]["H100-80GB"])
    # The captured cards draw what their report says, all the time: watt-hours are their power
    # times the held seconds.
    report = parse_nvidia_smi_text((FIXTURES / HOSTS["h100x8"].nvidia_text).read_text())  # type: ignore[operator]
    watts = sum(_gpu_dict(g)["power_draw_w"] for g in report.gpus if _gpu_dict(g)["index"] in cards)
    assert row["watt_hours"] == pytest.approx(watts * card_time / 4 / 3600, rel=0.01)
    assert row["tokens_per_watt_hour"] == pytest.approx(tokens / row["watt_hours"], rel=0.01)
    # The engine's own count, read by the agent from its /metrics page, agrees with the gateway's.
    line = next(x for x in metrics.splitlines() if x.startswith("llmgw_engine_generation_tokens_total{"))
    assert 'engine="vllm"' in line and 'model="big"' in line
    assert float(line.rsplit(" ", 1)[1]) == REQUESTS * standin_vllm.COMPLETION_TOKENS
