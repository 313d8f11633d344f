"""CORS on /v1 as a browser speaks it, header by header (the browser itself: tests/browser/test_gateway_cors.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.gateway.cors import EXPOSED_HEADERS, Cors
from tests.gateway.harness import HELLO, KEY, Gateway
from tests.gateway.mock_engine import MockEngine

PAGE = "http://localhost:5173"
# What the OpenAI and Anthropic SDKs' browser builds ask leave for before a call.
SDK_HEADERS = (
    "authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,"
    "x-stainless-retry-count,x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout"
)
ANTHROPIC_HEADERS = (
    "anthropic-dangerous-direct-browser-access,anthropic-version,content-type,x-api-key,x-stainless-lang"
)


async def preflight(gw: Gateway, path: str, origin: str = PAGE, method: str = "POST", headers: str = SDK_HEADERS):
    sent = {"Origin": origin, "Access-Control-Request-Method": method, "Access-Control-Request-Headers": headers}
    async with gw.client.options(gw.url + path, headers=sent) as response:
        return response.status, response.headers, await response.text()


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/embeddings", "/v1/models", "/v1/x"]
)
async def test_a_preflight_from_an_allowed_origin_is_answered_on_every_v1_route(gw: Gateway, path: str) -> None:
    gw.app.cors = Cors([PAGE])
    status, headers, body = await preflight(gw, path)
    assert status == 204 and body == ""
    assert headers["Access-Control-Allow-Origin"] == PAGE
    assert set(headers["Access-Control-Allow-Methods"].split(", ")) == {"GET", "POST", "DELETE"}
    assert headers["Access-Control-Allow-Headers"].split(", ") == SDK_HEADERS.split(",")
    assert int(headers["Access-Control-Max-Age"]) > 0
    assert "Access-Control-Allow-Credentials" not in headers  # never: the key is a header, not a cookie
    assert "Origin" in headers.getall("Vary")


async def test_the_anthropic_browser_headers_are_allowed(gw: Gateway) -> None:
    gw.app.cors = Cors([PAGE])
    status, headers, _ = await preflight(gw, "/v1/messages", headers=ANTHROPIC_HEADERS)
    assert status == 204
    assert "anthropic-dangerous-direct-browser-access" in headers["Access-Control-Allow-Headers"]


async def test_a_star_allows_any_origin_without_credentials(gw: Gateway, engine: MockEngine) -> None:
    gw.app.cors = Cors(["*"])
    status, headers, _ = await preflight(gw, "/v1/chat/completions", origin="https://anywhere.example")
    assert status == 204 and headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in headers


async def test_by_default_no_origin_may_call_and_the_refusal_says_why(gw: Gateway) -> None:
    status, headers, body = await preflight(gw, "/v1/chat/completions")
    assert status == 403
    assert "Access-Control-Allow-Origin" not in headers
    message = json.loads(body)["error"]["message"]
    assert message == (
        f"The origin “{PAGE}” may not call this API from a browser: "
        "LLMGW_CORS_ORIGINS does not list it (it lists none)."
    )


async def test_a_header_the_sdks_do_not_send_is_refused_naming_it(gw: Gateway) -> None:
    gw.app.cors = Cors([PAGE])
    status, _, body = await preflight(gw, "/v1/chat/completions", headers="content-type,x-secret-thing")
    assert status == 403 and "x-secret-thing" in body


async def test_an_options_request_that_is_no_preflight_says_what_the_api_takes(gw: Gateway) -> None:
    async with gw.client.options(gw.url + "/v1/chat/completions") as response:
        assert response.status == 204
        assert response.headers["Allow"] == "GET, POST, DELETE, OPTIONS"


async def test_answers_to_an_allowed_origin_expose_the_headers_clients_read(gw: Gateway, engine: MockEngine) -> None:
    gw.app.cors = Cors([PAGE])
    async with gw.client.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": HELLO},
        headers={"Origin": PAGE, "Authorization": f"Bearer {KEY}"},
    ) as response:
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == PAGE
        exposed = response.headers["Access-Control-Expose-Headers"].split(", ")
    assert set(exposed) == set(EXPOSED_HEADERS)
    assert {"x-request-id", "request-id", "retry-after", "x-ratelimit-remaining-tokens"} <= set(exposed)
    for key, path in ((None, "/v1/chat/completions"), (KEY, "/v1/nothing")):  # errors too: a page reads why
        headers = {"Origin": PAGE, **({"Authorization": f"Bearer {key}"} if key else {})}
        async with gw.client.post(gw.url + path, json={"model": "m"}, headers=headers) as refused:
            assert refused.status in (401, 404)
            assert refused.headers["Access-Control-Allow-Origin"] == PAGE


async def test_answers_to_another_origin_carry_no_cors_headers(gw: Gateway, engine: MockEngine) -> None:
    gw.app.cors = Cors([PAGE])
    async with gw.client.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": HELLO},
        headers={"Origin": "https://elsewhere.example", "Authorization": f"Bearer {KEY}"},
    ) as response:
        assert "Access-Control-Allow-Origin" not in response.headers


@pytest.mark.parametrize("value", ["app.example.com", "https://app.example.com/path", "ftp://x.example"])
def test_a_setting_that_is_not_a_list_of_origins_stops_startup_naming_it(tmp_path: Path, value: str) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    environment.update({"LLMGW_DATA_DIR": str(tmp_path), "LLMGW_CORS_ORIGINS": f"http://ok.example,{value}"})
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "check"], capture_output=True, text=True, env=environment, timeout=120
    )
    assert result.returncode != 0
    assert f"LLMGW_CORS_ORIGINS: {value!r} is not an origin" in result.stderr
