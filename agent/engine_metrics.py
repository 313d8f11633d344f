"""An engine's own /metrics, read by the agent and put in one shape whatever the engine.

llama.cpp (`--metrics`), vLLM and SGLang (`--enable-metrics`) each publish Prometheus text
under their own names. `read_engine_metrics()` fetches one engine's page (one request, a
size cap and a timeout) and `normalise()` turns it into the figures llmgw exports as
`llmgw_engine_*`:

    requests_running, requests_waiting     gauges
    kv_cache_usage_ratio                   gauge, 0..1
    prompt_tokens, generation_tokens       counters (prompt: every prompt token, cached ones too)
    prefix_cache_queries, prefix_cache_hits
                                           counters, in prompt tokens looked up and found
    ttft_sum, ttft_count                   time to first token: seconds summed, requests
    tpot_sum, tpot_count                   time per output token: seconds summed, tokens

A figure the engine does not publish is absent, never 0: llama.cpp has no time to first token
and no KV-cache gauge, older vLLM has no prefix-cache counters. Where an engine labels its
series by tensor-parallel rank (SGLang), rank 0 speaks for the replica; series of several data
parallel engines are added up (ratios averaged).

No Django import; importable on Python 3.11.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from typing import Any

__all__ = ["MAX_BYTES", "context_of", "normalise", "parse_exposition", "read_context", "read_engine_metrics"]

MAX_BYTES = 4 * 1024 * 1024  # a page larger than this is not read (a healthy engine's is tens of KB)

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_exposition(text: str) -> Samples:
    """Prometheus text format: {metric name: [(labels, value)]}. Lines it cannot read are skipped."""
    out: Samples = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels_text, value_text = match.groups()
        try:
            value = float(value_text)
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        labels = dict(_LABEL.findall(labels_text)) if labels_text else {}
        out.setdefault(name, []).append((labels, value))
    return out


def _series(samples: Samples, *names: str) -> list[tuple[dict[str, str], float]] | None:
    """The first of `names` the page has, rank 0's series only where series carry a tp_rank."""
    for name in names:
        found = samples.get(name)
        if found:
            if any("tp_rank" in labels for labels, _ in found):
                found = [(labels, v) for labels, v in found if labels.get("tp_rank", "0") == "0"]
            return found
    return None


def _total(samples: Samples, *names: str) -> float | None:
    found = _series(samples, *names)
    return sum(v for _, v in found) if found else None


def _mean(samples: Samples, *names: str) -> float | None:
    found = _series(samples, *names)
    return sum(v for _, v in found) / len(found) if found else None


def _put(out: dict[str, float], key: str, value: float | None) -> None:
    if value is not None and math.isfinite(value):
        out[key] = value


def normalise(engine: str, samples: Samples) -> dict[str, float]:
    """The figures of `engine`'s page in llmgw's names; {} for an engine it does not know."""
    out: dict[str, float] = {}
    if engine == "llama.cpp":
        new = _total(samples, "llamacpp:prompt_tokens_total")
        cached = _total(samples, "llamacpp:prompt_tokens_cached_total")
        _put(out, "requests_running", _total(samples, "llamacpp:requests_processing"))
        _put(out, "requests_waiting", _total(samples, "llamacpp:requests_deferred"))
        _put(out, "kv_cache_usage_ratio", _mean(samples, "llamacpp:kv_cache_usage_ratio"))
        if new is not None:
            # llama.cpp counts the prompt tokens it computed; those it took from the cache apart.
            _put(out, "prompt_tokens", new + (cached or 0.0))
            if cached is not None:
                _put(out, "prefix_cache_queries", new + cached)
                _put(out, "prefix_cache_hits", cached)
        _put(out, "generation_tokens", _total(samples, "llamacpp:tokens_predicted_total"))
        decode_seconds = _total(samples, "llamacpp:tokens_predicted_seconds_total")
        decoded = _total(samples, "llamacpp:tokens_predicted_total")
        if decode_seconds is not None and decoded is not None:
            _put(out, "tpot_sum", decode_seconds)
            _put(out, "tpot_count", decoded)
        return out
    if engine == "vllm":
        prefix = "vllm:"
        _put(out, "requests_running", _total(samples, "vllm:num_requests_running"))
        _put(out, "requests_waiting", _total(samples, "vllm:num_requests_waiting"))
        _put(out, "kv_cache_usage_ratio", _mean(samples, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"))
        _put(out, "prefix_cache_queries", _total(samples, "vllm:prefix_cache_queries_total"))
        _put(out, "prefix_cache_hits", _total(samples, "vllm:prefix_cache_hits_total"))
        tpot = ("time_per_output_token_seconds", "inter_token_latency_seconds")
    elif engine == "sglang":
        prefix = "sglang:"
        _put(out, "requests_running", _total(samples, "sglang:num_running_reqs"))
        _put(out, "requests_waiting", _total(samples, "sglang:num_queue_reqs"))
        _put(out, "kv_cache_usage_ratio", _mean(samples, "sglang:token_usage"))
        cached = _total(samples, "sglang:cached_tokens_total")
        prompt = _total(samples, "sglang:prompt_tokens_total")
        if cached is not None and prompt is not None:
            _put(out, "prefix_cache_queries", prompt)
            _put(out, "prefix_cache_hits", cached)
        tpot = ("inter_token_latency_seconds", "time_per_output_token_seconds")
    else:
        return {}
    _put(out, "prompt_tokens", _total(samples, f"{prefix}prompt_tokens_total"))
    _put(out, "generation_tokens", _total(samples, f"{prefix}generation_tokens_total"))
    for key, names in (("ttft", ("time_to_first_token_seconds",)), ("tpot", tpot)):
        for name in names:
            total = _total(samples, f"{prefix}{name}_sum")
            count = _total(samples, f"{prefix}{name}_count")
            if total is not None and count is not None:
                _put(out, f"{key}_sum", total)
                _put(out, f"{key}_count", count)
                break
    return out


async def fetch(host: str, port: int, path: str, api_key: str | None, timeout: float) -> str | None:
    """The body of GET http://host:port/path when it answers 200 within `timeout`, else None."""
    writer = None
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            url_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
            auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {url_host}:{port}\r\n{auth}"
                "Connection: close\r\nAccept: text/plain\r\n\r\n".encode()
            )
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status = head.split(b"\r\n", 1)[0].split()
            if len(status) < 2 or status[1] != b"200":
                return None
            headers = {
                k.strip().lower(): v.strip()
                for k, _, v in (line.partition(b":") for line in head.split(b"\r\n")[1:] if b":" in line)
            }
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                body = await _chunked(reader)
            else:
                length = headers.get(b"content-length")
                if length is not None and length.isdigit():
                    if int(length) > MAX_BYTES:
                        return None
                    body = await reader.readexactly(int(length))
                else:
                    body = await reader.read(MAX_BYTES + 1)
                    if len(body) > MAX_BYTES:
                        return None
            return body.decode("utf-8", "replace")
    except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return bytes(body)
        if len(body) + size > MAX_BYTES:
            raise ValueError("the engine's metrics page is larger than the agent reads")
        body += await reader.readexactly(size)
        await reader.readexactly(2)


def context_of(text: str) -> int | None:
    """The tokens one request may hold, from an engine's `/v1/models` answer: vLLM and SGLang
    give `max_model_len`, llama.cpp its slot's `meta.n_ctx` (its `--ctx-size` over `--parallel`).
    None when the answer says neither, or says something no column could hold."""
    try:
        data = json.loads(text)
        first = data["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(first, dict):
        return None
    meta = first.get("meta")
    value = first.get("max_model_len", meta.get("n_ctx") if isinstance(meta, dict) else None)
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31:
        return value
    return None


async def read_context(host: str, port: int, api_key: str | None = None, timeout: float = 2.0) -> int | None:
    """The tokens one request may hold, as the engine serving at host:port says; None when unknown."""
    text = await fetch(host, port, "/v1/models", api_key, timeout)
    return context_of(text) if text is not None else None


async def read_engine_metrics(
    engine: str, host: str, port: int, api_key: str | None = None, timeout: float = 2.0
) -> dict[str, Any] | None:
    """One engine's figures in llmgw's names, or None when its page could not be read."""
    text = await fetch(host, port, "/metrics", api_key, timeout)
    if text is None:
        return None
    return normalise(engine, parse_exposition(text))
