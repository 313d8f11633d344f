"""The websocket every agent holds to the control plane (/ws/agent/)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db.models import prefetch_related_objects

from agent import protocol
from apps.cluster import actions, agent_requests, enrolment, reports
from apps.cluster.engines import EngineTables
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.heartbeats import writer as heartbeat_writer
from apps.cluster.metrics import JOINS_DEFERRED, MESSAGE_SECONDS, PROTOCOL_ERRORS, PROTOCOL_MESSAGES
from apps.cluster.models import AgentRequest, Node
from apps.cluster.reconciler import desired_message

__all__ = ["AgentConsumer"]

log = logging.getLogger(__name__)


# A joined agent that has not sent its registration within this long gives its place back.
REGISTER_SECONDS = 10.0
# Messages kept from an agent waiting to be taken in (the newest heartbeat counts once).
HELD_MESSAGES = 32


class _Joining:
    """Agents joining this process hold one of settings.AGENT_JOINING_AT_ONCE places from their
    credential check until their registration is answered (its shard list and requests sent;
    the agent sends it right after the handshake, so it is most often waiting already). The rest
    wait their turn with the connection open: the handshake is answered at once, so no agent's
    timeout runs out and it dials again, adding to the queue. Past settings.AGENT_JOINS_WAITING
    waiting, a connection is told to come back later (close code 1013) and the agent backs off.
    Heartbeats of joined agents never wait here."""

    waiting = 0
    places: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()

    @classmethod
    async def take(cls) -> Callable[[], None]:
        """Wait for a place; returns what gives it back (once, however often it is called)."""
        loop = asyncio.get_running_loop()
        places = cls.places.get(loop)
        if places is None:
            places = cls.places[loop] = asyncio.Semaphore(settings.AGENT_JOINING_AT_ONCE)
        cls.waiting += 1
        try:
            await places.acquire()
        finally:
            cls.waiting -= 1
        held = True

        def give_back() -> None:
            nonlocal held
            if held:
                held = False
                timer.cancel()
                places.release()

        timer = loop.call_later(REGISTER_SECONDS, give_back)
        return give_back


class _FleetReads:
    """What every node's desired state reads alike (the engine rules, releases and held archives,
    and what to fetch from the mirror), shared by the registrations of this process under way at
    once: a fleet joining together read them once per agent, a third of a join's queries.

    A registration takes a read only if it began after the registration had read its node's row
    (`since`), so the read holds every change that moved the desired state version the
    registration records as sent (a change bumps the version after committing itself); an older
    read is never used, and nothing is read twice in the same moment when it need not be."""

    lock = threading.Lock()
    last: tuple[float, EngineTables, tuple[list[dict[str, Any]] | None]] | None = None

    @classmethod
    def since(cls, since: float) -> tuple[EngineTables, tuple[list[dict[str, Any]] | None]]:
        with cls.lock:
            last = cls.last
        if last is not None and last[0] >= since:
            return last[1], last[2]
        started = time.monotonic()
        tables, fetches = EngineTables.read(), (EXTENSIONS.node_fetches(),)
        with cls.lock:
            if cls.last is None or cls.last[0] < started:
                cls.last = (started, tables, fetches)
        return tables, fetches


class _Together[T, R]:
    """Calls of one database function that this process's connections make at about the same
    moment, made as one: a fleet joining at once otherwise pays a trip to a database thread, a
    statement and a transaction per agent for what one statement does for many.

    The first call starts a trip at once, taking whatever else is queued by then (nothing waits
    for a window to fill: a lone join is answered as soon as before); the calls that arrive while
    a trip is under way go together in the next. `run` answers each item in its place, with its
    result or the exception that failed it alone; each caller gets its own."""

    def __init__(self, run: Callable[[list[T]], Sequence[R | Exception]], most: int) -> None:
        self.run = run
        self.most = most
        self.queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[tuple[T, asyncio.Future[Any]]]] = (
            weakref.WeakKeyDictionary()
        )
        self.trips: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Task[None]] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue = self.queues.setdefault(loop, [])
        queue.append((item, future))
        trip = self.trips.get(loop)
        if trip is None or trip.done():
            self.trips[loop] = loop.create_task(self.drain(queue))
        answer = await future
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[no-any-return]

    async def drain(self, queue: list[tuple[T, asyncio.Future[Any]]]) -> None:
        while queue:
            taken = queue[: self.most]
            del queue[: self.most]
            try:
                answers: list[Any] = await database_sync_to_async(self.run, thread_sensitive=False)(
                    [item for item, _future in taken]
                )
            except Exception as exc:
                answers = [exc] * len(taken)
            for (_item, future), answer in zip(taken, answers, strict=True):
                if not future.done():  # its agent went meanwhile
                    future.set_result(answer)


# The most agents whose credential check, or whose registration, go in one trip.
JOINS_TOGETHER = 64

Registered = tuple[str, int, protocol.DesiredMessage, list[dict[str, Any]]]


def _register(node_id: int, body: dict[str, Any], address: str | None) -> Registered:
    """Record a registration; the node's name, its desired state (version and body) and its
    pending requests, marked sent."""
    answer = _register_many([(node_id, body, address)])[0]
    if isinstance(answer, Exception):
        raise answer
    return answer


def _register_many(joins: list[tuple[int, dict[str, Any], str | None]]) -> list[Registered | Exception]:
    """_register for many agents at once (node id, registration body, address each): their rows
    written together (enrolment.register_nodes), their cards and pending requests read once for
    all. What an agent reports for other apps (its fabrics) goes to the app registered for it. A
    registration that fails is that agent's exception, in its place; the others go on."""
    nodes = enrolment.register_nodes(joins)
    since = time.monotonic()  # after the nodes' rows (and their desired state versions) were read
    registered = [node for node in nodes if isinstance(node, Node)]
    prefetch_related_objects(registered, "gpus")  # the cards each node's engines are chosen for
    pending = set(
        AgentRequest.objects.filter(
            node_id__in=[node.pk for node in registered], state=AgentRequest.State.PENDING
        ).values_list("node_id", flat=True)
    )
    tables, fetches = _FleetReads.since(since)
    out: list[Registered | Exception] = []
    for (node_id, body, _address), node in zip(joins, nodes, strict=True):
        if isinstance(node, Exception):
            out.append(node)
            continue
        try:
            for kind in EXTENSIONS.node_reports:
                if kind in body:
                    EXTENSIONS.record_report(kind, node_id, body[kind])
            desired = desired_message(node, node.desired_version, tables, fetches)
            requests = agent_requests.claim(node_id) if node_id in pending else []
        except Exception as exc:
            out.append(exc)
            continue
        out.append((node.name, node.desired_version, desired, requests))
    return out


_CONNECTS = _Together(enrolment.connect_nodes, JOINS_TOGETHER)
_REGISTRATIONS = _Together(_register_many, JOINS_TOGETHER)


def _bearer(scope: dict[str, Any]) -> str:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            parts = value.decode("latin-1").split()
            if len(parts) == 2 and parts[0].lower() == "bearer":
                return parts[1]
    return ""


class AgentConsumer(AsyncWebsocketConsumer):
    """One per connected agent. A newer connection of the same node replaces this one.

    Messages are validated with agent.protocol; a bad one is answered with an error
    message, counted and logged, and the connection goes on.
    """

    node_id: int | None = None
    node_name: str = ""
    gpu_health: dict[int, reports.Health] | None = None
    desired_sent: int | None = None
    poller: asyncio.Task[None] | None = None
    closing = False
    closed = False

    give_back: Callable[[], None] | None = None  # this connection's place among the joining agents
    joining: asyncio.Task[None] | None = None
    held: list[str | bytes] | None = None  # what the agent sent before it was taken in

    def joined(self) -> None:
        """Give back this connection's place among the joining agents, if it holds one (_Joining.take)."""
        if self.give_back is not None:
            self.give_back()

    async def dispatch(self, message: dict[str, Any]) -> None:
        """As Channels' own, without its hop to the one thread for synchronous code before every
        message (to close that thread's stale database connections): with thousands of agents that
        hop, once per heartbeat, queued every connection of the process behind one thread. Every
        database call of this consumer runs through database_sync_to_async, which closes stale
        connections in the thread it runs in."""
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"No handler for message type {message['type']}")
        await handler(message)

    async def send(self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False) -> None:
        """As the base class's; nothing once the connection was closed (replaced, revoked, told to
        come back later): an answer under way then has no one to go to."""
        if self.closed:
            return
        await super().send(text_data, bytes_data, close)

    async def close(self, code: int | bool | None = None, reason: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError):  # the agent went first (uvicorn's ClientDisconnected)
            await super().close(code=code, reason=reason)

    async def connect(self) -> None:
        await self.accept()  # at once: an agent waiting for its turn below is not timing out meanwhile
        waiting, most = _Joining.waiting, settings.AGENT_JOINS_WAITING
        if waiting >= most:
            JOINS_DEFERRED.inc()
            await self.close(
                code=protocol.CLOSE_BUSY,
                reason=f"busy: {waiting} agents are waiting to join this server process, which lets {most} wait; "
                "dial again after a backoff",
            )
            return
        self.held = []
        self.joining = asyncio.create_task(self.join_in_turn())

    async def join_in_turn(self) -> None:
        """Wait for a place, join, then handle what the agent sent meanwhile, in order. This runs
        beside the consumer's own loop, which goes on taking the agent's messages (held in
        `self.held`): uvicorn reads nothing more from a socket, pongs included, until the consumer
        has taken the message before, so a wait here would let the agent's keepalive or the
        server's close a connection that is only waiting its turn."""
        try:
            self.give_back = await _Joining.take()
            await self.join()
            while self.node_id is not None and self.held:
                await self.handle(self.held.pop(0))
        except Exception as exc:
            log.warning("an agent could not be taken in (%s: %s); it will dial again", type(exc).__name__, exc)
            await self.close(code=1011, reason="the server could not take this agent in now; dial again")
        finally:
            self.held = None
            if self.node_id is None:  # refused, or failed: no registration to wait for
                self.joined()

    def hold(self, raw: str | bytes) -> None:
        """Keep a message that came before the agent was taken in: the newest heartbeat only (each
        replaces the one before), and at most HELD_MESSAGES in all."""
        assert self.held is not None
        if isinstance(raw, str) and raw.startswith('{"v":1,"type":"heartbeat"'):
            self.held = [m for m in self.held if not (isinstance(m, str) and m.startswith('{"v":1,"type":"heartbeat"'))]
        if len(self.held) >= HELD_MESSAGES:
            PROTOCOL_ERRORS.labels(code="held").inc()
            log.warning(
                "an agent waiting to be taken in sent more than %s messages; the rest are dropped", HELD_MESSAGES
            )
            return
        self.held.append(raw)

    async def join(self) -> None:
        # The node's row names its newest connection: an older one, wherever it is, learns it was
        # replaced from the channel layer at once, or from its process's next sweep of the rows.
        found = await _CONNECTS((_bearer(self.scope), self.channel_name))
        if found is None:
            await self.close(code=protocol.CLOSE_BAD_CREDENTIAL, reason="unknown, revoked or missing node credential")
            return
        self.node_id, self.node_name = found
        group = actions.node_group(self.node_id)
        # Tell an older connection of this node to go, before joining the group ourselves. Without
        # the channel layer (Redis away) the connection still serves: heartbeats and reports go to
        # the database, an older connection learns from the sweep, and the layer adds the
        # membership it could not add once Redis is back.
        for step in (
            lambda: self.channel_layer.group_send(group, {"type": "agent.replace", "channel": self.channel_name}),
            self.join_group,
        ):
            try:
                await step()
            except Exception as exc:
                log.warning(
                    "agent of node %s: the channel layer cannot be reached (%s: %s); going on without it",
                    self.node_name,
                    type(exc).__name__,
                    exc,
                )
        heartbeat_writer.attach(self)
        log.info("agent of node %s connected", self.node_name)
        if type(self.channel_layer).__name__ == "InMemoryChannelLayer":
            # One machine without Redis: a change made by the worker cannot reach this process through
            # the channel layer, so look for it every 2 s (one node, one cheap read) instead of waiting
            # for the next heartbeat.
            self.poller = asyncio.create_task(self.poll_desired())

    async def websocket_disconnect(self, message: dict[str, Any]) -> None:
        """As Channels' own (this consumer keeps no `groups` of Channels'), without its hop to the
        one thread for synchronous code: see dispatch."""
        await self.disconnect(message["code"])
        raise StopConsumer()

    async def disconnect(self, code: int) -> None:
        if self.joining is not None and not self.joining.done():
            self.joining.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.joining
        self.joined()
        if self.poller is not None:
            self.poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.poller
        if self.node_id is not None:
            heartbeat_writer.detach(self)
            await heartbeat_writer.flush()  # what this node said last is written before it goes
            await self.leave_group()
            log.info("agent of node %s disconnected (%s)", self.node_name, code)

    async def join_group(self) -> None:
        """Join (or renew the membership of) the node's group; memberships expire unless renewed."""
        assert self.node_id is not None
        await self.channel_layer.group_add(actions.node_group(self.node_id), self.channel_name)

    async def leave_group(self) -> None:
        """Leave the node's group, trying again a few times: when thousands of agents drop together the
        layer may be slow to answer. A membership that still could not be removed expires on its own."""
        assert self.node_id is not None
        for wait in (0.0, 0.5, 2.0, 5.0):
            if wait:
                await asyncio.sleep(wait)
            try:
                await self.channel_layer.group_discard(actions.node_group(self.node_id), self.channel_name)
                return
            except Exception as exc:
                failure = exc
        log.warning(
            "could not leave the group of node %s (%s: %s); the membership will expire",
            self.node_name,
            type(failure).__name__,
            failure,
        )

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        raw = text_data if text_data is not None else bytes_data or b""
        if self.held is not None:  # still waiting to be taken in (join_in_turn)
            self.hold(raw)
            return
        if self.node_id is None:
            return
        await self.handle(raw)

    async def handle(self, raw: str | bytes) -> None:
        started = time.perf_counter()
        try:
            message = protocol.parse_message(raw, expect="agent")
        except protocol.ProtocolError as exc:
            PROTOCOL_ERRORS.labels(code=exc.code).inc()
            log.warning("node %s sent a bad message: %s: %s", self.node_name, exc.code, exc.message)
            await self.send(protocol.error_message(exc))
            return
        PROTOCOL_MESSAGES.labels(type=message.type).inc()
        try:
            await self.dispatch_message(message)
            MESSAGE_SECONDS.labels(type=message.type).observe(time.perf_counter() - started)
        except OSError as exc:
            # The agent went (uvicorn's ClientDisconnected is an OSError) while its message was being
            # answered: nothing to tell it, and nothing wrong here.
            log.info("node %s went while its %s was answered: %s", self.node_name, message.type, type(exc).__name__)
        except Exception:
            # A message that passes the schema but still breaks a service must not end the
            # connection: log it, tell the agent, go on.
            PROTOCOL_ERRORS.labels(code="server").inc()
            log.exception("handling %s from node %s failed", message.type, self.node_name)
            await self.send(
                protocol.error_message(
                    protocol.ProtocolError("server", f"the server could not handle this {message.type}"), message.id
                )
            )

    async def dispatch_message(self, message: protocol.Message) -> None:
        assert self.node_id is not None
        if message.type == "register":
            try:
                await self.register(message)
            finally:
                self.joined()
        elif message.type == "report":
            if "engines" in message.body:
                await database_sync_to_async(reports.record_engines, thread_sensitive=False)(
                    self.node_id, message.body["engines"]
                )
            await database_sync_to_async(reports.record_report, thread_sensitive=False)(
                self.node_id, message.body["shards"]
            )
        elif message.type == "heartbeat":
            sample = message.body["sample"]
            # The row (and the history point) are written behind, in a batch every second
            # (apps.cluster.heartbeats). GPU health rows are written only when a card's health changed.
            heartbeat_writer.add(self.node_id, sample)
            health = reports.sample_health(sample)
            if self.gpu_health is not None and health != self.gpu_health:
                await database_sync_to_async(reports.write_gpu_health, thread_sensitive=False)(
                    self.node_id, health, self.gpu_health
                )
            self.gpu_health = health
        elif message.type in EXTENSIONS.node_reports:  # the fabrics app's "fabrics"
            await database_sync_to_async(EXTENSIONS.record_report, thread_sensitive=False)(
                message.type, self.node_id, message.body
            )
        elif message.type == "response":
            request_id = str(message.body["request_id"])
            if request_id.startswith("doctor-"):
                await database_sync_to_async(reports.record_doctor, thread_sensitive=False)(self.node_id, message.body)
            elif request_id.startswith("req-"):
                await database_sync_to_async(agent_requests.record_response, thread_sensitive=False)(
                    self.node_id, message.body
                )
        elif message.type == "error":
            log.warning(
                "node %s reports an error: %s: %s",
                self.node_name,
                message.body.get("code"),
                message.body.get("message"),
            )
        else:
            log.info("node %s sent %s, which this server does not use yet", self.node_name, message.type)

    async def register(self, message: protocol.Message) -> None:
        assert self.node_id is not None
        client = self.scope.get("client") or (None, None)
        # One trip to a database thread for all of it, shared with the agents registering meanwhile:
        # with a fleet joining at once, each trip is a wait in the threads' queue.
        name, version, desired, requests = await _REGISTRATIONS((self.node_id, message.body, client[0]))
        self.gpu_health = reports.sample_health(message.body.get("sample") or protocol.HeartbeatSample())
        await self.send(
            protocol.encode(
                "registered",
                {"node": name, "heartbeat_interval": settings.AGENT_HEARTBEAT_INTERVAL},
                id=message.id,
            )
        )
        await self.send(protocol.encode("desired", desired))
        self.desired_sent = version
        for body in requests:
            await self.send(protocol.encode("request", body))

    async def poll_desired(self) -> None:
        while True:
            await asyncio.sleep(2)
            if self.node_id is None or self.desired_sent is None:
                continue
            try:
                version = await database_sync_to_async(enrolment.desired_version, thread_sensitive=False)(self.node_id)
                if version is not None and version != self.desired_sent:
                    await self.send_desired(version)
                if await database_sync_to_async(agent_requests.has_pending, thread_sensitive=False)(self.node_id):
                    await self.send_requests()
            except Exception:
                log.warning("could not check the desired state of node %s", self.node_name, exc_info=True)

    async def send_desired(self, version: int) -> None:
        assert self.node_id is not None
        node = await database_sync_to_async(Node.objects.get, thread_sensitive=False)(pk=self.node_id)
        body = await database_sync_to_async(desired_message, thread_sensitive=False)(node, version)
        await self.send(protocol.encode("desired", body))
        self.desired_sent = version

    async def send_requests(self) -> None:
        """Send the node's pending requests (each marked sent as it goes)."""
        assert self.node_id is not None
        for body in await database_sync_to_async(agent_requests.claim, thread_sensitive=False)(self.node_id):
            await self.send(protocol.encode("request", body))

    # Messages from the channel layer -------------------------------------------------------

    async def agent_request(self, event: dict[str, Any]) -> None:
        await self.send_requests()

    async def agent_replace(self, event: dict[str, Any]) -> None:
        if event.get("channel") != self.channel_name:
            await self.replaced()

    async def replaced(self) -> None:
        if self.closing:
            return
        self.closing = True
        with contextlib.suppress(Exception):
            await self.send(protocol.encode("replaced", {"message": "a newer connection of this node took over"}))
        await self.close(code=protocol.CLOSE_REPLACED, reason="replaced by a newer connection")

    async def agent_revoke(self, event: dict[str, Any]) -> None:
        await self.close(code=protocol.CLOSE_REVOKED, reason=f"node credential {event.get('reason', 'revoked')}")

    async def agent_send(self, event: dict[str, Any]) -> None:
        await self.send(event["text"])
