"""Write-behind for heartbeats, and the checks that keep this process's agent connections honest.

Samples are kept per node (a newer one replaces an older one not yet written) and written
every second in one bulk UPDATE from a worker thread, so a slow moment of the database
(a checkpoint, a vacuum) delays the figures by a second or two instead of holding up
every agent connection of the process. At most one row write per heartbeat, and fewer
when a node sends two within a second. A crash loses at most the last second of samples,
which the next heartbeats replace anyway.

A batch the database refuses is written again row by row, and a row that still fails is
dropped, logged and counted (llmgw_heartbeats_dropped_total): one node's bad sample never
holds up another's, and never comes back to fail again.

Every SWEEP_SECONDS the connections of this process are checked against their nodes' rows,
the second path for what the channel layer may not deliver: a connection whose node has a
newer one elsewhere is told it was replaced and closed, one whose node was revoked is closed
as revoked, one whose shard list changed gets it. Every RENEW_SECONDS each connection renews
its group membership, which otherwise expires (so a member whose discard failed is forgotten).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from django.utils import timezone
from prometheus_client import Counter

from agent.messages import HeartbeatSample

__all__ = ["HeartbeatWriter", "writer"]

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
SWEEP_SECONDS = 10.0
RENEW_SECONDS = 300.0

DROPPED = Counter("llmgw_heartbeats_dropped", "Heartbeat samples the database refused, dropped")


class HeartbeatWriter:
    def __init__(self) -> None:
        self._pending: dict[int, tuple[HeartbeatSample, Any]] = {}
        # The newest agent connection of each node in this process: a changed shard list reaches its
        # node even when no channel layer message does.
        self.connections: dict[int, Any] = {}
        self.live: set[Any] = set()  # every agent connection of this process, replaced ones too
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, consumer: Any) -> None:
        self.connections[consumer.node_id] = consumer
        self.live.add(consumer)
        self._ensure_running()

    def detach(self, consumer: Any) -> None:
        self.live.discard(consumer)
        node_id = consumer.node_id
        if self.connections.get(node_id) is consumer:
            del self.connections[node_id]

    def add(self, node_id: int, sample: HeartbeatSample) -> None:
        self._pending[node_id] = (sample, timezone.now())
        self._ensure_running()

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._task = loop.create_task(self._run(), name="heartbeat-writer")

    async def _run(self) -> None:
        ticks = 0
        while self._pending or self.live:
            await asyncio.sleep(FLUSH_SECONDS)
            ticks += 1
            try:
                await self.flush()
                if ticks % round(SWEEP_SECONDS / FLUSH_SECONDS) == 0:
                    await self.sweep()
                if ticks % round(RENEW_SECONDS / FLUSH_SECONDS) == 0:
                    await self.renew_groups()
            except Exception:
                log.warning("the heartbeat writer's pass failed; the next one tries again", exc_info=True)

    async def flush(self) -> None:
        from channels.db import database_sync_to_async

        batch, self._pending = self._pending, {}
        if not batch:
            return
        try:
            versions = await database_sync_to_async(_write, thread_sensitive=False)(batch)
        except Exception:
            log.warning(
                "could not write %s heartbeats in one batch; writing them one by one", len(batch), exc_info=True
            )
            versions = await database_sync_to_async(_write_each, thread_sensitive=False)(batch)
        for node_id, version in versions.items():
            connection = self.connections.get(node_id)
            if connection is not None and connection.desired_sent is not None and version != connection.desired_sent:
                asyncio.get_running_loop().create_task(connection.send_desired(version))

    async def sweep(self) -> None:
        """Close connections replaced elsewhere or revoked, and push changed shard lists."""
        from channels.db import database_sync_to_async

        from agent import protocol

        consumers = [c for c in self.live if c.node_id is not None]
        if not consumers:
            return
        rows = await database_sync_to_async(_node_rows, thread_sensitive=False)({c.node_id for c in consumers})
        for consumer in consumers:
            row = rows.get(consumer.node_id)
            if row is None or row["revoked"]:
                await consumer.close(code=protocol.CLOSE_REVOKED, reason="node credential revoked")
            elif row["connection"] and row["connection"] != consumer.channel_name:
                await consumer.replaced()
            elif consumer.desired_sent is not None and row["version"] != consumer.desired_sent:
                asyncio.get_running_loop().create_task(consumer.send_desired(row["version"]))

    async def renew_groups(self) -> None:
        for consumer in list(self.live):
            with contextlib.suppress(Exception):
                await consumer.join_group()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.flush()


def _write(batch: dict[int, tuple[HeartbeatSample, Any]]) -> dict[int, int]:
    from apps.cluster.reports import write_heartbeats

    return write_heartbeats(batch)


def _write_each(batch: dict[int, tuple[HeartbeatSample, Any]]) -> dict[int, int]:
    """Write a refused batch row by row; a row the database still refuses is dropped, not kept."""
    from django.db import close_old_connections

    versions: dict[int, int] = {}
    failures: list[str] = []
    for node_id, item in sorted(batch.items()):
        try:
            versions.update(_write({node_id: item}))
        except Exception as exc:
            close_old_connections()
            DROPPED.inc()
            failures.append(f"node {node_id}: {type(exc).__name__}: {str(exc)[:200]}")
    if failures:
        log.warning("dropped %s heartbeat sample(s) the database refused: %s", len(failures), "; ".join(failures[:5]))
    return versions


def _node_rows(node_ids: set[int]) -> dict[int, dict[str, Any]]:
    from apps.cluster.models import Node

    return {
        pk: {"version": version, "connection": connection, "revoked": revoked is not None}
        for pk, version, connection, revoked in Node.objects.filter(pk__in=node_ids).values_list(
            "pk", "desired_version", "connection", "revoked_at"
        )
    }


writer = HeartbeatWriter()
