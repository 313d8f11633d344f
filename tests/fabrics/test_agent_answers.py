"""A hostile but enrolled agent answering the control plane's requests, through the real agent
websocket: a gzip bomb for a fabric map is refused at its bound (the web process never holds the
inflated text), and forged ib_write_bw figures are kept as unknown with the reason, never as sent,
while the API and the fabric test go on working."""

from __future__ import annotations

import asyncio
import base64
import json
import tracemalloc
import zlib
from typing import Any

import pytest
from channels.db import database_sync_to_async

from agent import protocol
from apps.cluster import agent_requests, enrolment
from apps.cluster.models import AgentRequest, Node
from apps.fabrics import maps, perf
from apps.fabrics.models import FabricMap, FabricTest
from llmgw.asgi import application
from tests.wscomm import WebsocketCommunicator

pytestmark = pytest.mark.django_db(transaction=True)

SM = "0x000000000000000a"
PORT = {
    "device": "mlx5_0",
    "port": 1,
    "fabric": "ib-a",
    "link_layer": "InfiniBand",
    "up": True,
    "rate_gbps": 200.0,
    "sm_guid": SM,
}
GOOD = {"bw_average_gbps": 187.5, "bw_peak_gbps": 190.1, "msg_rate_mpps": 0.36, "unit": "Gb/sec", "warnings": []}


class Agent:
    """One enrolled node's agent, speaking the protocol over the consumer: it answers what it is
    asked with whatever the test tells it to."""

    def __init__(self, node: Node, ws: WebsocketCommunicator) -> None:
        self.node = node
        self.ws = ws

    @classmethod
    async def join(cls, name: str) -> Agent:
        def enroll() -> tuple[Node, str]:
            return enrolment.enroll_node(enrolment.create_enrollment(name, actor=None).secret)

        node, credential = await database_sync_to_async(enroll)()
        ws = WebsocketCommunicator(
            application, "/ws/agent/", headers=[(b"authorization", f"Bearer {credential}".encode())]
        )
        assert (await ws.connect())[0]
        register = {
            "agent_version": "0.1.0",
            "hardware": {"hostname": name, "cpus": 8},
            "features": ["heartbeat.v1", "ibnetdiscover.v1", "perftest.v1"],
            "fabrics": {"ports": [PORT], "declared": ["ib-a"]},
        }
        await ws.send_to(text_data=protocol.encode("register", register))
        assert json.loads(await ws.receive_from())["type"] == "registered"
        return cls(node, ws)

    async def asked(self, kind: str, params: dict[str, Any]) -> AgentRequest:
        """A request of ``kind`` made for this node, as the control plane makes one."""

        def create() -> AgentRequest:
            return agent_requests.create(Node.objects.get(pk=self.node.pk), kind, params)

        return await database_sync_to_async(create)()

    async def request(self, timeout: float = 30) -> dict[str, Any]:
        """The next request the control plane sends (other messages are passed over)."""
        async with asyncio.timeout(timeout):
            while True:
                message = json.loads(await self.ws.receive_from(timeout))
                if message["type"] == "request":
                    return message

    async def answer(self, request: dict[str, Any], result: Any = None, *, raw: str | None = None) -> None:
        body = {"request_id": request["request_id"], "ok": True, "result": result}
        await self.ws.send_to(text_data=raw if raw is not None else protocol.encode("response", body))


async def answered(row_id: int, timeout: float = 30) -> AgentRequest:
    async with asyncio.timeout(timeout):
        while True:
            row = await database_sync_to_async(AgentRequest.objects.select_related("node").get)(pk=row_id)
            if row.state not in (AgentRequest.State.PENDING, AgentRequest.State.SENT):
                return row
            await asyncio.sleep(0.05)


def gzip_bomb(zeros_mib: int) -> str:
    """A real gzip stream of ``zeros_mib`` MiB of zeros, base64 as an ibnetdiscover answer carries
    it; made a MiB at a time, so the test itself never holds what it would inflate to."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(2**20)
    packed = b"".join([packer.compress(zeros) for _ in range(zeros_mib)] + [packer.flush()])
    return base64.b64encode(packed).decode()


async def test_a_gzip_bomb_for_a_map_is_refused_at_64_mib_without_inflating_the_rest() -> None:
    mapper = await Agent.join("n1")
    row = await mapper.asked("ibnetdiscover", {"fabric": f"ib:{SM}", "device": "mlx5_0", "port": 1})
    request = await mapper.request()
    bomb = gzip_bomb(700)  # 951 kB of text that inflates to 734 MB, as the hostile agent sent
    assert len(bomb) < protocol.MAX_MESSAGE_BYTES - 1000
    tracemalloc.start()
    try:
        await mapper.answer(request, {"text_gz": bomb, "exit_code": 0, "bytes": 700 * 2**20})
        failed = await answered(row.pk)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert failed.state == AgentRequest.State.FAILED
    assert failed.error == "The answer could not be used: the map inflates past 64 MiB"
    assert peak < maps.MAX_TEXT + 32 * 2**20, f"the web process held {peak:,} bytes"
    assert await database_sync_to_async(FabricMap.objects.count)() == 0
    await mapper.ws.disconnect()


FORGED = {
    "bw_average_gbps": "fast",
    "bw_peak_gbps": 1e308,
    "msg_rate_mpps": -5,
    "unit": True,
    "device": 2**70,
    "link_type": "IB",
    "warnings": ["perftest: ok"],
    "extra": {"kept": "never"},
}


async def test_forged_perftest_figures_are_kept_as_unknown_with_the_reason(api: Any, alice: Any) -> None:
    node = await Agent.join("n1")
    row = await node.asked("perftest.client", {"device": "mlx5_0", "port": 1, "server": "10.0.0.2"})
    await node.answer(await node.request(), FORGED)
    kept = await answered(row.pk)
    assert kept.state == AgentRequest.State.ANSWERED
    assert kept.result == {
        "bw_average_gbps": None,
        "bw_peak_gbps": None,
        "msg_rate_mpps": None,
        "unit": None,
        "device": None,
        "link_type": "IB",
        "warnings": ["perftest: ok"],
        "refused": [
            "bw_average_gbps: expected a number, got 'fast'",
            "bw_peak_gbps: expected 0 to 8,000, got 1e+308",
            "msg_rate_mpps: expected 0 to 100,000, got -5",
            "unit: expected a string, got true",
            "device: expected a string, got 1180591620717411303424",
        ],
    }
    # A figure of the right type that is a whole number beyond 64 bits, or a boolean.
    row = await node.asked("perftest.server", {"device": "mlx5_0"})
    await node.answer(await node.request(), {"bw_average_gbps": 2**70, "bw_peak_gbps": True})
    kept = await answered(row.pk)
    assert kept.result == {
        "bw_average_gbps": None,
        "bw_peak_gbps": None,
        "refused": ["bw_average_gbps: a number beyond 64 bits", "bw_peak_gbps: expected a number, got true"],
    }
    # An answer that is not an object at all keeps nothing of it.
    row = await node.asked("perftest.server", {"device": "mlx5_0"})
    await node.answer(await node.request(), ["fast"])
    kept = await answered(row.pk)
    assert kept.result == {"refused": ['result: expected an object, got ["fast"]']}

    @database_sync_to_async
    def listed() -> Any:
        api.force_authenticate(alice)
        return api.get("/api/v1/agent-requests", {"node": "n1"})

    answer = await listed()
    assert answer.status_code == 200
    assert {r["result"].get("bw_average_gbps", "absent") for r in answer.json()["results"]} == {None, "absent"}
    await node.ws.disconnect()


@pytest.mark.parametrize("figure", ["NaN", "Infinity", "-Infinity", "1e999"])
async def test_a_non_finite_figure_refuses_the_message_and_the_request_is_not_answered_with_it(figure: str) -> None:
    node = await Agent.join("n1")
    row = await node.asked("perftest.client", {"device": "mlx5_0"})
    request = await node.request()
    raw = (
        f'{{"v": 1, "type": "response", "request_id": "{request["request_id"]}", "ok": true, '
        f'"result": {{"bw_average_gbps": {figure}}}}}'
    )
    await node.answer(request, raw=raw)
    error = json.loads(await node.ws.receive_from())
    assert error["type"] == "error" and error["code"] == "invalid"
    kept = await database_sync_to_async(AgentRequest.objects.get)(pk=row.pk)
    assert kept.state == AgentRequest.State.SENT and kept.result is None
    await node.ws.disconnect()


async def test_a_fabric_test_with_a_forged_figure_grades_that_rail_failed_with_why(api: Any, alice: Any) -> None:
    client, server = await Agent.join("a"), await Agent.join("b")

    @database_sync_to_async
    def planned() -> FabricTest:
        a, b = Node.objects.get(pk=client.node.pk), Node.objects.get(pk=server.node.pk)
        fabric, rails = perf.plan(a, b)
        return FabricTest.objects.create(client=a, server=b, fabric=fabric, rails=rails, duration_s=1)

    test = await planned()
    running = asyncio.create_task(database_sync_to_async(perf.run_test, thread_sensitive=False)(test.pk))
    served, measured = await server.request(), await client.request()
    assert (served["kind"], measured["kind"]) == ("perftest.server", "perftest.client")
    await server.answer(served, GOOD)
    await client.answer(measured, {**GOOD, "bw_average_gbps": "fast"})
    done: FabricTest = await asyncio.wait_for(running, 60)
    assert done.state == FabricTest.State.DONE and done.error == ""
    (rail,) = done.rails
    assert rail["measured_gbps"] is None and rail["share"] is None
    assert rail["grade"] == "failed" and rail["state"] == "failed"
    assert rail["error"] == "a: bw_average_gbps: expected a number, got 'fast'"

    @database_sync_to_async
    def shown() -> Any:
        api.force_authenticate(alice)
        return api.get(f"/api/v1/fabric-tests/{test.pk}")

    page = await shown()
    assert page.status_code == 200 and page.json()["rails"][0]["grade"] == "failed"
    await client.ws.disconnect()
    await server.ws.disconnect()
