"""Each gateway request as an OpenTelemetry trace, sent over OTLP/HTTP (JSON) when asked for.

With LLMGW_OTLP_ENDPOINT set (a collector's base address, `http://otel:4318`, or its full
`.../v1/traces`), every request the gateway answers becomes a span named after its endpoint,
with two children: "queue" (waiting for a replica's slot, when it waited) and "upstream" (the
engine's part), and a "first token" event. A request that arrives with a W3C `traceparent`
header continues the caller's trace. Spans are batched by a background thread (a second or 256
spans, whichever comes first) and posted with LLMGW_OTLP_HEADERS (`key=value,...`, for a
collector's token); a collector that does not answer costs a dropped batch, counted and logged
at most once a minute, never a slower request. Off by default, and then nothing is built: one
`None` check per request.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import threading
import time
import urllib.request
from typing import Any

from prometheus_client import Counter

__all__ = ["Exporter", "configure", "exporter", "parse_traceparent", "request_spans"]

log = logging.getLogger(__name__)

SPANS_SENT = Counter("llmgw_otlp_spans_sent", "Request spans posted to the OTLP collector")
SPANS_DROPPED = Counter(
    "llmgw_otlp_spans_dropped", "Request spans not sent: the queue was full or the collector failed", ["reason"]
)

BATCH = 256
INTERVAL_S = 1.0
QUEUE_MAX = 8192
TIMEOUT_S = 5.0

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")

# OTLP enums: SpanKind SERVER = 2, INTERNAL = 1, CLIENT = 3; StatusCode OK = 1, ERROR = 2.
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_OK, STATUS_ERROR = 1, 2


def parse_traceparent(value: str | None) -> tuple[str, str] | None:
    """(trace id, parent span id) of a W3C traceparent header, or None when it is absent or invalid."""
    match = _TRACEPARENT.match((value or "").strip().lower())
    if match is None or match.group(1) == "0" * 32 or match.group(2) == "0" * 16:
        return None
    return match.group(1), match.group(2)


def _attribute(key: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"key": key, "value": {"boolValue": value}}
    if isinstance(value, int):
        return {"key": key, "value": {"intValue": str(value)}}
    if isinstance(value, float):
        return {"key": key, "value": {"doubleValue": value}}
    return {"key": key, "value": {"stringValue": str(value)}}


def _nanos(seconds: float) -> str:
    return str(int(seconds * 1_000_000_000))


def request_spans(
    *,
    name: str,
    start: float,
    end: float,
    attributes: dict[str, Any],
    error: str = "",
    queued: tuple[float, float] | None = None,
    upstream: tuple[float, float] | None = None,
    first_token: float | None = None,
    parent: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The OTLP spans of one request (times in epoch seconds): the request, its queue and upstream."""
    trace_id = parent[0] if parent else secrets.token_hex(16)
    root_id = secrets.token_hex(8)
    status = {"code": STATUS_ERROR, "message": error[:500]} if error else {"code": STATUS_OK}
    events = [{"timeUnixNano": _nanos(first_token), "name": "first token"}] if first_token is not None else []
    root = {
        "traceId": trace_id,
        "spanId": root_id,
        "parentSpanId": parent[1] if parent else "",
        "name": name,
        "kind": KIND_SERVER,
        "startTimeUnixNano": _nanos(start),
        "endTimeUnixNano": _nanos(end),
        "attributes": [_attribute(k, v) for k, v in attributes.items() if v is not None and v != ""],
        "events": events,
        "status": status,
    }
    spans = [root]
    for child, times, kind in (("queue", queued, KIND_INTERNAL), ("upstream", upstream, KIND_CLIENT)):
        if times is None:
            continue
        spans.append(
            {
                "traceId": trace_id,
                "spanId": secrets.token_hex(8),
                "parentSpanId": root_id,
                "name": child,
                "kind": kind,
                "startTimeUnixNano": _nanos(times[0]),
                "endTimeUnixNano": _nanos(times[1]),
                "attributes": [],
                "events": events if child == "upstream" else [],
                "status": status if child == "upstream" else {"code": STATUS_OK},
            }
        )
    return spans


def _headers(text: str) -> dict[str, str]:
    headers = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip():
            headers[key.strip()] = value.strip()
    return headers


class Exporter:
    """A bounded queue of spans and the thread that posts them in batches."""

    def __init__(self, endpoint: str, headers: dict[str, str] | None = None, service: str = "llmgw") -> None:
        base = endpoint.rstrip("/")
        self.url = base if base.endswith("/v1/traces") else base + "/v1/traces"
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.resource = {
            "attributes": [
                _attribute("service.name", service),
                _attribute("service.instance.id", f"{os.uname().nodename}:{os.getpid()}"),
            ]
        }
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(QUEUE_MAX)
        self._thread: threading.Thread | None = None
        self._warned_at = 0.0
        self._lock = threading.Lock()

    def add(self, spans: list[dict[str, Any]]) -> None:
        """Queue spans without waiting; those that do not fit are dropped and counted."""
        self._ensure_thread()
        for span in spans:
            try:
                self._queue.put_nowait(span)
            except queue.Full:
                SPANS_DROPPED.labels("queue_full").inc()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            with self._lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._run, name="otlp-exporter", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            deadline = time.monotonic() + INTERVAL_S
            while len(batch) < BATCH:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    batch.append(self._queue.get(timeout=left))
                except queue.Empty:
                    break
            self.post(batch)

    def post(self, spans: list[dict[str, Any]]) -> bool:
        body = {
            "resourceSpans": [
                {"resource": self.resource, "scopeSpans": [{"scope": {"name": "llmgw.gateway"}, "spans": spans}]}
            ]
        }
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - the operator's collector
                response.read()
        except Exception as exc:
            SPANS_DROPPED.labels("collector").inc(len(spans))
            now = time.monotonic()
            if now - self._warned_at > 60:
                self._warned_at = now
                log.warning("could not send %s request spans to %s: %s", len(spans), self.url, exc)
            return False
        SPANS_SENT.inc(len(spans))
        return True


_exporter: Exporter | None = None


def configure(endpoint: str | None = None, headers: str | None = None) -> Exporter | None:
    """Build the exporter from LLMGW_OTLP_ENDPOINT and LLMGW_OTLP_HEADERS (or the arguments); None when off."""
    global _exporter
    endpoint = os.environ.get("LLMGW_OTLP_ENDPOINT", "") if endpoint is None else endpoint
    headers = os.environ.get("LLMGW_OTLP_HEADERS", "") if headers is None else headers
    _exporter = Exporter(endpoint, _headers(headers)) if endpoint.strip() else None
    return _exporter


def exporter() -> Exporter | None:
    return _exporter
