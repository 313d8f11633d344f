"""What guardrail rules add to a request and to each streamed chunk, on the gateway's own code; what
matching costs per character on long adversarial texts; and, with --noisy, what adversarial
traffic through one web process does to everyone else's latency.

    .venv/bin/python bench/guardrails.py [--requests 5000] [--streams 500] [--quick] [--noisy]

The gateway benchmark's load (bench/gateway.py: a short chat prompt, non-streamed, and streams of
16 content chunks with a usage chunk and [DONE]) is run through the gateway's real intake and relay
code (apps.gateway.intake.parse_body, apps.gateway.guard.check_request, StreamRelay.feed on the
engine's SSE bytes) twice in one process: with no policy, and with a policy set of 200 terms
(20 rules of 10), 20 regular expressions and every detector (e-mail, phone, card, IBAN, TCKN, API
keys, llmgw keys), redacting and stopping. Prints the p50 cost per request and per chunk of each
run, the difference and the ratio. Targets: at most 0.1 ms p50 more per request and 10 µs more per
streamed chunk. The relay's figure includes re-encoding every chunk the answer guard rewrote; the
output guard's own cost per chunk (apps.guardrails.engine.OutputGuard.feed over a long answer in
5-character chunks) is printed beside it.

Then, for each detector, for a terms rule and for the expressions a campaign found stalled the old
engine, each redacting (every match is found and masked, the most work), the time per character of
apps.guardrails.engine.PolicySet.check_texts on texts of 30,000 characters, 1 MB and 8 MB (not 8 MB
with --quick): one adversarial for the rule (the shape that made the old engine quadratic, or
dense candidates that each need checking) and one of Turkish text with İ, ß and zero-width
characters (whose fold is not one character). Beside it, two baselines timed on the same text in
the same run: `str.lower()` and one RE2 search that must read every byte; and the ratio to each.
Last, the worst time of those texts cut to OFF_LOOP_CHARS (apps.gateway.guard), the size from which
matching runs in the guard's threads: what one request may cost the event loop at most.

--noisy (bench/guardrails_noisy.py) starts `llmgw web` on SQLite in front of a stand-in engine,
with the campaign's policy, and measures other clients' latency (small chats and /healthz) alone
and then while noisy clients send megabyte adversarial prompts and stream adversarial answers: the
p50 and p99 of each and the ratio of the p99s. Target: within 1.5x.

The load average is printed at the start and the end, and each target as met, missed or not
measured (the noisy target without --noisy, the per-request and per-chunk ones with it).
--requests and --streams make a quick run smaller (e.g. --requests 500 --streams 50 --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
os.environ.setdefault("LLMGW_DATA_DIR", "/tmp/llmgw-bench-guardrails")

import django  # noqa: E402

django.setup()

from apps.gateway.guard import OFF_LOOP_CHARS, check_request  # noqa: E402
from apps.gateway.intake import CHAT, Call, parse_body  # noqa: E402
from apps.gateway.relay import StreamRelay  # noqa: E402
from apps.guardrails.engine import DETECTORS, OutputGuard, PolicySet, RuleSpec  # noqa: E402
from apps.guardrails.patterns import compile_re2  # noqa: E402
from bench.report import Report  # noqa: E402

REQUEST_TARGET_MS = 0.1
CHUNK_TARGET_US = 10.0

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


def guard_chunk_cost(policies: PolicySet, streams: int) -> float:
    """The output guard alone, per chunk: a long answer fed in 5-character chunks, then finished."""
    words = "Hello! Spring in Ankara is mild, often sunny, with cool evenings and the odd shower. " * 30
    chunks = [words[i : i + 5] for i in range(0, len(words), 5)]
    costs = []
    for _ in range(streams):
        guard = OutputGuard(policies)
        started = time.perf_counter()
        for chunk in chunks:
            guard.feed(chunk)
        guard.finish()
        costs.append((time.perf_counter() - started) / len(chunks))
    return statistics.median(costs)


# Long texts -------------------------------------------------------------------------------------

TURKISH = "İstanbul'da şöyle bir güz: ağaçlar ığıl ığıl, çarşı ßoğuk\u200b, ﬁyatlar düşük; "
# Per rule under test: a text that is the worst shape for it, repeated to the size.
ADVERSARIAL = {
    "email": "a." * 40 + "@",  # the old expression was quadratic in a run before an "@"
    "phone": "+1 (2) 3-4 5.6 7 ",
    "card": "1234567890123 ",  # a candidate every 14 characters, each Luhn-checked
    "iban": "tr33 0006 1005 1978 x ",
    "tckn": "12345678901 ",
    "api_key": "sk-proj-" + "a" * 19 + " ",
    "llmgw_key": "llmgw_" + "a" * 19 + " ",
    "terms": "project project falcon project-x ",
}
CAMPAIGN = {
    "(a|a?)+b": "a" * 23,
    "(a{1,30})+b": "a" * 40,
    "(.*a){12}x": "a" * 40,
    ".*a.*a.*a.*a.*a.*x": "a" * 40,
    r"(?:\d|\w\w)+$": "1" * 40 + "!",
    r"(?:\wb|ab)+c": "ab" * 40,
    r"\d+\d+\d+\d+x": "1" * 40,
    ".*.*.*.*=": "a" * 40,
    "a*b|a": "a" * 40,  # every match needs a look to the end of the run: bounded by window and count
}
SIZES = (30_000, 1_000_000, 8_000_000)
_EVERY_BYTE = compile_re2(r"[\pL\pN]\x{FDD0}")  # cannot match, and no byte can be skipped


def rule_under_test(name: str) -> RuleSpec:
    if name in DETECTORS:
        return RuleSpec("bench", name, "detector", "redact", detector=name)
    if name == "terms":
        return RuleSpec("bench", name, "terms", "redact", terms=("Project Falcon", "Ankara bahar", "gizli proje"))
    return RuleSpec("bench", name, "regex", "redact", pattern=name)


def timed(function: Any, *args: Any) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def size_row(name: str, kind: str, text: str) -> str:
    policies = PolicySet([rule_under_test(name)])
    spent = timed(policies.check_texts, [text])
    lower = timed(str.lower, text)
    data = text.encode("utf-8", "surrogatepass")
    scan = timed(_EVERY_BYTE.search, data)
    per_char = spent / len(text) * 1e9
    return (
        f"{name[:20]:20} {kind:11} {len(text):>9,} {spent * 1e3:9.1f} ms {per_char:8.1f} ns "
        f"{spent / lower:9.1f}x {spent / scan:9.1f}x"
    )


def long_texts(sizes: tuple[int, ...]) -> None:
    print()
    print("matching long texts, each rule redacting (every match found and masked):")
    print(f"{'rule':20} {'text':11} {'chars':>9} {'time':>12} {'per char':>11} {'/ lower()':>10} {'/ RE2 scan':>10}")
    for name, shape in [*ADVERSARIAL.items(), *CAMPAIGN.items()]:
        for size in sizes:
            adversarial = (shape * (size // len(shape) + 1))[:size]
            print(size_row(name, "adversarial", adversarial))
            if name in ADVERSARIAL or size == sizes[0]:
                print(size_row(name, "non-ASCII", (TURKISH * (size // len(TURKISH) + 1))[:size]))
    worst = max(
        (timed(PolicySet([rule_under_test(name)]).check_texts, [(shape * OFF_LOOP_CHARS)[:OFF_LOOP_CHARS]]), name)
        for name, shape in [*ADVERSARIAL.items(), *CAMPAIGN.items(), *((n, TURKISH) for n in ADVERSARIAL)]
    )
    print(
        f"below {OFF_LOOP_CHARS:,} characters a text is matched on the event loop: the worst such text above "
        f"took {worst[0] * 1e3:.2f} ms ({worst[1]})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--streams", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="no 8 MB texts")
    parser.add_argument("--noisy", action="store_true", help="other clients' latency under adversarial traffic")
    args = parser.parse_args()
    with Report(__doc__) as report:
        if args.noisy:
            from bench.guardrails_noisy import noisy

            for name in ("added per request", "added per chunk"):
                report.not_measured(name, "run without --noisy")
            noisy(report, quick=args.quick)
            return
        for what in ("chat", "healthz"):
            report.not_measured(f"others' {what} p99 beside noise", "run with --noisy")
        costs(args, report)


def costs(args: argparse.Namespace, report: Report) -> None:
    """The per-request and per-chunk costs against their targets, then the long texts."""
    policies = policy_set()
    assert policies.inbound.screen is not None and not policies.broken
    request_cost(policies, 200)  # warm both
    request_cost(None, 200)
    plain_req = statistics.median(request_cost(None, args.requests))
    guarded_req = statistics.median(request_cost(policies, args.requests))
    plain_chunk = statistics.median(chunk_cost(None, args.streams))
    guarded_chunk = statistics.median(chunk_cost(policies, args.streams))
    guard_alone = guard_chunk_cost(policies, max(args.streams // 5, 20))
    rules = len(policies.rules)
    print(
        f"policy set: {rules} rules (200 terms in 20 rules, 20 expressions, {len(DETECTORS)} detectors), "
        "each an RE2 expression, all of a direction in one RE2 set"
    )
    print(
        f"per request p50: no policy {plain_req * 1e6:.1f} µs, with the policy set {guarded_req * 1e6:.1f} µs; "
        f"added {(guarded_req - plain_req) * 1e3:.3f} ms, ratio {guarded_req / plain_req:.2f}"
    )
    print(
        f"per streamed chunk p50 (relay of {CHUNKS} content chunks, usage and [DONE]): "
        f"no policy {plain_chunk * 1e6:.1f} µs, "
        f"with it {guarded_chunk * 1e6:.1f} µs; added {(guarded_chunk - plain_chunk) * 1e6:.1f} µs, "
        f"ratio {guarded_chunk / plain_chunk:.2f}; the output guard's own part {guard_alone * 1e6:.2f} µs"
    )
    report.target("added per request", measured=(guarded_req - plain_req) * 1e3, limit=REQUEST_TARGET_MS, unit=" ms")
    report.target("added per chunk", measured=(guarded_chunk - plain_chunk) * 1e6, limit=CHUNK_TARGET_US, unit=" µs")
    long_texts(SIZES[:2] if args.quick else SIZES)


if __name__ == "__main__":
    main()
