"""The engines' own figures, as their agents send them with heartbeats: exported under one
`llmgw_engine_*` set whatever the engine, and charted per model on its card."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from apps.cluster import engine_history
from apps.cluster.reports import record_heartbeats
from tests.builders import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 3, 10, 0, tzinfo=UTC)


def _heartbeat(node: Any, at: datetime, shards: list[dict[str, Any]]) -> None:
    record_heartbeats({node.pk: ({"taken_at": at.timestamp(), "cpus": 64, "shards": shards}, at)})


def _families(client: Client) -> dict[str, Any]:
    text = client.get("/metrics").content.decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("llmgw_engine_")}


def test_each_engines_figures_are_exported_under_one_set_of_names(client: Client) -> None:
    node = make_node("gpu1", gpus=8)
    vllm = make_replica(make_model("llama-70b", gpus=4), node, gpu_indices=(0, 1, 2, 3), spec={"engine": "vllm"})
    cpp = make_replica(make_model("qwen-cpu", cores=4), node, spec={"engine": "llama.cpp"})
    silent = make_replica(make_model("mute", gpus=1), node, gpu_indices=(4,), spec={"engine": "sglang"})
    vllm_figures = {
        "requests_running": 3,
        "requests_waiting": 1,
        "kv_cache_usage_ratio": 0.42,
        "prompt_tokens": 1000,
        "generation_tokens": 250,
        "prefix_cache_queries": 1000,
        "prefix_cache_hits": 600,
        "ttft_sum": 12.5,
        "ttft_count": 50,
        "tpot_sum": 4.0,
        "tpot_count": 200,
    }
    cpp_figures = {"requests_running": 0, "requests_waiting": 0, "generation_tokens": 7, "tpot_sum": 0.5}
    _heartbeat(
        node,
        datetime.now(UTC),
        [
            {"shard": f"r{vllm.pk}s0", "cpu_cores": 2.0, "engine": vllm_figures},
            {"shard": f"r{cpp.pk}s0", "cpu_cores": 1.0, "engine": cpp_figures},
            {"shard": f"r{silent.pk}s0", "cpu_cores": 1.0},  # its page could not be read
        ],
    )
    families = _families(client)
    kinds = {name: f.type for name, f in families.items()}
    assert kinds["llmgw_engine_requests_running"] == "gauge"
    assert kinds["llmgw_engine_generation_tokens"] == "counter"
    assert kinds["llmgw_engine_time_to_first_token_seconds"] == "summary"

    def value(name: str, replica: Any, suffix: str = "") -> float | None:
        for sample in families[name].samples if name in families else []:
            if sample.labels.get("replica") == str(replica.pk) and sample.name == name + suffix:
                return float(sample.value)
        return None

    labels = next(s.labels for s in families["llmgw_engine_requests_running"].samples if s.labels["engine"] == "vllm")
    assert labels == {"model": "llama-70b", "replica": str(vllm.pk), "engine": "vllm"}
    assert value("llmgw_engine_requests_running", vllm) == 3
    assert value("llmgw_engine_kv_cache_usage_ratio", vllm) == 0.42
    assert value("llmgw_engine_prefix_cache_hits", vllm, "_total") == 600
    assert value("llmgw_engine_time_to_first_token_seconds", vllm, "_sum") == 12.5
    assert value("llmgw_engine_time_to_first_token_seconds", vllm, "_count") == 50
    assert value("llmgw_engine_generation_tokens", cpp, "_total") == 7
    # What llama.cpp does not publish, and a summary without its count, are absent, not 0.
    assert value("llmgw_engine_kv_cache_usage_ratio", cpp) is None
    assert value("llmgw_engine_time_per_output_token_seconds", cpp, "_sum") is None
    assert value("llmgw_engine_time_to_first_token_seconds", cpp, "_count") is None
    # An engine whose page was not read has no llmgw_engine_* series at all.
    assert all(s.labels.get("replica") != str(silent.pk) for f in families.values() for s in f.samples)


def test_an_engine_figure_the_protocol_would_refuse_never_reaches_the_export(client: Client) -> None:
    node = make_node("gpu1", gpus=8)
    replica = make_replica(make_model("m", gpus=1), node, gpu_indices=(0,), spec={"engine": "vllm"})
    # Written straight to the row (as a sample of an older or broken agent might be): junk is skipped.
    _heartbeat(
        node,
        datetime.now(UTC),
        [{"shard": f"r{replica.pk}s0", "engine": {"requests_running": "three", "generation_tokens": -5, "x": True}}],
    )
    assert _families(client) == {}
    assert client.get("/metrics").status_code == 200


def _figures(generated: float, ttft_sum: float, ttft_count: float, running: float, kv: float) -> dict[str, float]:
    return {
        "requests_running": running,
        "requests_waiting": 0,
        "kv_cache_usage_ratio": kv,
        "generation_tokens": generated,
        "ttft_sum": ttft_sum,
        "ttft_count": ttft_count,
        "tpot_sum": generated * 0.02,
        "tpot_count": generated,
        "prefix_cache_queries": generated * 2,
        "prefix_cache_hits": generated,
    }


def test_the_card_charts_an_hour_of_two_replicas_with_rates_worked_out_by_hand(client: Client, alice: Any) -> None:
    a_node, b_node = make_node("gpu1", gpus=8), make_node("gpu2", gpus=8)
    model = make_model("llama-70b", gpus=4, replicas=2)
    a = make_replica(model, a_node, gpu_indices=(0, 1, 2, 3), spec={"engine": "vllm"})
    b = make_replica(model, b_node, gpu_indices=(0, 1, 2, 3), spec={"engine": "vllm"})
    # Minute 10:00: six heartbeats 10 s apart. Replica a generates 50 tokens a second, its requests
    # wait 0.2 s for their first token (one request per 10 s); b generates 30 a second, 0.4 s each.
    # At 10:01:30 b's engine restarts (its counters start again from 0).
    for step in range(12):
        at = T0 + timedelta(seconds=10 * step)
        b_generated = 300.0 * step if step < 9 else 300.0 * (step - 9)
        shards_a = [{"shard": f"r{a.pk}s0", "engine": _figures(500.0 * step, 0.2 * step, step, 2, 0.5)}]
        shards_b = [{"shard": f"r{b.pk}s0", "engine": _figures(b_generated, 0.4 * step, step, 1, 0.3)}]
        with time_machine.travel(at, tick=False):
            _heartbeat(a_node, at, shards_a)
            _heartbeat(b_node, at + timedelta(seconds=3), shards_b)
    with time_machine.travel(T0 + timedelta(minutes=2), tick=False):
        points = engine_history.model_points("llama-70b")
        minutes = engine_history.buckets(points)
        client.force_login(alice)
        page = client.get("/models/llama-70b/").content.decode()
    assert len(points) == 24
    first, second = minutes[int(T0.timestamp())], minutes[int(T0.timestamp()) + 60]
    assert sum(first.gauges["requests_running"].values()) == 3
    # Tokens per second over both replicas: 50 + 30, from the steps inside each minute.
    rates = {r: first.deltas["generation_tokens"][r] / first.seconds["generation_tokens"][r] for r in (a.pk, b.pk)}
    assert rates == {a.pk: 50.0, b.pk: 30.0}
    # Mean time to first token over the minute: (5 x 0.2 + 5 x 0.4) / 10 requests = 0.3 s.
    ttft = sum(first.deltas["ttft_sum"].values()) / sum(first.deltas["ttft_count"].values())
    assert ttft == pytest.approx(0.3)
    # In the second minute b's step that went down (its restart) gives nothing; its five other
    # steps of 10 s count: 1,500 tokens over 50 s, still 30 a second.
    assert second.deltas["generation_tokens"][b.pk] == 300.0 * 5
    assert second.seconds["generation_tokens"][b.pk] == 50.0
    assert all(v >= 0 for counter in second.deltas.values() for v in counter.values())

    assert "Engines, last hour" in page
    for title in ("Tokens generated per second", "Time to first token (mean)", "KV cache in use"):
        assert f"<title>{title}</title>" in page
    section = page.split("Engines, last hour", 1)[1]
    assert section.count('d="M') >= 7 and "no data" not in section


def test_a_model_whose_engines_said_nothing_says_so_on_its_card(client: Client, alice: Any) -> None:
    make_replica(make_model("quiet", gpus=1), make_node("gpu1", gpus=8), gpu_indices=(0,))
    client.force_login(alice)
    page = client.get("/models/quiet/").content.decode()
    assert "No engine of this model reported its figures in the last hour." in page
