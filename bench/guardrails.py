"""What guardrail rules add to a request and to each streamed chunk, on the gateway's own code.

    .venv/bin/python bench/guardrails.py [--requests 5000] [--streams 500]

The gateway benchmark's load (bench/gateway.py: a short chat prompt, non-streamed, and streams of
16 content chunks with a usage chunk and [DONE]) is run through the gateway's real intake and relay
code (apps.gateway.intake.parse_body, apps.gateway.guard.check_request, StreamRelay.feed on the
engine's SSE bytes) twice in one process: with no policy, and with a policy set of 200 terms
(20 rules of 10), 20 regular expressions and every detector (e-mail, phone, card, IBAN, TCKN, API
keys, llmgw keys), redacting and stopping. Prints the p50 cost per request and per chunk of each
run, the difference and the ratio. Targets: at most 0.1 ms p50 more per request and 10 µs more per
streamed chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
os.environ.setdefault("LLMGW_DATA_DIR", "/tmp/llmgw-bench-guardrails")

import django  # noqa: E402

django.setup()

from apps.gateway.guard import check_request  # noqa: E402
from apps.gateway.intake import CHAT, Call, parse_body  # noqa: E402
from apps.gateway.relay import StreamRelay  # noqa: E402
from apps.guardrails.engine import DETECTORS, PolicySet, RuleSpec  # noqa: E402

PROMPT = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "Say hello, and tell me one thing about the weather in Ankara in spring."},
]
CHUNKS = 16


def policy_set() -> PolicySet:
    rules = [
        RuleSpec("bench", f"terms-{i}", "terms", "refuse", terms=tuple(f"codename{i}x{j}" for j in range(10)))
        for i in range(20)
    ]
    rules += [RuleSpec("bench", f"regex-{i}", "regex", "redact", pattern=rf"ticket-{i}-\d{{4,}}") for i in range(20)]
    rules += [RuleSpec("bench", name, "detector", "redact", detector=name) for name in DETECTORS if name != "api_key"]
    rules.append(RuleSpec("bench", "keys", "detector", "stop", detector="api_key", applies_to="output"))
    return PolicySet(rules)


def stream_bytes() -> list[bytes]:
    """The engine's SSE chunks of one answer, as bench/mock_upstream.py sends them."""
    out = []
    words = "Hello! Spring in Ankara is mild, often sunny, with cool evenings and the odd shower."
    pieces = [words[i * len(words) // CHUNKS : (i + 1) * len(words) // CHUNKS] for i in range(CHUNKS)]
    for i, piece in enumerate(pieces):
        delta = {"role": "assistant", "content": piece} if i == 0 else {"content": piece}
        chunk = {"id": "c", "object": "chat.completion.chunk", "model": "m", "choices": [{"index": 0, "delta": delta}]}
        out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    end = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    }
    out.append(b"data: " + json.dumps(end).encode() + b"\n\n")
    usage = {
        "id": "c",
        "object": "chat.completion.chunk",
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 30, "completion_tokens": 16, "total_tokens": 46},
    }
    out.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return out


def request_cost(policies: PolicySet | None, count: int) -> list[float]:
    """Per request: the body read as the gateway reads it (parse_body), then the rules."""
    raw = json.dumps({"model": "m", "messages": PROMPT, "stream": True}).encode()
    times = []
    for _ in range(count):
        call = Call(CHAT)
        call.model = "m"
        started = time.perf_counter()
        call.body = parse_body(raw)
        if policies is not None:
            check_request(call, policies)
        times.append(time.perf_counter() - started)
    return times


def chunk_cost(policies: PolicySet | None, streams: int) -> list[float]:
    chunks = stream_bytes()
    per_chunk = []
    for _ in range(streams):
        call = Call(CHAT)
        call.model = "m"
        call.stream = True
        call.body = {"model": "m", "messages": PROMPT}
        if policies is not None:
            check_request(call, policies)
        relay = StreamRelay(call)
        started = time.perf_counter()
        for data in chunks:
            relay.feed(data)
        relay.end(None)
        per_chunk.append((time.perf_counter() - started) / len(chunks))
    return per_chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--streams", type=int, default=500)
    args = parser.parse_args()
    policies = policy_set()
    assert policies.inbound.expression is not None
    request_cost(policies, 200)  # warm both
    request_cost(None, 200)
    plain_req = statistics.median(request_cost(None, args.requests))
    guarded_req = statistics.median(request_cost(policies, args.requests))
    plain_chunk = statistics.median(chunk_cost(None, args.streams))
    guarded_chunk = statistics.median(chunk_cost(policies, args.streams))
    rules = len(policies.rules)
    print(
        f"policy set: {rules} rules (200 terms in 20 rules, 20 expressions, {len(DETECTORS)} detectors): "
        "terms in one index, expressions in one combined expression"
    )
    print(
        f"per request p50: no policy {plain_req * 1e6:.1f} µs, with the policy set {guarded_req * 1e6:.1f} µs; "
        f"added {(guarded_req - plain_req) * 1e3:.3f} ms, ratio {guarded_req / plain_req:.2f}"
    )
    print(
        f"per streamed chunk p50 (relay of {CHUNKS} content chunks, usage and [DONE]): "
        f"no policy {plain_chunk * 1e6:.1f} µs, "
        f"with it {guarded_chunk * 1e6:.1f} µs; added {(guarded_chunk - plain_chunk) * 1e6:.1f} µs, "
        f"ratio {guarded_chunk / plain_chunk:.2f}"
    )
    ok = guarded_req - plain_req <= 0.0001 and guarded_chunk - plain_chunk <= 0.00001
    print(f"targets (0.1 ms a request, 10 µs a chunk): {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    main()
