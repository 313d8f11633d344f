"""Agents joining together: the credential checks of the connections that arrive while a trip to the
database is under way go in one statement, and their registrations in one transaction, yet each
agent is answered for itself: its own node and desired state, its own refusal when its credential is
wrong, its own error when the database refuses its registration. A lone agent's join starts at once."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from agent import protocol
from apps.cluster import consumers, enrolment
from apps.cluster.choices import NodeStatus
from apps.cluster.models import Gpu, Node
from llmgw.asgi import application
from tests.builders import make_model, make_replica
from tests.wscomm import WebsocketCommunicator

pytestmark = pytest.mark.django_db(transaction=True)

HARDWARE: dict[str, Any] = {
    "hostname": "gpu",
    "cpus": 64,
    "memory_total_bytes": 512 * 1024**3,
    "gpus": [
        {"index": i, "name": "NVIDIA H100 80GB HBM3", "gpu_class": "H100-80GB", "memory_total_mib": 81559}
        for i in range(2)
    ],
}
# Two devices named by the same index: the database refuses the second row (one per node and index).
TWIN_CARDS = {**HARDWARE, "gpus": [HARDWARE["gpus"][0], HARDWARE["gpus"][0]]}


def enrolled(name: str) -> tuple[Node, str]:
    token = enrolment.create_enrollment(name, actor=None)
    return enrolment.enroll_node(token.secret)


async def database_sync(fn: Any) -> Any:
    from channels.db import database_sync_to_async

    return await database_sync_to_async(fn)()


async def until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


def dial(credential: str) -> WebsocketCommunicator:
    return WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {credential}".encode())]
    )


def registration(hardware: dict[str, Any] = HARDWARE) -> str:
    return protocol.encode("register", {"agent_version": "0.1.0", "hardware": hardware, "features": []})


async def answers(ws: WebsocketCommunicator) -> dict[str, Any]:
    """What the agent was told after its registration: each message's body by its type."""
    out: dict[str, Any] = {}
    while "registered" not in out and "error" not in out:
        message = json.loads(await ws.receive_from(timeout=10))
        out[message["type"]] = message
    if "registered" in out:
        out["desired"] = json.loads(await ws.receive_from(timeout=10))
    return out


class HeldTrips:
    """Registrations' trips to the database, the first held until the test lets it go, so the agents
    that register meanwhile are queued behind it; the size of each trip is kept."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sizes: list[int] = []
        self.gate = threading.Event()
        real = enrolment.register_nodes

        def held(joins: list[Any]) -> list[Any]:
            self.sizes.append(len(joins))
            self.gate.wait(10)
            return real(joins)

        monkeypatch.setattr(enrolment, "register_nodes", held)


async def test_agents_joining_together_each_get_their_own_node_and_desired_state(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.AGENT_JOINING_AT_ONCE = 8
    fleet = []
    for i in range(6):
        node, credential = await database_sync(lambda i=i: enrolled(f"gpu{i}"))
        await database_sync(lambda i=i, node=node: make_replica(make_model(f"model-{i}", gpus=1), node))
        fleet.append((node, credential))
    trips = HeldTrips(monkeypatch)
    sockets = [dial(credential) for _node, credential in fleet]
    for ws in sockets:
        assert (await ws.connect())[0]
        await ws.send_to(text_data=registration())
    await until(lambda: trips.sizes == [1])  # the first agent's trip left at once, alone
    # The other five registered while it was under way: they wait for it, then go together.
    await until(lambda: len(consumers._REGISTRATIONS.queues[asyncio.get_running_loop()]) == 5)
    trips.gate.set()
    told = [await answers(ws) for ws in sockets]
    assert trips.sizes == [1, 5]
    for i, said in enumerate(told):
        assert said["registered"]["node"] == f"gpu{i}"
        assert [shard["model"] for shard in said["desired"]["shards"]] == [f"model-{i}"]
    rows = await database_sync(lambda: {n.name: n for n in Node.objects.filter(name__startswith="gpu")})
    assert {row.status for row in rows.values()} == {NodeStatus.READY}
    assert await database_sync(lambda: Gpu.objects.count()) == 12
    for ws in sockets:
        await ws.disconnect()


async def test_a_bad_credential_among_good_ones_is_refused_alone_with_its_reason(settings: Any) -> None:
    settings.AGENT_JOINING_AT_ONCE = 8
    fleet = [await database_sync(lambda i=i: enrolled(f"gpu{i}")) for i in range(4)]
    credentials = [credential for _node, credential in fleet]
    credentials.insert(2, credentials[0][:-4] + "nope")
    sockets = [dial(credential) for credential in credentials]
    await asyncio.gather(*(ws.connect() for ws in sockets))
    refused = await sockets[2].receive_output(timeout=5)
    assert refused["type"] == "websocket.close" and refused["code"] == protocol.CLOSE_BAD_CREDENTIAL
    assert refused["reason"] == "unknown, revoked or missing node credential"
    for ws in sockets[:2] + sockets[3:]:
        await ws.send_to(text_data=registration())
    names = [(await answers(ws))["registered"]["node"] for ws in sockets[:2] + sockets[3:]]
    assert names == ["gpu0", "gpu1", "gpu2", "gpu3"]
    for ws in sockets:
        await ws.disconnect()


async def test_a_registration_the_database_refuses_fails_only_its_own_agent(
    settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's transaction is undone and its agents registered again one by one: the refused one
    is told the server could not handle its registration (and may send it again on the same
    connection), the others are registered as if alone."""
    settings.AGENT_JOINING_AT_ONCE = 8
    fleet = [await database_sync(lambda i=i: enrolled(f"gpu{i}")) for i in range(4)]
    sockets = [dial(credential) for _node, credential in fleet]
    trips = HeldTrips(monkeypatch)
    for ws in sockets:
        assert (await ws.connect())[0]
    await sockets[0].send_to(text_data=registration())
    await until(lambda: trips.sizes == [1])
    for i, ws in enumerate(sockets[1:], start=1):
        await ws.send_to(text_data=registration(TWIN_CARDS if i == 2 else HARDWARE))
    await until(lambda: len(consumers._REGISTRATIONS.queues[asyncio.get_running_loop()]) == 3)
    trips.gate.set()
    told = [await answers(ws) for ws in sockets]
    assert trips.sizes[:2] == [1, 3]
    assert told[2]["error"]["code"] == "server"
    assert told[2]["error"]["message"] == "the server could not handle this register"
    assert [said["registered"]["node"] for i, said in enumerate(told) if i != 2] == ["gpu0", "gpu1", "gpu3"]
    rows = await database_sync(lambda: {n.name: n.status for n in Node.objects.all()})
    assert rows == {"gpu0": "ready", "gpu1": "ready", "gpu2": "pending", "gpu3": "ready"}
    await sockets[2].send_to(text_data=registration())  # fixed: the same connection registers
    assert (await answers(sockets[2]))["registered"]["node"] == "gpu2"
    for ws in sockets:
        await ws.disconnect()


async def test_a_lone_agent_is_answered_in_a_trip_of_its_own_started_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing waits for others to join it: the trip leaves with the one registration queued."""
    node, credential = await database_sync(lambda: enrolled("gpu1"))
    trips = HeldTrips(monkeypatch)
    trips.gate.set()
    ws = dial(credential)
    assert (await ws.connect())[0]
    await ws.send_to(text_data=registration())
    assert (await answers(ws))["registered"]["node"] == "gpu1"
    assert trips.sizes == [1]
    await ws.disconnect()


def test_credentials_checked_together_cost_one_statement_and_a_bad_one_names_nothing() -> None:
    fleet = [enrolled(f"gpu{i}") for i in range(3)]
    joins = [(credential, f"chan.{i}") for i, (_node, credential) in enumerate(fleet)]
    joins.insert(1, ("llmgwn_unknown", "chan.bad"))
    joins.append(("not-a-credential", "chan.bad"))
    with CaptureQueriesContext(connection) as queries:
        found = enrolment.connect_nodes(joins)
    assert len(queries.captured_queries) == 1
    assert found == [(fleet[0][0].pk, "gpu0"), None, (fleet[1][0].pk, "gpu1"), (fleet[2][0].pk, "gpu2"), None]
    named = dict(Node.objects.values_list("name", "connection"))
    assert named == {"gpu0": "chan.0", "gpu1": "chan.1", "gpu2": "chan.2"}


def test_two_connections_of_one_node_checked_together_name_the_later_one() -> None:
    node, credential = enrolled("gpu1")
    found = enrolment.connect_nodes([(credential, "chan.first"), (credential, "chan.second")])
    assert found == [(node.pk, "gpu1"), (node.pk, "gpu1")]
    node.refresh_from_db()
    assert node.connection == "chan.second"


def test_registrations_together_write_their_rows_in_a_few_statements_whatever_their_number() -> None:
    """Only the audit events of nodes whose hardware changed (here: their first registration) are
    one statement each."""

    def cost(count: int, prefix: str) -> tuple[int, int]:
        joins: list[tuple[int, dict[str, Any], str | None]] = [
            (enrolled(f"{prefix}{i}")[0].pk, {"agent_version": "1", "hardware": HARDWARE, "features": []}, None)
            for i in range(count)
        ]
        counts = []
        for _time in ("first", "again"):
            with CaptureQueriesContext(connection) as queries:
                nodes = enrolment.register_nodes(joins)
            assert [node.name for node in nodes] == [f"{prefix}{i}" for i in range(count)]  # type: ignore[union-attr]
            counts.append(len(queries.captured_queries))
        return counts[0], counts[1]

    (small_first, small_again), (big_first, big_again) = cost(2, "small"), cost(8, "big")
    assert big_again == small_again
    assert big_first - small_first == 8 - 2
    assert Gpu.objects.count() == 20
