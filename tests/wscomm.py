"""A websocket test client over asgiref's ApplicationCommunicator.

channels.testing would do, but importing it pulls in daphne (and Twisted) for its live
server, which llmgw does not use.
"""

from __future__ import annotations

from typing import Any

from asgiref.testing import ApplicationCommunicator


class WebsocketCommunicator(ApplicationCommunicator):  # type: ignore[misc]
    def __init__(self, application: Any, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        scope = {
            "type": "websocket",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": headers or [],
            "subprotocols": [],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        super().__init__(application, scope)

    async def connect(self, timeout: float = 5) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        return True, None

    async def send_to(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if text_data is not None:
            await self.send_input({"type": "websocket.receive", "text": text_data})
        else:
            await self.send_input({"type": "websocket.receive", "bytes": bytes_data})

    async def receive_from(self, timeout: float = 5) -> str:
        response = await self.receive_output(timeout)
        if response["type"] != "websocket.send":
            raise AssertionError(f"expected a message, got {response!r}")
        return str(response.get("text") or response.get("bytes"))

    async def disconnect(self, code: int = 1000, timeout: float = 5) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout)
