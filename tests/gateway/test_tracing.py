"""The OTLP export of request spans (apps.gateway.tracing): off unless asked for, and a collector
that is away costs dropped spans, counted, never an error on the request's path."""

from __future__ import annotations

import socket

import pytest
from prometheus_client import REGISTRY

from apps.gateway import tracing


def test_off_by_default_and_on_with_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_OTLP_ENDPOINT", raising=False)
    assert tracing.configure() is None and tracing.exporter() is None
    on = tracing.configure("http://otel:4318/", "authorization=Bearer t, x-tenant = a")
    assert on is not None and on.url == "http://otel:4318/v1/traces"
    assert on.headers["authorization"] == "Bearer t" and on.headers["x-tenant"] == "a"
    full = tracing.configure("http://otel:4318/v1/traces")
    assert full is not None and full.url == "http://otel:4318/v1/traces"
    tracing.configure("")
    assert tracing.exporter() is None


def test_a_callers_trace_context_is_read_only_when_it_is_valid() -> None:
    assert tracing.parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01") == (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
    )
    for bad in (None, "", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "01-xyz-abc-01"):
        assert tracing.parse_traceparent(bad) is None


def test_a_collector_that_is_away_drops_the_batch_and_counts_it() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once it is closed
    exporter = tracing.Exporter(f"http://127.0.0.1:{port}")
    spans = tracing.request_spans(name="llmgw chat.completions", start=1.0, end=2.0, attributes={"a": 1})
    before = REGISTRY.get_sample_value("llmgw_otlp_spans_dropped_total", {"reason": "collector"}) or 0
    assert exporter.post(spans) is False
    after = REGISTRY.get_sample_value("llmgw_otlp_spans_dropped_total", {"reason": "collector"})
    assert after == before + len(spans) == before + 1  # no queue or upstream given: the request's span alone
