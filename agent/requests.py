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
from typing import Any, Protocol

from agent.runner import CommandRunner


class Context(Protocol):
    """What a handler may use of the agent: its tool runner and the root /sys is read under."""

    runner: CommandRunner
    root: str


__all__ = ["FEATURES", "HANDLERS", "RequestFailed"]

MAP_TIMEOUT_S = 150.0
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


class RequestFailed(Exception):
    pass


def _device(params: dict[str, Any]) -> tuple[str, str]:
    device, port = str(params.get("device") or ""), str(params.get("port") or "1")
    if not _NAME.fullmatch(device) or not re.fullmatch(r"[0-9]{1,5}", port):
        raise RequestFailed(f"not an adapter port: {device!r} port {port!r}")
    return device, port


def _missing(result: Any) -> bool:
    return result.returncode is None and ("No such file" in result.stderr or "not found" in result.stderr)


async def ibnetdiscover(params: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """The fabric's topology as ibnetdiscover prints it through one port, compressed (a large
    fabric's text is close to a megabyte); the control plane parses it."""
    device, port = _device(params)
    result = await ctx.runner.run("ibnetdiscover", "-C", device, "-P", port, timeout=MAP_TIMEOUT_S)
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


async def _ensure_perftest(runner: CommandRunner) -> None:
    """ib_write_bw, installed from the distribution (package perftest) the first time it is missing."""
    probe = await runner.run("ib_write_bw", "--version", timeout=10)
    if not _missing(probe):
        return
    install = await runner.run("apt-get", "install", "-y", "--no-install-recommends", "perftest", timeout=600)
    if not install.ok:
        raise RequestFailed(
            "ib_write_bw is not installed and installing perftest failed: "
            + (install.stderr.strip() or install.stdout.strip() or "apt-get is not available")[-500:]
        )


def _roce_gid(ctx: Context, device: str, port: str) -> int | None:
    """The RoCE v2 IPv4 GID index of the port (NCCL's default choice), resolved now: indexes move
    when addresses change. None for an InfiniBand port."""
    from agent.probes.infiniband import read_ports
    from agent.probes.sysfs import SysfsReader

    for found in read_ports(SysfsReader(ctx.root)).ports:
        if found.device == device and str(found.port) == port and found.link_layer == "Ethernet":
            if found.roce_gid_index is None:
                raise RequestFailed(f"{device} port {port} is RoCE but has no RoCE v2 IPv4 address")
            return found.roce_gid_index
    return None


def _perftest_args(params: dict[str, Any], ctx: Context) -> list[str]:
    device, port = _device(params)
    duration = int(params.get("duration") or 5)
    qps = int(params.get("qps") or 4)
    tcp_port = int(params.get("tcp_port") or 18515)
    if not (1 <= duration <= 120 and 1 <= qps <= 64 and 1024 <= tcp_port <= 65535):
        raise RequestFailed(f"out of range: duration {duration} s, {qps} QPs, TCP port {tcp_port}")
    args = ["-d", device, "-i", port, "-F", "--report_gbits", "-D", str(duration), "-q", str(qps), "-p", str(tcp_port)]
    gid = _roce_gid(ctx, device, port)
    if gid is not None:
        args += ["-x", str(gid)]
    return args


def _perftest_result(text: str, code: int | None) -> dict[str, Any]:
    from agent.probes.infiniband import parse_perftest

    parsed = parse_perftest(text)
    if parsed.bw_average_gbps is None:
        raise RequestFailed(f"ib_write_bw gave no result ({code}): {text.strip()[-500:]}")
    return {
        "bw_average_gbps": parsed.bw_average_gbps,
        "bw_peak_gbps": parsed.bw_peak_gbps,
        "msg_rate_mpps": parsed.msg_rate_mpps,
        "unit": parsed.unit,
        "device": parsed.device,
        "link_type": parsed.link_type,
        "warnings": parsed.warnings[:10],
    }


async def perftest_server(params: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """ib_write_bw waiting for its client, which the control plane starts on the other node."""
    await _ensure_perftest(ctx.runner)
    args = _perftest_args(params, ctx)
    wait = float(params.get("wait") or 60)
    result = await ctx.runner.run("ib_write_bw", *args, timeout=wait + int(params.get("duration") or 5) + 30)
    return _perftest_result(result.stdout, result.returncode)


async def perftest_client(params: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """ib_write_bw against the server node's address, tried again for a while until its server
    listens (the two requests reach their nodes at about the same time)."""
    import asyncio

    await _ensure_perftest(ctx.runner)
    args = _perftest_args(params, ctx)
    server = str(params.get("server") or "")
    if not server or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,255}", server):
        raise RequestFailed(f"not a server address: {server!r}")
    result = None
    for _attempt in range(20):
        result = await ctx.runner.run("ib_write_bw", *args, server, timeout=int(params.get("duration") or 5) + 60)
        if result.ok or "Couldn't connect" not in (result.stdout + result.stderr):
            break
        await asyncio.sleep(1.0)
    assert result is not None
    return _perftest_result(result.stdout, result.returncode)


Handler = Callable[[dict[str, Any], Context], Awaitable[dict[str, Any]]]
HANDLERS: dict[str, Handler] = {
    "ibnetdiscover": ibnetdiscover,
    "perftest.server": perftest_server,
    "perftest.client": perftest_client,
}
# What the agent lists at registration, so the control plane knows what it may ask.
FEATURES = ["ibnetdiscover.v1", "perftest.v1"]
