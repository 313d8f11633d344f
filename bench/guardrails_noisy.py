"""bench/guardrails.py --noisy: other clients' latency through one web process, alone and while
noisy clients send adversarial prompts and stream adversarial answers.

    .venv/bin/python bench/guardrails.py --noisy [--quick]

One run, on loopback, each process on its own:

- a stand-in engine (this file with --upstream PORT: aiohttp), OpenAI-compatible: a whole answer
  "Hello there", or a short stream; a request whose last message says NOISY streams twenty chunks
  of 16 KiB of adversarial text (runs of "a" that kept the old output guard busy for seconds, card
  numbers, Turkish text with İ, ß and zero-width characters);
- `llmgw web` (one worker) on SQLite in a temporary data dir, with one external model pointing at
  the stand-in and a policy on everyone: the campaign's expressions (logging), every detector and
  a terms rule (redacting), on prompts and answers;
- the load (this process, aiohttp): OTHERS clients, each in turn a small chat and GET /healthz,
  for PHASE_S seconds alone; then as long beside NOISY clients, each in turn a prompt of a
  megabyte of adversarial text and a request for a noisy stream, first with the policy turned off
  (what a megabyte prompt and a 320 KiB stream cost a web process whatever its guardrails: reading,
  parsing and forwarding them), then with it on.

Prints, for each phase, the other clients' p50 and p99 for the chats and for /healthz, the noisy
requests made and their answers, and the ratios of the p99s: with the noise and the policy to
alone (target: within 1.5x), and to the noise without the policy (the guardrails' own share);
the load average at the start and the end, and the target as met or missed (bench/report.py).
--quick runs each phase a quarter as long. No assertions: a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway import PYTHON, Children, free_port, quantile, tail, wait_http  # noqa: E402
from bench.report import Report  # noqa: E402

__all__ = ["noisy"]

OTHERS = 8
NOISY = 4
PHASE_S = 20.0
WARMUP_S = 2.0
TARGET = 1.5
CARD = "4111 1111 1111 1111"
TURKISH = "İstanbul'da şöyle bir güz: ağaçlar ığıl ığıl, çarşı ßoğuk\u200b, ﬁyatlar düşük; "
NOISE = ("a" * 40 + " ") * 200 + f"card {CARD} " + TURKISH * 40 + "project\n falcon " + "1234567890123 " * 100
PATTERNS = ("(a|a?)+b", "(a{1,30})+b", "(.*a){12}x", ".*a.*a.*a.*a.*a.*x", r"(?:\wb|ab)+c", r"\d+\d+\d+\d+x")

SETUP = """
import sys
import django
django.setup()
from apps.accounts.models import User
from apps.accounts.services import create_api_key
from apps.catalog.services import apply_models
from apps.guardrails.engine import DETECTORS
from apps.guardrails.services import set_policy
from apps.quotas.models import RateLimit
url, key_file, patterns = sys.argv[1], sys.argv[2], sys.argv[3].split("\\n")
user = User.objects.create_user("bench@example.com", None, name="Bench")
new = create_api_key(user, name="bench", actor=None)
RateLimit.objects.create(api_key=new.key, requests_per_minute=10**9, tokens_per_minute=10**12,
                         tokens_per_day=10**12, monthly_token_budget=10**13)
apply_models({"models": [{"name": "mock", "external": {"url": url, "model": "mock", "api_key_file": key_file},
                          "replicas": 0}]}, actor=None)
rules = [{"name": f"pattern {i}", "kind": "regex", "pattern": p, "action": "log"} for i, p in enumerate(patterns)]
rules += [{"name": d, "kind": "detector", "detector": d, "action": "redact"} for d in DETECTORS]
rules.append({"name": "codename", "kind": "terms", "terms": ["Project Falcon"], "action": "redact"})
set_policy({"name": "campaign", "rules": rules})
print(new.secret)
"""


# The stand-in engine ------------------------------------------------------------------------------


def _chunk(text: str) -> bytes:
    event = {"id": "c", "object": "chat.completion.chunk", "model": "mock", "choices": [{"index": 0, "delta": {}}]}
    event["choices"][0]["delta"] = {"content": text}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _answer(request: Any) -> Any:
    from aiohttp import web

    body = await request.json()
    if not body.get("stream"):
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "model": "mock",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "Hello there"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            }
        )
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    noisy = "NOISY" in str(body.get("messages", [{}])[-1].get("content", ""))
    pieces = [(NOISE * 2)[:16_384] for _ in range(20)] if noisy else [f" w{i}" for i in range(8)]
    for piece in pieces:
        await response.write(_chunk(piece))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def upstream(port: int) -> None:
    from aiohttp import web

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", _answer)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


# The load -----------------------------------------------------------------------------------------


async def _other(session: Any, url: str, key: str, until: float, seen: dict[str, list[float]]) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": "Say hello"}]}
    headers = {"Authorization": f"Bearer {key}"}
    while time.monotonic() < until:
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as answer:
            await answer.read()
            seen["chat" if answer.status == 200 else "errors"].append(time.perf_counter() - started)
        started = time.perf_counter()
        async with session.get(f"{url}/healthz") as answer:
            await answer.read()
            seen["healthz" if answer.status == 200 else "errors"].append(time.perf_counter() - started)


async def _noisy(session: Any, url: str, key: str, until: float, made: dict[str, int]) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    prompt = (NOISE * (1_000_000 // len(NOISE) + 1))[:1_000_000]
    # Encoded once: a megabyte encoded for each request (json=) took this process's event loop, which
    # times the other clients, some 4 ms a time, and their p99 had it added.
    bodies = [
        (stream, json.dumps({"model": "mock", "messages": [{"role": "user", "content": c}], "stream": stream}).encode())
        for c, stream in ((prompt, False), ("NOISY please", True))
    ]
    while time.monotonic() < until:
        for stream, body in bodies:
            async with session.post(f"{url}/v1/chat/completions", data=body, headers=headers) as answer:
                await answer.read()
                made[f"{'stream' if stream else 'prompt'} {answer.status}"] = (
                    made.get(f"{'stream' if stream else 'prompt'} {answer.status}", 0) + 1
                )


async def _phase(url: str, key: str, seconds: float, noise: bool) -> tuple[dict[str, list[float]], dict[str, int]]:
    import aiohttp

    seen: dict[str, list[float]] = {"chat": [], "healthz": [], "errors": []}
    made: dict[str, int] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        warm = time.monotonic() + WARMUP_S
        tasks = [_noisy(session, url, key, warm + seconds, made) for _ in range(NOISY if noise else 0)]
        await asyncio.gather(
            *(_other(session, url, key, warm, {"chat": [], "healthz": [], "errors": []}) for _ in range(OTHERS))
        )
        tasks += [_other(session, url, key, time.monotonic() + seconds, seen) for _ in range(OTHERS)]
        await asyncio.gather(*tasks)
    return seen, made


def _line(label: str, seen: dict[str, list[float]]) -> str:
    parts = [
        f"{what} p50 {quantile(seen[what], 0.5) * 1e3:.1f} ms p99 {quantile(seen[what], 0.99) * 1e3:.1f} ms "
        f"({len(seen[what])})"
        for what in ("chat", "healthz")
    ]
    return f"  {label}: " + "; ".join(parts) + (f"; {len(seen['errors'])} not 200" if seen["errors"] else "")


# The run ------------------------------------------------------------------------------------------


def _prepare(tmp: Path, upstream_port: int) -> tuple[dict[str, str], str]:
    key_file = tmp / "upstream.key"
    key_file.write_text("sk-mock\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        {
            "LLMGW_DATA_DIR": str(tmp),
            "LLMGW_LOG_LEVEL": "warning",
            "LLMGW_GATEWAY_REFRESH_SECONDS": "1",
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        }
    )
    subprocess.run([PYTHON, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, check=True, cwd=REPO)
    url = f"http://127.0.0.1:{upstream_port}/v1"
    done = subprocess.run(
        [PYTHON, "-c", SETUP, url, str(key_file), "\n".join(PATTERNS)],
        env=env,
        check=True,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    return env, done.stdout.strip().splitlines()[-1]


TOGGLE = """
import sys
import django
django.setup()
from apps.guardrails.models import Policy
policy = Policy.objects.get(name="campaign")
policy.enabled = sys.argv[1] == "on"
policy.save()  # the gateway reads its tables again (LLMGW_GATEWAY_REFRESH_SECONDS at most)
"""


def _turn(env: dict[str, str], on: bool) -> None:
    subprocess.run([PYTHON, "-c", TOGGLE, "on" if on else "off"], env=env, check=True, cwd=REPO)
    time.sleep(3)


def noisy(report: Report, quick: bool = False) -> None:
    seconds = PHASE_S / 4 if quick else PHASE_S
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-noisy-", ignore_cleanup_errors=True) as folder:
        children = Children()
        try:
            tmp = Path(folder)
            upstream_port, web_port = free_port(), free_port()
            children.start([PYTHON, __file__, "--upstream", str(upstream_port)], cwd=REPO, stdout=subprocess.DEVNULL)
            env, key = _prepare(tmp, upstream_port)
            log = tmp / "web.log"
            with log.open("w") as handle:
                web = children.start(
                    [PYTHON, "-m", "llmgw", "web", "--listen", f"127.0.0.1:{web_port}", "--workers", "1"],
                    env=env,
                    cwd=REPO,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                )
            url = f"http://127.0.0.1:{web_port}"
            if not wait_http(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=90, proc=web):
                raise RuntimeError(f"llmgw web did not come up:\n{tail(log)}")
            _report(url, key, seconds, env, report)
        finally:
            children.stop_all()  # before the folder goes: the web process writes in it to the end


def _report(url: str, key: str, seconds: float, env: dict[str, str], report: Report) -> None:
    print(f"other clients: {OTHERS}, each a small chat then GET /healthz in turn; {seconds:.0f} s a phase")
    quiet, _made = asyncio.run(_phase(url, key, seconds, noise=False))
    print(_line("alone", quiet))
    _turn(env, on=False)
    bare, made = asyncio.run(_phase(url, key, seconds, noise=True))
    print(_line(f"beside {NOISY} noisy clients, the policy off", bare))
    print(f"    noisy requests (1 MB adversarial prompts, streams of 20 chunks of 16 KiB): {made}")
    _turn(env, on=True)
    loud, made = asyncio.run(_phase(url, key, seconds, noise=True))
    print(_line(f"beside {NOISY} noisy clients, the policy on", loud))
    print(f"    noisy requests: {made}")

    def ratio(over: dict[str, list[float]], under: dict[str, list[float]]) -> float:
        return max(quantile(over[w], 0.99) / quantile(under[w], 0.99) for w in ("chat", "healthz"))

    print(f"p99 with the noise and the policy / the noise without it: {ratio(loud, bare):.2f}x")
    for what in ("chat", "healthz"):  # with the noise and the policy / alone
        name = f"others' {what} p99 beside noise"
        if not loud[what] or not quiet[what]:
            report.not_measured(name, f"no answer 200 to {what} alone or beside the noise")
        else:
            worst = quantile(loud[what], 0.99) / quantile(quiet[what], 0.99)
            report.target(name, measured=worst, limit=TARGET, unit="x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", type=int, required=True)
    upstream(parser.parse_args().upstream)
