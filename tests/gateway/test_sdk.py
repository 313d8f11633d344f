"""The official OpenAI and Anthropic SDKs against `llmgw up` serving the real tiny llama.cpp engine."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fleet import ControlPlane

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.e2e


def _llama() -> str | None:
    from tests.enginebin import llama_server_path

    path = llama_server_path()
    return str(path) if path else None


class Collector:
    """An OpenTelemetry collector's OTLP/HTTP receiver: keeps every span posted to /v1/traces."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.spans: list[dict] = []
        self.resources: list[dict] = []
        self.headers: list[dict[str, str]] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                collector.headers.append({k.lower(): v for k, v in self.headers.items()})
                if self.path == "/v1/traces":
                    for resource in body["resourceSpans"]:
                        collector.resources.append(resource["resource"])
                        for scope in resource["scopeSpans"]:
                            collector.spans.extend(scope["spans"])
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def trace(self, trace_id: str) -> list[dict]:
        return [s for s in self.spans if s["traceId"] == trace_id]


COLLECTOR: Collector | None = None


@pytest.fixture(scope="module")
def collector() -> Collector:
    global COLLECTOR
    if COLLECTOR is None:
        COLLECTOR = Collector()
    return COLLECTOR


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, collector: Collector) -> Iterator[ControlPlane]:
    if _llama() is None:
        pytest.skip("no llama-server binary (run scripts/ensure-llama-server)")
    from tests.ggufgen import make_tiny_gguf

    tmp = tmp_path_factory.mktemp("gateway")
    weights = make_tiny_gguf(tmp / "tiny.gguf")
    spec = tmp / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "tiny",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 2,
                                "context_size": 512,
                            }
                        ],
                    },
                    {
                        "name": "alias",
                        "replicas": 0,
                        "fallbacks": ["tiny"],
                        "source": str(weights),
                        "profiles": [{"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "100TB"}],
                    },
                ]
            }
        )
    )
    env = {
        "LLMGW_LLAMA_SERVER": _llama() or "",
        "LLMGW_GATEWAY_COLD_START_TIMEOUT": "120",
        # Each request a trace, sent to the test's collector.
        "LLMGW_OTLP_ENDPOINT": collector.url,
        "LLMGW_OTLP_HEADERS": "authorization=Bearer collector-token",
    }
    with ControlPlane(tmp, extra_env=env) as running:
        assert running.ctl("model", "apply", "-f", str(spec))[0] == 0
        running.wait_for(lambda: _models(running), timeout=90, what="tiny served by the gateway")
        yield running
        engine = running.api("GET", "models/tiny")["replicas"][0]["shards"][0]["pid"]
    import contextlib
    import os
    import signal

    if engine:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine, signal.SIGKILL)


def _models(plane: ControlPlane) -> bool:
    request = urllib.request.Request(plane.url + "/v1/models", headers={"Authorization": f"Bearer {plane.key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            data = json.load(response)["data"]
    except urllib.error.HTTPError:
        return False  # the new key has not reached the gateway's table yet
    return any(m["id"] == "tiny" and m["llmgw"]["ready_replicas"] for m in data)


def oai(plane: ControlPlane, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=plane.url + "/v1", api_key=key or plane.key, max_retries=0)


def claude(plane: ControlPlane, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=plane.url, api_key=key or plane.key, max_retries=0)


def test_openai_chat_answers_with_usage_and_llmgw_headers(plane: ControlPlane) -> None:
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=6
    )
    completion = raw.parse()
    assert completion.model == "tiny"
    assert isinstance(completion.choices[0].message.content, str)
    assert completion.usage is not None and completion.usage.completion_tokens > 0
    assert raw.headers["x-llmgw-hardware"] == "cpu"
    assert raw.headers["x-llmgw-request-id"].startswith("req_")
    assert raw.headers["x-llmgw-replica"].startswith("tiny/")


def test_openai_chat_streams_with_usage_at_the_end(plane: ControlPlane) -> None:
    stream = oai(plane).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    # The random-weight model may end early on its own end-of-text token: at most max_tokens.
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 8


def test_openai_chat_with_tools_is_accepted(plane: ControlPlane) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
    ]
    completion = oai(plane).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather in Ankara?"}], tools=tools, max_tokens=6
    )
    assert completion.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def test_anthropic_messages_plain_and_streamed(plane: ControlPlane) -> None:
    client = claude(plane)
    message = client.messages.create(
        model="tiny", max_tokens=6, system="Be brief.", messages=[{"role": "user", "content": "Hello"}]
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in {"max_tokens", "end_turn"}
    assert message.usage.output_tokens > 0
    with client.messages.stream(
        model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hello again"}]
    ) as stream:
        final = stream.get_final_message()
    assert 1 <= final.usage.output_tokens <= 8
    assert final.content and final.content[0].type == "text"


def test_anthropic_tool_results_go_through(plane: ControlPlane) -> None:
    message = claude(plane).messages.create(
        model="tiny",
        max_tokens=4,
        tools=[{"name": "lookup", "description": "Look up", "input_schema": {"type": "object", "properties": {}}}],
        messages=[
            {"role": "user", "content": "Look it up"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]},
        ],
    )
    assert message.usage.output_tokens > 0


def test_a_codex_style_responses_request_with_a_custom_tool(plane: ControlPlane) -> None:
    client = oai(plane)
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the workspace"},
        {
            "type": "function",
            "name": "shell",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    ]
    response = client.responses.create(
        model="tiny",
        instructions="You are a coding agent.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Fix the bug"}]}],
        tools=tools,
        max_output_tokens=6,
    )
    assert response.object == "response"
    assert response.usage is not None and response.usage.output_tokens > 0
    events = [
        event.type for event in client.responses.create(model="tiny", input="hi", max_output_tokens=4, stream=True)
    ]
    assert events[0] == "response.created" and events[-1] in {"response.completed", "response.incomplete"}
    assert "response.output_text.delta" in events


def test_bad_keys_unknown_models_and_bad_bodies_get_errors_in_the_callers_style(plane: ControlPlane) -> None:
    with pytest.raises(openai.AuthenticationError):
        oai(plane, key="llmgw_wrong").chat.completions.create(model="tiny", messages=[])
    with pytest.raises(anthropic.AuthenticationError):
        claude(plane, key="llmgw_wrong").messages.create(model="tiny", max_tokens=1, messages=[])
    with pytest.raises(openai.NotFoundError) as not_found:
        oai(plane).chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert "no-such-model" in str(not_found.value)
    with pytest.raises(anthropic.BadRequestError):
        claude(plane).messages.create(model="tiny", max_tokens=1, messages="not a list")  # type: ignore[arg-type]


def test_a_model_with_no_replica_falls_back_in_order(plane: ControlPlane) -> None:
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-llmgw-replica"].startswith("tiny/")


def test_a_revoked_key_stops_working_within_seconds(plane: ControlPlane) -> None:
    created = plane.api("POST", "keys/", {"name": "short-lived"})
    client = oai(plane, key=created["key"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the new key reaches the gateway's table first
        try:
            client.models.list()
            break
        except openai.AuthenticationError:
            time.sleep(0.2)
    plane.api("POST", f"keys/{created['id']}/revoke")
    revoked_at = time.monotonic()
    while True:
        try:
            client.models.list()
        except openai.AuthenticationError:
            break
        if time.monotonic() - revoked_at > 5:
            pytest.fail("a revoked key still worked after 5 s")
        time.sleep(0.1)


def test_a_key_limited_to_other_models_is_refused(plane: ControlPlane) -> None:
    created = plane.api("POST", "keys/", {"name": "narrow", "allowed_models": ["alias"]})
    client = oai(plane, key=created["key"])
    deadline = time.monotonic() + 5
    while True:
        try:
            ids = [m.id for m in client.models.list()]
            break
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                pytest.fail("the key did not reach the gateway's tables")
            time.sleep(0.2)
    assert ids == ["alias"]
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)


def test_a_key_over_its_limit_gets_429_naming_the_limit_and_is_recorded_free(plane: ControlPlane) -> None:
    created = plane.api("POST", "keys/", {"name": "rationed"})
    plane.api("POST", "limits/", {"api_key": created["id"], "requests_per_minute": 2})
    client = oai(plane, key=created["key"])
    deadline = time.monotonic() + 5
    statuses: list[int] = []
    while time.monotonic() < deadline:
        try:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
            statuses.append(200)
        except openai.RateLimitError as exc:
            assert "requests per minute" in str(exc) and "2" in str(exc)
            assert int(exc.response.headers["retry-after"]) >= 1
            request_id = exc.response.headers["x-llmgw-request-id"]
            break
        except openai.AuthenticationError:
            time.sleep(0.2)  # the new key and its limit reach the gateway's tables
    else:
        raise AssertionError(f"no 429 after {statuses}")
    record = plane.wait_for(lambda: _request(plane, request_id), timeout=10, what="the refusal's usage record")
    assert record["status"] == 429
    assert record["prompt_tokens"] == 0 and record["completion_tokens"] == 0


def _request(plane: ControlPlane, request_id: str) -> dict | None:
    try:
        return plane.api("GET", f"requests/{request_id}")  # type: ignore[no-any-return]
    except urllib.error.HTTPError:
        return None


def test_usage_shows_each_request_with_percentiles(plane: ControlPlane) -> None:
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "usage please"}], max_tokens=3
    )
    request_id = raw.headers["x-llmgw-request-id"]
    record = plane.wait_for(lambda: _request(plane, request_id), timeout=10, what="the usage record")
    assert record["model"] == "tiny" and record["hardware"] == "cpu" and record["status"] == 200
    assert 1 <= record["completion_tokens"] <= 3 and record["first_token_ms"] is not None

    def tiny_row() -> dict | None:
        rows = plane.api("GET", "usage?group_by=model")["results"]
        return next((r for r in rows if "tiny" in json.dumps(r) and r["requests"]), None)

    row = plane.wait_for(tiny_row, timeout=10, what="tiny in the usage summary")
    assert row["latency_ms_p50"] is not None and row["latency_ms_p99"] is not None
    assert row["first_token_ms_p95"] is not None
    assert row["latency_ms_p50"] <= row["latency_ms_p99"]


def test_a_model_kept_at_zero_is_started_by_its_first_request(plane: ControlPlane, tmp_path: Path) -> None:
    weights = plane.api("GET", "models/tiny")["source"]
    spec = tmp_path / "lazy.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "lazy",
                        "replicas": {"min": 0, "max": 1},
                        "source": weights,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "512MB",
                                "cpu_cores": 0.5,
                            }
                        ],
                    }
                ]
            }
        )
    )
    assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
    assert plane.api("GET", "models/lazy")["status"]["ready"] == 0
    deadline = time.monotonic() + 10
    while True:  # the model reaches the gateway's table within a second or two
        try:
            completion = openai.OpenAI(
                base_url=plane.url + "/v1", api_key=plane.key, max_retries=0, timeout=150
            ).chat.completions.create(model="lazy", messages=[{"role": "user", "content": "wake up"}], max_tokens=2)
            break
        except openai.NotFoundError:
            if time.monotonic() > deadline:
                pytest.fail("the key did not reach the gateway's tables")
            time.sleep(0.3)
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 2
    assert plane.api("GET", "models/lazy")["status"]["ready"] == 1


def test_a_stream_the_client_leaves_is_recorded_with_the_prompt_counted_by_the_engine(plane: ControlPlane) -> None:
    """The OpenAI SDK's stream closed after a few chunks: the request is charged for what was relayed,
    its prompt counted by llama-server's own tokenizer (the count a whole answer reports)."""
    messages = [{"role": "user", "content": "Tell me a long story about the sea"}]
    whole = oai(plane).chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert whole.usage is not None
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=400, stream=True, temperature=1.5
    )
    request_id = raw.headers["x-llmgw-request-id"]
    stream = raw.parse()
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 3:
            break
    stream.close()  # the client hangs up mid-way

    def recorded() -> dict | None:
        try:
            record = plane.api("GET", f"requests/{request_id}")
        except urllib.error.HTTPError:
            return None
        return record if record["prompt_tokens"] is not None else None

    record = plane.wait_for(recorded, timeout=30, what="the cancelled request's usage record")
    assert record["prompt_tokens"] == whole.usage.prompt_tokens
    assert record["completion_tokens"] is not None and record["completion_tokens"] >= 3
    if record["status"] == 499:  # the engine may finish first on a fast machine; then its usage stands
        assert record["tokens_estimated"] is True


def test_each_request_is_a_trace_sent_over_otlp_continuing_the_callers(
    plane: ControlPlane, collector: Collector
) -> None:
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count to three"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"},
    )
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None
    request_id = raw.headers["x-llmgw-request-id"]
    deadline = time.monotonic() + 30
    while len(collector.trace(trace_id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    spans = {s["name"]: s for s in collector.trace(trace_id)}
    assert set(spans) == {"llmgw chat.completions", "queue", "upstream"}, spans
    root, queue, upstream = spans["llmgw chat.completions"], spans["queue"], spans["upstream"]
    # The caller's trace goes on: the request's span is a child of the caller's.
    assert root["parentSpanId"] == parent and root["kind"] == 2
    assert queue["parentSpanId"] == upstream["parentSpanId"] == root["spanId"]
    attributes = {a["key"]: next(iter(a["value"].values())) for a in root["attributes"]}
    assert attributes["llmgw.request_id"] == request_id
    assert attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.usage.output_tokens"] == str(usage.completion_tokens)
    assert attributes["http.response.status_code"] == "200" and attributes["llmgw.stream"] is True
    assert root["status"]["code"] == 1

    def ns(span: dict, key: str) -> int:
        return int(span[key])

    # In order: the request, its wait for a slot, the engine's part with its first token, the end.
    first = ns(root["events"][0], "timeUnixNano")
    assert root["events"][0]["name"] == "first token"
    assert ns(root, "startTimeUnixNano") <= ns(queue, "startTimeUnixNano") <= ns(queue, "endTimeUnixNano")
    assert ns(queue, "endTimeUnixNano") <= ns(upstream, "startTimeUnixNano") <= first
    assert first <= ns(upstream, "endTimeUnixNano") <= ns(root, "endTimeUnixNano")
    # Sent with the collector's token, from a resource named llmgw.
    assert any(h.get("authorization") == "Bearer collector-token" for h in collector.headers)
    service = {a["key"]: a["value"]["stringValue"] for a in collector.resources[-1]["attributes"]}
    assert service["service.name"] == "llmgw"

    # A request without a trace context starts a trace of its own; a refused one is traced too.
    before = len(collector.spans)
    with pytest.raises(openai.NotFoundError):
        oai(plane).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    deadline = time.monotonic() + 30
    while len(collector.spans) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    refused = collector.spans[-1]
    assert refused["parentSpanId"] == "" and refused["traceId"] != trace_id
    assert {a["key"]: a["value"] for a in refused["attributes"]}["http.response.status_code"] == {"intValue": "404"}
