"""Requests the control plane sends that only this node can answer (beyond "doctor").

Each handler takes the request's params and returns its result (a JSON object); raising
RequestFailed answers it as failed with that text. They run in the background, so the agent
goes on heartbeating while ibnetdiscover walks a large fabric.
"""

from __future__ import annotations

import base64
import gzip
import re
from collections.abc import Awaitable, Callable
from typing import Any

from agent.runner import CommandRunner

__all__ = ["FEATURES", "HANDLERS", "RequestFailed"]

MAP_TIMEOUT_S = 150.0
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class RequestFailed(Exception):
    pass


def _device(params: dict[str, Any]) -> tuple[str, str]:
    device, port = str(params.get("device") or ""), str(params.get("port") or "1")
    if not _NAME.fullmatch(device) or not port.isdigit():
        raise RequestFailed(f"not an adapter port: {device!r} port {port!r}")
    return device, port


def _missing(result: Any) -> bool:
    return result.returncode is None and ("No such file" in result.stderr or "not found" in result.stderr)


async def ibnetdiscover(params: dict[str, Any], runner: CommandRunner) -> dict[str, Any]:
    """The fabric's topology as ibnetdiscover prints it through one port, compressed (a large
    fabric's text is close to a megabyte); the control plane parses it."""
    device, port = _device(params)
    result = await runner.run("ibnetdiscover", "-C", device, "-P", port, timeout=MAP_TIMEOUT_S)
    if _missing(result):
        raise RequestFailed("ibnetdiscover is not installed on this node (package infiniband-diags)")
    if not result.ok and not result.stdout.strip():
        raise RequestFailed(f"ibnetdiscover failed ({result.returncode}): {result.stderr.strip()[:500]}")
    text = result.stdout + ("\n" + result.stderr if result.stderr.strip() else "")
    return {
        "text_gz": base64.b64encode(gzip.compress(text.encode())).decode(),
        "exit_code": result.returncode,
        "bytes": len(text),
    }


Handler = Callable[[dict[str, Any], CommandRunner], Awaitable[dict[str, Any]]]
HANDLERS: dict[str, Handler] = {"ibnetdiscover": ibnetdiscover}
# What the agent lists at registration, so the control plane knows what it may ask.
FEATURES = ["ibnetdiscover.v1"]
