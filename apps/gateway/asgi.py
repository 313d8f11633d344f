"""The /v1 gateway: a plain ASGI application mounted ahead of Django in llmgw/asgi.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

__all__ = ["GatewayApp", "gateway_app"]


class GatewayApp:
    """Answers /v1/*. Model routes arrive with the gateway; until then every route is 404."""

    async def startup(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        request_id = uuid.uuid4().hex
        body = json.dumps(
            {
                "error": {
                    "message": f"No route for {scope.get('method', 'GET')} {scope.get('path', '')}",
                    "type": "invalid_request_error",
                    "code": "not_found",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 404,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"x-llmgw-request-id", request_id.encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


gateway_app = GatewayApp()
