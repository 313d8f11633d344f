"""A page on another origin calls the gateway with the official SDKs' browser builds, in Chromium.

The gateway is the one tests/gateway runs (its harness: uvicorn in the test's loop, the mock
engine behind it) on one loopback port; the page is served by a second local HTTP server on
another port, so the browser sees two origins and asks the gateway's leave (CORS) for every call.
The page loads the `openai` and `@anthropic-ai/sdk` npm packages' ES modules as they ship
(tests/browser/gateway_sdks: package.json and package-lock.json committed, node_modules installed
here with `npm ci` the first time, skipped where Node or the registry is missing) and calls chat
and messages with `dangerouslyAllowBrowser`, reading streamed answers, request ids and errors.

Chromium is Debian's (/usr/bin/chromium), driven by Playwright's async API in the test's own
event loop (the gateway runs in it too); without it the module is skipped.
"""

from __future__ import annotations

import json
import mimetypes
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from apps.gateway.cors import Cors
from tests.gateway.harness import KEY, Gateway, engine_fixture, gateway_fixture
from tests.gateway.mock_engine import MockEngine
from tests.localhttp import LocalHTTP

async_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed (the dev extra)")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
SDKS = Path(__file__).parent / "gateway_sdks"
PINNED = ("openai", "@anthropic-ai/sdk")

if not CHROMIUM.exists():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


def _installed() -> bool:
    wanted = json.loads((SDKS / "package.json").read_text())["dependencies"]
    for name in PINNED:
        found = SDKS / "node_modules" / name / "package.json"
        if not found.exists() or json.loads(found.read_text())["version"] != wanted[name]:
            return False
    return True


@pytest.fixture(scope="session")
def sdks() -> Path:
    """tests/browser/gateway_sdks with its node_modules installed (npm ci, once)."""
    if not _installed():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("the browser SDK test needs npm to install openai and @anthropic-ai/sdk, and it is not on PATH")
        try:
            result = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"], cwd=SDKS, capture_output=True, text=True, timeout=600
            )
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci for tests/browser/gateway_sdks took more than 10 minutes")
        if result.returncode != 0:
            pytest.skip(f"npm ci for tests/browser/gateway_sdks failed (no npm registry?): {result.stderr[-500:]}")
    return SDKS


@pytest.fixture
def page_server(sdks: Path) -> Iterator[LocalHTTP]:
    """The page and the SDKs' files, from a second loopback server (another origin than the gateway)."""
    root = sdks.resolve()

    def answer(handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = handler.path.split("?", 1)[0]
        target = (root / ("page.html" if path == "/" else path.lstrip("/"))).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        body = target.read_bytes()
        kind = "text/javascript" if target.suffix in (".mjs", ".js") else mimetypes.guess_type(target.name)[0]
        handler.send_response(200)
        handler.send_header("Content-Type", kind or "application/octet-stream")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if not head:
            handler.wfile.write(body)

    server = LocalHTTP(answer)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async for mock in engine_fixture():
        yield mock


@pytest.fixture
async def gw(engine: MockEngine, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    async for gateway in gateway_fixture(engine, monkeypatch):
        yield gateway


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with async_api.async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        await chromium.close()


async def open_page(browser: Any, page_server: LocalHTTP) -> Any:
    page = await browser.new_page()
    await page.goto(page_server.base + "/")
    await page.wait_for_selector("body[data-ready=yes]", state="attached")
    return page


CALLS = """async ({url, key}) => {
  const said = [{role: "user", content: "Say hello"}];
  const openai = new OpenAI({baseURL: url + "/v1", apiKey: key, dangerouslyAllowBrowser: true, maxRetries: 0});
  const {data: stream, request_id: chatRequestId} = await openai.chat.completions
    .create({model: "m", messages: said, stream: true})
    .withResponse();
  let chat = "";
  for await (const chunk of stream) chat += chunk.choices[0]?.delta?.content ?? "";
  const claude = new Anthropic({baseURL: url, apiKey: key, dangerouslyAllowBrowser: true, maxRetries: 0});
  const messages = claude.messages.stream({model: "m", max_tokens: 20, messages: said});
  let text = "";
  messages.on("text", (piece) => { text += piece; });
  const final = await messages.finalMessage();
  let refused = null;
  try {
    const stranger = new OpenAI({baseURL: url + "/v1", apiKey: "llmgw_wrong", dangerouslyAllowBrowser: true,
                                 maxRetries: 0});
    await stranger.chat.completions.create({model: "m", messages: said});
  } catch (error) {
    refused = {status: error.status ?? null, requestID: error.requestID ?? null, message: String(error.message)};
  }
  return {chat, chatRequestId, text, stop: final.stop_reason, messageRequestId: messages.request_id ?? null, refused};
}"""


async def test_a_page_on_another_origin_streams_chat_and_messages_with_the_sdks(
    gw: Gateway, engine: MockEngine, page_server: LocalHTTP, browser: Any
) -> None:
    gw.app.cors = Cors([page_server.base])
    page = await open_page(browser, page_server)
    result = await page.evaluate(CALLS, {"url": gw.url, "key": KEY})
    assert result["chat"] == "t0 t1 t2 "
    assert result["text"] == "t0 t1 t2 " and result["stop"] == "end_turn"
    # The request ids are exposed to the page's script: the SDKs read them from the headers.
    assert result["chatRequestId"].startswith("req_") and result["messageRequestId"].startswith("req_")
    # An error reaches the page as the API's error, not as a failed fetch.
    assert result["refused"]["status"] == 401 and result["refused"]["requestID"].startswith("req_")
    # Both streams reached the engine: the preflights let every header the SDKs send through (the
    # Anthropic SDK's anthropic-dangerous-direct-browser-access among them).
    assert [seen.body["stream"] for seen in engine.seen] == [True, True]


async def test_a_page_on_an_origin_not_allowed_cannot_call(
    gw: Gateway, engine: MockEngine, page_server: LocalHTTP, browser: Any
) -> None:
    gw.app.cors = Cors(["https://app.example.com"])
    page = await open_page(browser, page_server)
    outcome = await page.evaluate(
        """async ({url, key}) => {
          const openai = new OpenAI({baseURL: url + "/v1", apiKey: key, dangerouslyAllowBrowser: true, maxRetries: 0});
          try { await openai.chat.completions.create({model: "m", messages: [{role: "user", content: "hi"}]}); }
          catch (error) { return error.constructor.name; }
          return "answered";
        }""",
        {"url": gw.url, "key": KEY},
    )
    assert outcome == "APIConnectionError"  # the browser refused the answer: no Access-Control-Allow-Origin
    assert engine.seen == []  # the preflight was refused: the request itself was never sent


async def test_any_origin_may_call_when_the_setting_is_a_star(
    gw: Gateway, engine: MockEngine, page_server: LocalHTTP, browser: Any
) -> None:
    gw.app.cors = Cors(["*"])
    page = await open_page(browser, page_server)
    result = await page.evaluate(CALLS, {"url": gw.url, "key": KEY})
    assert result["chat"] == "t0 t1 t2 " and result["text"] == "t0 t1 t2 "
