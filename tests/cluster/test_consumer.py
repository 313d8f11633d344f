"""The agent websocket, through the real ASGI application."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from django.utils import timezone

from agent import protocol
from apps.cluster import actions, enrolment, history
from apps.cluster.choices import NodeStatus
from apps.cluster.models import Gpu, Node
from llmgw.asgi import application
from tests.wscomm import WebsocketCommunicator

pytestmark = pytest.mark.django_db(transaction=True)

HARDWARE = {
    "hostname": "gpu1",
    "cpu_model": "Xeon",
    "cpus": 64,
    "memory_total_bytes": 512 * 1024**3,
    "gpus": [
        {"index": i, "name": "NVIDIA H100 80GB HBM3", "gpu_class": "H100-80GB", "memory_total_mib": 81559}
        for i in range(2)
    ],
}


def enrolled(name: str = "gpu1") -> tuple[Node, str]:
    token = enrolment.create_enrollment(name, actor=None)
    return enrolment.enroll_node(token.secret)


async def connect(credential: str) -> WebsocketCommunicator:
    communicator = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {credential}".encode())]
    )
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def register(communicator: WebsocketCommunicator, **extra: Any) -> dict[str, Any]:
    await communicator.send_to(
        text_data=protocol.encode(
            "register", {"agent_version": "0.1.0", "hardware": HARDWARE, "features": ["heartbeat.v1"], **extra}
        )
    )
    answer = json.loads(await communicator.receive_from(timeout=5))
    if answer["type"] == "registered":
        desired = json.loads(await communicator.receive_from(timeout=5))
        assert desired["type"] == "desired"  # a registered agent is told at once what to run
    return answer


async def test_a_registered_agent_heartbeats_and_the_node_is_ready() -> None:
    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    answer = await register(ws)
    assert answer["type"] == "registered" and answer["node"] == "gpu1"
    await ws.send_to(
        text_data=protocol.encode(
            "heartbeat",
            {"sample": {"cpus": 64, "cpu_utilization_pct": 12.5, "gpus": [{"index": 0, "temperature_gpu_c": 41}]}},
        )
    )
    await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": 64}}))
    await ws.disconnect()
    node = await database_sync(lambda: Node.objects.get(pk=node.pk))
    assert node.status == NodeStatus.READY
    assert node.sample == {"cpus": 64}
    assert await database_sync(lambda: Gpu.objects.filter(node=node).count()) == 2


async def test_a_bad_credential_closes_with_a_reason_code() -> None:
    communicator = WebsocketCommunicator(application, "/ws/agent/", headers=[(b"authorization", b"Bearer llmgwn_nope")])
    await communicator.connect()
    closed = await communicator.receive_output(timeout=5)
    assert closed["type"] == "websocket.close"
    assert closed["code"] == protocol.CLOSE_BAD_CREDENTIAL


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("{not json", "malformed"),
        (json.dumps({"v": 1, "type": "teleport"}), "unknown_type"),
        (json.dumps({"v": 99, "type": "heartbeat"}), "version"),
        (json.dumps({"v": 1, "type": "heartbeat", "sample": {"cpus": "many"}}), "invalid"),
        ("x" * (protocol.MAX_MESSAGE_BYTES + 1), "too_large"),
        ('{"v": 1, "type": "heartbeat", "sample": {"cpu_utilization_pct": NaN}}', "invalid"),
        ('{"v": 1, "type": "heartbeat", "sample": {"inlet_temp_c": Infinity}}', "invalid"),
        ('{"v": 1, "type": "heartbeat", "sample": {"inlet_temp_c": 1e999}}', "invalid"),
        ('{"v": 1, "type": "heartbeat", "sample": {"warnings": ["fan\\u0000"]}}', "invalid"),
        ('{"v": 1, "type": "heartbeat", "sample": {}, "extra": ' + "[" * 3000 + "]" * 3000 + "}", "invalid"),
        ('{"v": 1, "type": "heartbeat", "sample": {}, "extra": ' + "[" * 40 + "]" * 40 + "}", "invalid"),
    ],
)
async def test_a_bad_message_gets_an_error_and_the_connection_goes_on(raw: str, code: str) -> None:
    _node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    await ws.send_to(text_data=raw)
    error = json.loads(await ws.receive_from(timeout=5))
    assert error["type"] == "error" and error["code"] == code
    answer = await register(ws)
    assert answer["type"] == "registered"
    await ws.disconnect()


BEYOND_COLUMNS = [
    ({"type": "register", "hardware": {"gpus": [{"index": 2**40}]}}, "register.hardware.gpus[0].index"),
    ({"type": "register", "hardware": {"gpus": [{"index": 0, "memory_total_mib": 2**31}]}}, "memory_total_mib"),
    ({"type": "heartbeat", "sample": {"gpus": [{"index": 0, "foreign_processes": 2**31}]}}, "foreign_processes"),
    ({"type": "report", "shards": [{"shard": "r1s0", "state": "running", "pid": 2**31}]}, "report.shards[0].pid"),
    ({"type": "report", "shards": [{"shard": "r1s0", "state": "failed", "exit_code": -(2**31) - 1}]}, "exit_code"),
]


@pytest.mark.parametrize(("message", "field"), BEYOND_COLUMNS)
async def test_a_figure_past_its_column_is_refused_naming_the_field_and_the_connection_goes_on(
    message: dict[str, Any], field: str
) -> None:
    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    assert (await register(ws))["type"] == "registered"
    await ws.send_to(text_data=json.dumps({"v": 1, "agent_version": "0.1.0", **message}))
    error = json.loads(await ws.receive_from(timeout=5))
    assert error["type"] == "error" and error["code"] == "invalid"
    assert field in error["message"] and "expected a whole number from" in error["message"]
    # The agent goes on: its next registration and heartbeat are taken as ever.
    assert (await register(ws))["type"] == "registered"
    await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"gpus": [{"index": 1}]}}))
    await ws.disconnect()
    indices = await database_sync(lambda: sorted(Gpu.objects.filter(node=node).values_list("index", flat=True)))
    assert indices == [0, 1]
    assert (await database_sync(lambda: Node.objects.get(pk=node.pk))).sample == {"gpus": [{"index": 1}]}


@pytest.mark.parametrize("path", ["/ws/agent/\x00", "/ws/agent/%00", "/ws/nope/", "/ws/agent"])
async def test_a_websocket_to_a_path_no_route_serves_is_refused_at_the_handshake(path: str) -> None:
    connected, code = await WebsocketCommunicator(application, path).connect()
    assert not connected and code == 1008


async def test_a_newer_connection_replaces_the_older() -> None:
    _node, credential = await database_sync(enrolled)
    old = await connect(credential)
    await register(old)
    new = await connect(credential)
    replaced = json.loads(await old.receive_from(timeout=5))
    assert replaced["type"] == "replaced"
    closed = await old.receive_output(timeout=5)
    assert closed["code"] == protocol.CLOSE_REPLACED
    assert (await register(new))["type"] == "registered"
    await new.disconnect()


async def test_revoking_a_node_closes_its_socket_at_once() -> None:
    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    await register(ws)
    await database_sync(lambda: actions.revoke_node(Node.objects.get(pk=node.pk), actor=None))
    closed = await ws.receive_output(timeout=5)
    assert closed["type"] == "websocket.close" and closed["code"] == protocol.CLOSE_REVOKED
    again = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {credential}".encode())]
    )
    await again.connect()
    assert (await again.receive_output(timeout=5))["code"] == protocol.CLOSE_BAD_CREDENTIAL


async def test_registration_never_clears_a_cordon() -> None:
    node, credential = await database_sync(enrolled)
    await database_sync(lambda: actions.cordon_node(Node.objects.get(pk=node.pk), reason="bad fan", actor=None))
    ws = await connect(credential)
    await register(ws)
    await ws.disconnect()
    node = await database_sync(lambda: Node.objects.get(pk=node.pk))
    assert node.cordoned and node.cordon_reason == "bad fan"


async def until(condition: Any) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def database_sync(fn: Any) -> Any:
    from channels.db import database_sync_to_async

    return await database_sync_to_async(fn)()


async def test_a_poisoned_agent_among_healthy_ones_costs_only_its_own_samples() -> None:
    from apps.cluster.heartbeats import writer
    from apps.cluster.metrics import PROTOCOL_ERRORS

    nodes = [await database_sync(lambda i=i: enrolled(f"n{i}")) for i in range(3)]
    sockets = [await connect(credential) for _node, credential in nodes]
    for ws in sockets:
        await register(ws)
    before = PROTOCOL_ERRORS.labels(code="invalid")._value.get()
    await sockets[0].send_to(text_data='{"v": 1, "type": "heartbeat", "sample": {"cpu_utilization_pct": NaN}}')
    error = json.loads(await sockets[0].receive_from(timeout=5))
    assert error["type"] == "error" and error["code"] == "invalid" and "NaN" in error["message"]
    assert PROTOCOL_ERRORS.labels(code="invalid")._value.get() == before + 1
    for ws in sockets[1:]:
        await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": 8, "cpu_utilization_pct": 5}}))
    await until(lambda: {n.pk for n, _c in nodes[1:]} <= set(writer._pending))
    await writer.flush()
    for node, _credential in nodes[1:]:
        row = await database_sync(lambda node=node: Node.objects.get(pk=node.pk))
        assert row.sample == {"cpus": 8, "cpu_utilization_pct": 5}
    # The poisoned agent's connection goes on: its next good heartbeat is written.
    await sockets[0].send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": 2}}))
    await until(lambda: nodes[0][0].pk in writer._pending)
    await writer.flush()
    assert (await database_sync(lambda: Node.objects.get(pk=nodes[0][0].pk))).sample == {"cpus": 2}
    for ws in sockets:
        await ws.disconnect()


async def test_a_batch_the_database_refuses_is_written_row_by_row_and_the_bad_row_dropped(monkeypatch) -> None:
    from apps.cluster import heartbeats
    from apps.cluster.heartbeats import DROPPED, writer

    good, _c1 = await database_sync(lambda: enrolled("good"))
    bad, _c2 = await database_sync(lambda: enrolled("bad"))
    real = heartbeats._write

    def refuse_the_bad_one(batch):
        if bad.pk in batch:
            raise ValueError("the database refused this sample")
        return real(batch)

    monkeypatch.setattr(heartbeats, "_write", refuse_the_bad_one)
    dropped = DROPPED._value.get()
    writer.add(bad.pk, {"cpus": 1})
    writer.add(good.pk, {"cpus": 4})
    await writer.flush()
    assert (await database_sync(lambda: Node.objects.get(pk=good.pk))).sample == {"cpus": 4}
    assert DROPPED._value.get() == dropped + 1
    assert writer._pending == {}  # the refused sample is not put back to fail again
    await writer.flush()
    assert DROPPED._value.get() == dropped + 1


async def test_a_replaced_connection_that_missed_the_message_is_closed_by_the_sweep() -> None:
    from apps.cluster.heartbeats import writer

    node, credential = await database_sync(enrolled)
    old = await connect(credential)
    await register(old)
    # A newer connection on another web process named itself; its message to this one was lost.
    await database_sync(lambda: enrolment.set_connection(node.pk, "specific.elsewhere!abc"))
    await writer.sweep()
    assert json.loads(await old.receive_from(timeout=5))["type"] == "replaced"
    assert (await old.receive_output(timeout=5))["code"] == protocol.CLOSE_REPLACED


async def test_a_revoked_node_whose_message_was_lost_is_closed_by_the_sweep() -> None:
    from apps.cluster.heartbeats import writer

    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    await register(ws)
    await database_sync(lambda: Node.objects.filter(pk=node.pk).update(revoked_at=timezone.now(), credential_hash=None))
    await writer.sweep()
    assert (await ws.receive_output(timeout=5))["code"] == protocol.CLOSE_REVOKED


async def test_a_discard_that_fails_is_tried_again() -> None:
    from apps.cluster.consumers import AgentConsumer

    class Layer:
        calls = 0

        async def group_discard(self, group: str, channel: str) -> None:
            Layer.calls += 1
            if Layer.calls < 3:
                raise ConnectionError("Too many connections")

    consumer = AgentConsumer()
    consumer.node_id, consumer.node_name, consumer.channel_name = 1, "n1", "specific.x!y"
    consumer.channel_layer = Layer()
    await consumer.leave_group()
    assert Layer.calls == 3


async def test_an_agent_connects_heartbeats_and_leaves_while_redis_is_away(settings, caplog) -> None:
    """The channel layer on a Redis that cannot be reached: the node still registers and is ready."""
    settings.CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "llmgw.channel_layer.ChannelLayer",
            "CONFIG": {"hosts": [{"address": "redis://127.0.0.1:1/0"}]},
        }
    }
    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    answer = await register(ws)
    assert answer["type"] == "registered"
    await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": 64}}))
    await asyncio.sleep(1.5)  # the consumer's channel-layer receive has failed and waits, not ended it
    await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": 32}}))
    await ws.disconnect()
    node = await database_sync(lambda: Node.objects.get(pk=node.pk))
    assert node.status == NodeStatus.READY and node.sample == {"cpus": 32}
    assert "the channel layer cannot be reached" in caplog.text


def test_brackets_and_escapes_inside_strings_are_not_nesting() -> None:
    """The depth check counts the brackets outside strings only: a warning full of brackets, or an
    escaped quote before them, is text."""
    text = '"fan [' + "[" * 40 + ']"'
    for warning in (text, '"a \\" quote ' + "[" * 40 + '"', '"ends with a backslash \\\\"'):
        raw = '{"v": 1, "type": "heartbeat", "sample": {"warnings": [' + warning + "]}}"
        assert protocol.parse_message(raw, expect="agent").type == "heartbeat"
    deep = '{"v": 1, "type": "heartbeat", "sample": {"warnings": ["\\\\"]}, "x": ' + "[" * 40 + "]" * 40 + "}"
    with pytest.raises(protocol.ProtocolError, match="nested deeper than 32 levels"):
        protocol.parse_message(deep, expect="agent")


async def test_joining_agents_wait_their_turn_and_past_the_waiting_list_are_told_to_come_back_later(
    settings: Any,
) -> None:
    """A fleet that dials at once is taken in a few at a time: the others wait with their connection
    open (the handshake answered at once), and past the waiting list an agent is closed at once with
    "try again later" and the reason, and gets in when it dials again after its backoff."""
    from apps.cluster.consumers import _Joining
    from apps.cluster.metrics import JOINS_DEFERRED

    settings.AGENT_JOINING_AT_ONCE = 1
    settings.AGENT_JOINS_WAITING = 1
    _first_node, first_credential = await database_sync(lambda: enrolled("gpu1"))
    _second_node, second_credential = await database_sync(lambda: enrolled("gpu2"))
    deferred = JOINS_DEFERRED._value.get()
    give_back = await _Joining.take()  # the one place taken, as by an agent being registered
    first = await connect(first_credential)  # answered at once, and waiting its turn
    await first.send_to(
        text_data=protocol.encode("register", {"agent_version": "0.1.0", "hardware": HARDWARE, "features": []})
    )
    async with asyncio.timeout(5):
        while _Joining.waiting < 1:
            await asyncio.sleep(0.01)
    assert await first.receive_nothing(timeout=0.2)
    second = WebsocketCommunicator(
        application, "/ws/agent/", headers=[(b"authorization", f"Bearer {second_credential}".encode())]
    )
    await second.connect()
    closed = await second.receive_output(timeout=5)
    assert closed["type"] == "websocket.close" and closed["code"] == protocol.CLOSE_BUSY
    assert "1 agents are waiting to join this server process, which lets 1 wait" in closed["reason"]
    assert JOINS_DEFERRED._value.get() == deferred + 1
    await second.disconnect()
    # The place is free again: the waiting agent is registered, then the one that dials again.
    give_back()
    answer = json.loads(await first.receive_from(timeout=5))
    assert answer["type"] == "registered" and answer["node"] == "gpu1"
    second = await connect(second_credential)
    assert (await register(second))["type"] == "registered"
    assert _Joining.waiting == 0
    await second.disconnect()
    await first.disconnect()


async def test_what_an_agent_sends_while_it_waits_its_turn_is_handled_once_it_is_taken_in(settings: Any) -> None:
    """The connection keeps being read while the agent waits for a place (so pings and pongs keep
    flowing): its registration and newest heartbeat are kept and handled, in order, once it is in."""
    from apps.cluster.consumers import _Joining

    settings.AGENT_JOINING_AT_ONCE = 1
    node, credential = await database_sync(lambda: enrolled("gpu1"))
    give_back = await _Joining.take()
    ws = await connect(credential)
    await ws.send_to(
        text_data=protocol.encode("register", {"agent_version": "0.1.0", "hardware": HARDWARE, "features": []})
    )
    for cpus in (1, 2, 3):  # only the newest is kept
        await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": {"cpus": cpus}}))
    assert await ws.receive_nothing(timeout=0.3)
    give_back()
    assert json.loads(await ws.receive_from(timeout=5))["type"] == "registered"
    assert json.loads(await ws.receive_from(timeout=5))["type"] == "desired"
    from apps.cluster.heartbeats import writer

    await writer.flush()
    assert (await database_sync(lambda: Node.objects.get(pk=node.pk))).sample == {"cpus": 3}
    await ws.disconnect()


async def test_agents_joining_open_no_redis_connection_each() -> None:
    """Every agent's registration asks, at most once a minute, for the engine releases to be read:
    through Django's cache that opened a Redis connection in each connection's own context, and a
    fleet of 10,000 ran Redis out of clients."""
    client = history.client()
    if client is None:
        pytest.skip("without Redis there are no Redis connections to count")
    from apps.cluster.models import EngineChoice

    # Every node wants an engine whose release was never read: each registration asks.
    await database_sync(lambda: EngineChoice.objects.create(engine="llama.cpp", version="b9999", scope="all"))
    db = str(client.connection_pool.connection_kwargs.get("db", 0))

    def ours() -> int:  # other processes (a second test run at the same time) use other databases
        return sum(1 for found in client.client_list() if str(found.get("db")) == db)

    before = await database_sync(ours)
    agents = []
    for i in range(20):
        _node, credential = await database_sync(lambda i=i: enrolled(f"gpu{i}"))
        ws = await connect(credential)
        assert (await register(ws))["type"] == "registered"
        agents.append(ws)
    assert await database_sync(ours) - before < 10
    for ws in agents:
        await ws.disconnect()
