"""The gateway's own Prometheus figures, kept cheap on the hot path: each model's labelled
children are looked up once and kept, so a request costs only the increments themselves."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

__all__ = ["IN_FLIGHT", "QUEUE_DEPTH", "SHARED_SLOT_FAILURES", "interactive_reserve", "observe", "queue_wait", "queued"]

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(
    "llmgw_gateway_requests", "Requests answered by the gateway, by model and status", ["model", "status"]
)
DURATION = Histogram(
    "llmgw_gateway_request_duration_seconds", "Time from request to last byte", ["model"], buckets=BUCKETS
)
FIRST_TOKEN = Histogram(
    "llmgw_gateway_first_token_seconds", "Time from request to the first token", ["model"], buckets=BUCKETS
)
TOKENS = Counter("llmgw_gateway_tokens", "Tokens served, by model and kind", ["model", "kind"])
IN_FLIGHT = Gauge("llmgw_gateway_in_flight", "Requests holding a replica slot now", multiprocess_mode="livesum")
QUEUE_DEPTH = Gauge(
    "llmgw_gateway_queue_depth", "Requests waiting for a replica slot, by model", ["model"], multiprocess_mode="livesum"
)
QUEUED = Gauge(
    "llmgw_gateway_queued",
    "Requests waiting in a model's fair queue, by model and band",
    ["model", "band"],
    multiprocess_mode="livesum",
)
QUEUE_WAIT = Histogram(
    "llmgw_gateway_queue_wait_seconds",
    "Time a request waited in a model's queue before it took a slot, by model and band",
    ["model", "band"],
    buckets=BUCKETS,
)

GUARDRAIL_ACTIONS = Counter(
    "llmgw_guardrail_actions",
    "What guardrail rules did to requests and answers, by policy and action",
    ["policy", "action"],
)

INTERACTIVE_RESERVE = Gauge(
    "llmgw_interactive_reserve",
    "Slots of a model kept from the batch band for interactive requests, as reckoned for its last batch request",
    ["model"],
    multiprocess_mode="livemostrecent",
)

SHARED_SLOT_FAILURES = Counter(
    "llmgw_gateway_shared_slots_failures",
    "Redis calls for shared replica slots that failed (this process then counts alone)",
)

# Labelled children by their labels, made on first use (a series appears only once it has a value).
# The callers pass only models that exist (or "-"), so this stays as small as the catalog.
_children: dict[tuple[Any, ...], Any] = {}
_MAX_CACHED = 4096


def _child(metric: Any, *labels: str) -> Any:
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        if len(_children) > _MAX_CACHED:
            _children.clear()
        child = _children[key] = metric.labels(*labels)
    return child


def observe(
    model: str, status: int, seconds: float, first_token: float | None, prompt: int | None, completion: int | None
) -> None:
    _child(REQUESTS, model, str(status)).inc()
    _child(DURATION, model).observe(seconds)
    if first_token is not None:
        _child(FIRST_TOKEN, model).observe(first_token)
    if prompt:
        _child(TOKENS, model, "prompt").inc(prompt)
    if completion:
        _child(TOKENS, model, "completion").inc(completion)


def guardrail_action(policy: str, action: str) -> None:
    _child(GUARDRAIL_ACTIONS, policy[:100], action).inc()


def queued(model: str, band: str, delta: int) -> None:
    """A request joined (1) or left (-1) a model's queue."""
    _child(QUEUE_DEPTH, model).inc(delta)
    _child(QUEUED, model, band).inc(delta)


def interactive_reserve(model: str, slots: int) -> None:
    """The interactive reserve reckoned for a batch-band request (apps.gateway.slots)."""
    _child(INTERACTIVE_RESERVE, model).set(slots)


def queue_wait(model: str, band: str, seconds: float) -> None:
    _child(QUEUE_WAIT, model, band).observe(seconds)
