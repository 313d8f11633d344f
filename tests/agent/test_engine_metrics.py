"""The engines' own /metrics, read by the agent and put in llmgw's names (agent.engine_metrics).

Every page captured from vLLM and SGLang under engine_metrics/ is read (a new file is tested
without code); llama.cpp's is read from the real engine, after known traffic, through the
supervisor as the heartbeat reads it."""

from __future__ import annotations

import asyncio
import contextlib
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from agent import protocol
from agent.engine_metrics import MAX_BYTES, fetch, normalise, parse_exposition, read_engine_metrics
from agent.supervisor import READY
from tests.agent.test_supervisor import SECRET, http, make_spec, needs_llama_server, supervisor
from tests.localhttp import LocalHTTP

CAPTURED = Path(__file__).parent / "engine_metrics"
PAGES = sorted(CAPTURED.glob("*.prom"))

#: Where each of llmgw's figures comes from on each engine's page: the first name the page has.
SOURCES = {
    "vllm": {
        "requests_running": ["vllm:num_requests_running"],
        "requests_waiting": ["vllm:num_requests_waiting"],
        "kv_cache_usage_ratio": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        "prompt_tokens": ["vllm:prompt_tokens_total"],
        "generation_tokens": ["vllm:generation_tokens_total"],
        "prefix_cache_queries": ["vllm:prefix_cache_queries_total"],
        "prefix_cache_hits": ["vllm:prefix_cache_hits_total"],
    },
    "sglang": {
        "requests_running": ["sglang:num_running_reqs"],
        "requests_waiting": ["sglang:num_queue_reqs"],
        "kv_cache_usage_ratio": ["sglang:token_usage"],
        "prompt_tokens": ["sglang:prompt_tokens_total"],
        "generation_tokens": ["sglang:generation_tokens_total"],
    },
}
#: Histograms whose sum and count become llmgw's: both there, or the figure is absent.
HISTOGRAMS = {
    "vllm": {
        "ttft": ["time_to_first_token_seconds"],
        "tpot": ["time_per_output_token_seconds", "inter_token_latency_seconds"],
    },
    "sglang": {
        "ttft": ["time_to_first_token_seconds"],
        "tpot": ["inter_token_latency_seconds", "time_per_output_token_seconds"],
    },
}


def _engine(page: Path) -> str:
    return page.name.split("-", 1)[0]


def test_there_are_captured_pages_of_both_python_engines() -> None:
    assert {_engine(p) for p in PAGES} >= {"vllm", "sglang"}, PAGES


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_each_captured_page_reads_into_llmgws_names(page: Path) -> None:
    engine = _engine(page)
    samples = parse_exposition(page.read_text())
    assert samples, "the page has series"
    figures = normalise(engine, samples)

    def rank0(name: str) -> float:
        return sum(v for labels, v in samples[name] if labels.get("tp_rank", "0") == "0")

    expected: dict[str, float] = {}
    for key, names in SOURCES[engine].items():
        name = next((n for n in names if n in samples), None)
        if name is not None:
            value = rank0(name)
            expected[key] = value / len(samples[name]) if key == "kv_cache_usage_ratio" else value
    prefix = f"{engine}:"
    for key, names in HISTOGRAMS[engine].items():
        for name in names:
            if f"{prefix}{name}_sum" in samples and f"{prefix}{name}_count" in samples:
                expected[f"{key}_sum"] = rank0(f"{prefix}{name}_sum")
                expected[f"{key}_count"] = rank0(f"{prefix}{name}_count")
                break
    # SGLang's prompt counter counts every prompt token; its cached ones apart, where it has them.
    if engine == "sglang" and "sglang:cached_tokens_total" in samples and "prompt_tokens" in expected:
        expected["prefix_cache_queries"] = expected["prompt_tokens"]
        expected["prefix_cache_hits"] = rank0("sglang:cached_tokens_total")
    assert figures == pytest.approx(expected), page.name
    if "kv_cache_usage_ratio" in figures:
        assert 0 <= figures["kv_cache_usage_ratio"] <= 1
    # Every figure is a plain finite number: what the heartbeat's schema takes.
    heartbeat = {"sample": {"shards": [{"shard": "r1s0", "engine": figures}]}}
    protocol.parse_message(protocol.encode("heartbeat", heartbeat), expect="agent")


def test_the_captured_pages_between_them_give_every_figure_but_the_prefix_cache() -> None:
    found = set().union(*(normalise(_engine(p), parse_exposition(p.read_text())) for p in PAGES))
    assert {"requests_running", "requests_waiting", "kv_cache_usage_ratio", "prompt_tokens"} <= found
    assert {"generation_tokens", "ttft_sum", "ttft_count", "tpot_sum", "tpot_count"} <= found


def test_a_page_that_is_not_prometheus_text_gives_nothing_and_never_raises() -> None:
    junk = [
        "",
        "<html><body>404</body></html>",
        'vllm:num_requests_running{model_name="x" 3',
        "vllm:num_requests_running NaN\nvllm:num_requests_waiting +Inf\n",
        'vllm:num_requests_running{model_name="a\\"b"} 2\nvllm:num_requests_running{model_name="c"} 3\n',
        "\x00\xff" * 100,
    ]
    for text in junk:
        for engine in ("vllm", "sglang", "llama.cpp", "unknown"):
            normalise(engine, parse_exposition(text))
    assert normalise("vllm", parse_exposition(junk[3])) == {}
    # Two data-parallel engines of one vLLM server: their requests are added up.
    assert normalise("vllm", parse_exposition(junk[4]))["requests_running"] == 5
    assert normalise("unknown", parse_exposition(junk[4])) == {}


def test_only_tensor_parallel_rank_0_speaks_for_the_replica() -> None:
    text = (
        'sglang:num_running_reqs{model_name="m",tp_rank="0"} 4\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 4\n'
        'sglang:token_usage{model_name="m",tp_rank="0"} 0.5\n'
        'sglang:token_usage{model_name="m",tp_rank="1"} 0.5\n'
        'sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 100\n'
        'sglang:cached_tokens_total{model_name="m",tp_rank="0"} 40\n'
    )
    figures = normalise("sglang", parse_exposition(text))
    assert figures["requests_running"] == 4 and figures["kv_cache_usage_ratio"] == 0.5
    assert figures["prefix_cache_queries"] == 100 and figures["prefix_cache_hits"] == 40


class _Pages:
    """A local engine whose /metrics page the test chooses: plain, chunked, huge, slow or missing."""

    def __init__(self) -> None:
        self.mode = "plain"
        self.auth: list[str | None] = []
        self.server = LocalHTTP(self.answer)

    def answer(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        self.auth.append(handler.headers.get("Authorization"))
        body = b"vllm:num_requests_running 3\nvllm:num_requests_waiting 1\n"
        if self.mode == "missing":
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if self.mode == "slow":
            import time

            time.sleep(1.5)
        if self.mode == "huge":
            body = b"# padding\n" * (MAX_BYTES // 10 + 10)
        handler.send_response(200)
        if self.mode == "chunked":
            handler.send_header("Transfer-Encoding", "chunked")
            handler.end_headers()
            for part in (body[:10], body[10:]):
                handler.wfile.write(f"{len(part):x}\r\n".encode() + part + b"\r\n")
            handler.wfile.write(b"0\r\n\r\n")
            return
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a page too big is not read
            handler.wfile.write(body)


def test_fetching_a_page_plain_chunked_or_not_at_all() -> None:
    pages = _Pages()
    pages.server.start()
    port = int(pages.server.base.rsplit(":", 1)[1])
    try:

        async def read(timeout: float = 1.0) -> dict | None:
            return await read_engine_metrics("vllm", "127.0.0.1", port, "sk-engine", timeout)

        assert asyncio.run(read()) == {"requests_running": 3.0, "requests_waiting": 1.0}
        assert pages.auth[-1] == "Bearer sk-engine"  # the shard's key: llama.cpp asks for it on /metrics
        pages.mode = "chunked"
        assert asyncio.run(read()) == {"requests_running": 3.0, "requests_waiting": 1.0}
        for mode in ("missing", "huge", "slow"):
            pages.mode = mode
            assert asyncio.run(read(timeout=0.5)) is None, mode
        # Nothing listening: None, quickly.
        assert asyncio.run(fetch("127.0.0.1", 1, "/metrics", None, 0.5)) is None
    finally:
        pages.server.stop()


@needs_llama_server
async def test_the_supervisor_reads_a_real_llama_cpp_after_known_traffic(tmp_path: Path) -> None:
    pytest.importorskip("gguf", reason="the gguf package (dev extra) writes the tiny test model")
    from tests.ggufgen import make_tiny_gguf

    spec = make_spec(make_tiny_gguf(tmp_path / "tiny.gguf"), shard="r7s0")
    sup = supervisor(tmp_path / "state")
    try:
        await sup.converge([spec])
        assert await sup.wait_settled(30)
        assert (sup.state(spec.shard) or {}).get("state") == READY
        before = await sup.engine_metrics()
        assert before[spec.shard]["generation_tokens"] == 0
        assert before[spec.shard]["requests_running"] == 0
        generated = prompted = 0
        for words in ("Hello", "Hello there, how are you today?"):
            body = {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 6}
            status, answer = await asyncio.to_thread(
                http, "POST", f"http://127.0.0.1:{spec.port}/v1/chat/completions", body, SECRET
            )
            assert status == 200, answer
            generated += answer["usage"]["completion_tokens"]
            prompted += answer["usage"]["prompt_tokens"]
        figures = (await sup.engine_metrics())[spec.shard]
        assert figures["generation_tokens"] == generated
        # Every prompt token is counted once, computed or taken from the prefix cache.
        assert figures["prompt_tokens"] == prompted
        assert figures["prefix_cache_queries"] == prompted
        assert 0 <= figures["prefix_cache_hits"] <= prompted
        assert figures["tpot_count"] == generated and figures["tpot_sum"] > 0
        # llama.cpp publishes no time to first token: absent, not 0.
        assert "ttft_sum" not in figures and "ttft_count" not in figures
        # What the heartbeat carries: the figures with the engine's CPU and memory.
        usage = [dict(item, engine=figures) for item in sup.process_usage()]
        protocol.parse_message(protocol.encode("heartbeat", {"sample": {"shards": usage}}), expect="agent")
    finally:
        await sup.converge([])
        await sup.close()
