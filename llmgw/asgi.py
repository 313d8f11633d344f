"""The one ASGI application: the /v1 gateway, the agent websocket, and Django for the rest.

/v1/*       the gateway (apps.gateway.asgi): plain ASGI, mounted ahead of Django so a
            model request never passes through Django's middleware or the ORM; /v1/files,
            /v1/batches and /v1/messages/batches go to apps.batches.http beside it; without Redis
            the web process runs batches' lines through its gateway (apps.batches.runner; with
            Redis the worker's processes do, apps.batches.host)
websocket   Channels routes (/ws/agent/ for node agents); a handshake to a path no route serves (a
            NUL in it included) is refused with close code 1008, not a traceback
the rest    Django: console, /api/v1, /django-admin, /metrics, /healthz, /readyz, behind a
            bound on request bodies (llmgw/bodylimit.py, LLMGW_MAX_REQUEST_BODY_BYTES) that
            refuses one too large before Django spools it to a temporary file; the gateway
            bounds its own (LLMGW_GATEWAY_MAX_BODY_BYTES)
"""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi = get_asgi_application()  # sets Django up: the imports below need its apps loaded

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from apps.batches.http import BatchesApp, handles  # noqa: E402
from apps.batches.runner import BatchRunner  # noqa: E402
from apps.gateway.asgi import gateway_app  # noqa: E402
from llmgw.bodylimit import BodyLimit  # noqa: E402
from llmgw.http_protocol import ON_SHUTDOWN  # noqa: E402
from llmgw.routing import websocket_urlpatterns  # noqa: E402

# Django reads a request's whole body into a temporary file before any view can refuse it, so
# the bound comes first. HTTP only: websockets go to Channels, /v1 to the gateway.
django_app = BodyLimit(django_asgi, max_bytes=settings.MAX_REQUEST_BODY_BYTES)

GATEWAY_PREFIX = "/v1/"
batches_app = BatchesApp(gateway_app)
batch_runner = BatchRunner(gateway_app) if settings.BATCH_RUNNER == "web" else None

# When `llmgw web` is stopped, the gateway's requests in flight get LLMGW_DRAIN_GRACE_SECONDS.
ON_SHUTDOWN.append(gateway_app.begin_stop)


#: /healthz says the process's event loop answers, so the loop answers it: through Django, each
#: request starts a thread of its own for the view (asgiref), and a probe waited behind whatever
#: else held the loop and the interpreter (10-26 % of the loop's samples under a flood of large
#: prompts went to starting those threads). The same body and headers as the view (llmgw.ops),
#: which still answers any other method, and a request with a body, through Django.
HEALTHZ_BODY = b'{"status": "ok"}'
HEALTHZ_HEADERS = [
    (b"content-type", b"application/json"),
    (b"content-length", str(len(HEALTHZ_BODY)).encode()),
    (b"cache-control", b"max-age=0, no-cache, no-store, must-revalidate, private"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
]


def is_bare_healthz(scope: dict[str, Any]) -> bool:
    if scope.get("path") != "/healthz" or scope.get("method") not in ("GET", "HEAD"):
        return False
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return False
    return True


async def healthz(scope: dict[str, Any], send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": HEALTHZ_HEADERS})
    await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else HEALTHZ_BODY})


async def http_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    path: str = scope.get("path", "")
    if is_bare_healthz(scope):
        await healthz(scope, send)
    elif handles(path):
        await batches_app(scope, receive, send)
    elif path.startswith(GATEWAY_PREFIX) or path == GATEWAY_PREFIX.rstrip("/"):
        await gateway_app(scope, receive, send)
    else:
        await django_app(scope, receive, send)


async def lifespan_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer uvicorn's lifespan protocol; the gateway starts its background refresh here."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await gateway_app.startup()
            if batch_runner is not None:
                batch_runner.start()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if batch_runner is not None:
                await batch_runner.stop()
            await gateway_app.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return


websocket_router = URLRouter(websocket_urlpatterns)


async def websocket_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Channels' routes; a path none of them serves is refused at the handshake (policy violation)
    instead of Channels' ValueError, which the server logs as a failure for every stray dial."""
    path = scope.get("path", "").lstrip("/")
    if "\x00" in path or not any(route.pattern.match(path) for route in websocket_urlpatterns):
        await receive()  # websocket.connect
        await send({"type": "websocket.close", "code": 1008})
        return
    await websocket_router(scope, receive, send)


router = ProtocolTypeRouter(
    {
        "http": http_app,
        "websocket": websocket_app,
        "lifespan": lifespan_app,
    }
)


async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
    # Model requests go straight to the gateway: every call on their path is time added to the answer.
    if scope["type"] == "http" and scope["path"].startswith(GATEWAY_PREFIX):
        if handles(scope["path"]):
            await batches_app(scope, receive, send)
        else:
            await gateway_app(scope, receive, send)
    else:
        await router(scope, receive, send)
