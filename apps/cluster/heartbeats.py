"""Write-behind for heartbeats: the agent connection hands its sample over and goes on.

Samples are kept per node (a newer one replaces an older one not yet written) and written
every second in one bulk UPDATE from a worker thread, so a slow moment of the database
(a checkpoint, a vacuum) delays the figures by a second or two instead of holding up
every agent connection of the process. At most one row write per heartbeat, and fewer
when a node sends two within a second. A crash loses at most the last second of samples,
which the next heartbeats replace anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from django.utils import timezone

__all__ = ["HeartbeatWriter", "writer"]

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0


class HeartbeatWriter:
    def __init__(self) -> None:
        self._pending: dict[int, tuple[dict[str, Any], Any]] = {}
        # The agent connections of this process, so a changed shard list reaches its node even when no
        # channel layer message does: each flush reads the desired-state versions of the nodes it wrote.
        self.connections: dict[int, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, node_id: int, sample: dict[str, Any]) -> None:
        self._pending[node_id] = (sample, timezone.now())
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._loop is not loop:
            self._loop = loop
            self._task = loop.create_task(self._run(), name="heartbeat-writer")

    async def _run(self) -> None:
        while self._pending:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush()

    async def flush(self) -> None:
        from channels.db import database_sync_to_async

        batch, self._pending = self._pending, {}
        if not batch:
            return
        try:
            versions = await database_sync_to_async(_write, thread_sensitive=False)(batch)
        except Exception:
            log.warning("could not write %s heartbeats; they go with the next batch", len(batch), exc_info=True)
            for node_id, item in batch.items():
                self._pending.setdefault(node_id, item)
            return
        for node_id, version in versions.items():
            connection = self.connections.get(node_id)
            if connection is not None and connection.desired_sent is not None and version != connection.desired_sent:
                asyncio.get_running_loop().create_task(connection.send_desired(version))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self.flush()


def _write(batch: dict[int, tuple[dict[str, Any], Any]]) -> dict[int, int]:
    from apps.cluster.models import Node
    from apps.cluster.services import record_heartbeats

    record_heartbeats(batch)
    return dict(Node.objects.filter(pk__in=list(batch)).values_list("pk", "desired_version"))


writer = HeartbeatWriter()
