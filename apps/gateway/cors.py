"""Cross-origin calls to /v1 from browsers (CORS), for the origins an operator allows.

The official SDKs run in browsers too (OpenAI's with `dangerouslyAllowBrowser`, Anthropic's with
`dangerouslyAllowBrowser`, which sends anthropic-dangerous-direct-browser-access). A page on
another origin may call the gateway only when its origin is in LLMGW_CORS_ORIGINS (a
comma-separated list of origins, none by default), or when that list holds `*`:

- `*` is allowed here because every /v1 route is authenticated by an API key the page sends in a
  header, never by a cookie: `Access-Control-Allow-Credentials` is never sent, so a browser never
  attaches cookies to these calls (a cookie-authenticated route must never answer `*`);
- a preflight (OPTIONS with Origin and Access-Control-Request-Method) on any /v1 path is answered
  here, before any key is asked for (browsers send none with it): 204 with the methods, the request
  headers it asked for (those the SDKs send: `REQUEST_HEADERS`, `REQUEST_HEADER_PREFIXES`) and how
  long to keep the answer; an origin, method or header not allowed is a 403 whose body says which
  and why (the page's script cannot read it, its developer tools and curl can);
- every answer to an allowed origin (errors included, so a page can read why it was refused)
  carries Access-Control-Allow-Origin and exposes the headers clients read (`EXPOSED_HEADERS`:
  request ids, rate limits, retry-after, the gateway's own).

Pure: no Django import; `parse_origins` checks the setting at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "EXPOSED_HEADERS",
    "REQUEST_HEADERS",
    "REQUEST_HEADER_PREFIXES",
    "Cors",
    "parse_origins",
]

Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Request headers the SDKs send (and the gateway's own priority header).
REQUEST_HEADERS = frozenset(
    {
        "authorization",
        "x-api-key",
        "content-type",
        "anthropic-version",
        "anthropic-beta",
        "anthropic-dangerous-direct-browser-access",
        "x-llmgw-priority",
        "traceparent",
        "idempotency-key",
    }
)
#: Families of request headers the SDKs send: openai-organization, openai-project, ...;
#: x-stainless-lang, x-stainless-retry-count, x-stainless-timeout, ...
REQUEST_HEADER_PREFIXES = ("openai-", "x-stainless-")
#: Response headers a page's script may read (a browser hides any other).
EXPOSED_HEADERS = (
    "x-request-id",
    "request-id",
    "retry-after",
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
    "anthropic-ratelimit-requests-limit",
    "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset",
    "anthropic-ratelimit-tokens-limit",
    "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
    "x-llmgw-request-id",
    "x-llmgw-replica",
    "x-llmgw-hardware",
    "x-llmgw-queue-ms",
    "x-llmgw-priority",
    "x-llmgw-guardrail",
)
METHODS = ("GET", "POST", "DELETE")
#: How long a browser may keep a preflight's answer, in seconds (Chromium keeps at most 7200).
MAX_AGE_S = 7200
SETTING = "LLMGW_CORS_ORIGINS"


def parse_origins(items: list[str]) -> list[str]:
    """The setting's origins, each `scheme://host[:port]` as a browser sends it in Origin (lower case,
    no path, no trailing slash), or `*`; ValueError naming the first that is not one."""
    origins = []
    for item in items:
        if item == "*":
            origins.append(item)
            continue
        parts = urlsplit(item)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
            raise ValueError(
                f"{SETTING}: {item!r} is not an origin: write scheme://host[:port] "
                "(https://app.example.com, http://localhost:5173), or *"
            )
        origins.append(f"{parts.scheme}://{parts.netloc}".lower())
    return origins


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


class Cors:
    """The allowed origins (`*` for any) and what answers to them carry."""

    def __init__(self, origins: list[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(o for o in origins if o != "*")
        self._expose = ", ".join(EXPOSED_HEADERS).encode()

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    def _allow_origin(self, origin: str) -> list[tuple[bytes, bytes]]:
        if self.any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def wrap(self, scope: dict[str, Any], send: Send) -> Send:
        """`send`, adding the CORS headers to the answer's start when the request's origin is allowed."""
        if not self.any and not self.origins:  # no origin allowed (the default): no header to look for
            return send
        origin = _header(scope.get("headers", []), b"origin")
        if not self.allows(origin):
            return send
        assert origin is not None
        added = [*self._allow_origin(origin), (b"access-control-expose-headers", self._expose)]

        async def with_cors(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *added]}
            await send(message)

        return with_cors

    def preflight(self, headers: list[tuple[bytes, bytes]]) -> tuple[int, list[tuple[bytes, bytes]], dict[str, Any]]:
        """The answer to an OPTIONS request: (status, headers, JSON body or {} for none)."""
        origin = _header(headers, b"origin")
        method = _header(headers, b"access-control-request-method")
        allow = (b"allow", ", ".join((*METHODS, "OPTIONS")).encode())
        if origin is None or method is None:  # not a preflight: what the path takes
            return 204, [allow], {}
        if not self.allows(origin):
            listed = ", ".join(sorted(self.origins)) if self.origins else "none"
            return (
                403,
                [allow],
                _refusal(
                    f"The origin “{origin}” may not call this API from a browser: {SETTING} does not list it "
                    f"(it lists {listed})."
                ),
            )
        if method.upper() not in METHODS:
            return 403, [allow], _refusal(f"{method} is not a method of this API; it takes {', '.join(METHODS)}.")
        asked = [h.strip().lower() for h in (_header(headers, b"access-control-request-headers") or "").split(",")]
        asked = [h for h in asked if h]
        refused = [h for h in asked if h not in REQUEST_HEADERS and not h.startswith(REQUEST_HEADER_PREFIXES)]
        if refused:
            return (
                403,
                [allow],
                _refusal(
                    f"This API does not take the request header(s) {', '.join(refused)} from a browser; it takes "
                    f"{', '.join(sorted(REQUEST_HEADERS))} and those starting with "
                    f"{' or '.join(REQUEST_HEADER_PREFIXES)}."
                ),
            )
        out = [
            *self._allow_origin(origin),
            (b"access-control-allow-methods", ", ".join(METHODS).encode()),
            (b"access-control-max-age", str(MAX_AGE_S).encode()),
        ]
        if asked:
            out.append((b"access-control-allow-headers", ", ".join(asked).encode()))
        if (_header(headers, b"access-control-request-private-network") or "").lower() == "true":
            out.append((b"access-control-allow-private-network", b"true"))
        return 204, [*out, (b"vary", b"Access-Control-Request-Method, Access-Control-Request-Headers")], {}

    async def answer_preflight(self, scope: dict[str, Any], send: Send) -> None:
        status, headers, body = self.preflight(scope.get("headers", []))
        out = json.dumps(body).encode() if body else b""
        if out:
            headers = [*headers, (b"content-type", b"application/json")]
        headers = [*headers, (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


def _refusal(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "cors_refused"}}
