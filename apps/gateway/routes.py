"""The gateway's tables in memory: read from the database in a thread when the table version moves
(announced through Redis, or seen by the version check every LLMGW_GATEWAY_REFRESH_SECONDS) and
every LLMGW_GATEWAY_RELOAD_SECONDS whatever it says; a key or model they lack is checked against
the version before it is refused. The replicas they list as stopping are remembered for a while
after they leave, so a request one of them held can still be told why it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from apps.gateway.slots import SlotKeeper
from apps.gateway.tables import Stopped, Tables, Upstream, current_version, load_tables

__all__ = ["Routes"]

log = logging.getLogger("llmgw.gateway")

# A key or model the tables do not know is checked against the database's table version before
# it is refused, at most this often (so a flood of wrong keys costs one small query per interval).
MISS_RECHECK_S = 0.1
# How long a replica seen stopping is remembered after it left the tables (its engine gone and its
# row released), so that a request it held is still told why it ended.
STOPPED_MEMORY_S = 600.0


async def _in_thread[T](func: Callable[[], T]) -> T:
    """func in an executor thread, whose database connection then goes back to the pool: a thread
    of the executor keeps its own otherwise, and a few of them held every connection of a web
    process's pool (LLMGW_DATABASE_POOL_SIZE) while agents' reports waited for one."""
    from asgiref.sync import sync_to_async

    def run() -> T:
        from django.db import close_old_connections

        try:
            return func()
        finally:
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


class Routes:
    """The current tables, and keeping them current. `changed()` is called after each reload
    (requests waiting for a slot look again: new replicas may serve them)."""

    def __init__(self, keeper: SlotKeeper, changed: Callable[[], None], *, refresh_s: float, reload_s: float) -> None:
        self.tables = Tables()
        self.keeper = keeper
        self.changed = changed
        self.refresh_s = refresh_s
        self.reload_s = reload_s
        self._lock = asyncio.Lock()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._miss_check: asyncio.Task[None] | None = None
        self._miss_checked_at = -math.inf
        self._stopped: dict[str, tuple[Stopped, float]] = {}

    async def start(self) -> None:
        self.use(await _in_thread(load_tables))
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()

    def stop(self) -> None:
        self._loop = None

    def use(self, tables: Tables) -> None:
        """Route by these tables from now on, and remember the replicas they list as stopping."""
        self.keeper.bind(tables)
        self.tables = tables
        now = time.monotonic()
        for replica_id, stopped in tables.stopping.items():
            self._stopped[replica_id] = (stopped, now)
        for replica_id, (_stopped, seen) in list(self._stopped.items()):
            if now - seen > STOPPED_MEMORY_S:
                del self._stopped[replica_id]

    def stopped(self, upstream: Upstream | None) -> str | None:
        """Why a request to this upstream was cut off, when its replica was stopped under it."""
        if upstream is None:
            return None
        seen = self._stopped.get(upstream.id)
        return seen[0].message() if seen is not None else None

    def knows(self, model: str) -> bool:
        return model in self.tables.models

    # Changes ------------------------------------------------------------------------------------

    def wake(self) -> None:
        """The tables changed (a key revoked, a model deleted): read them now."""
        if self._wake is not None:
            self._wake.set()

    def wake_from_thread(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.wake)

    async def refresh_loop(self) -> None:
        last_full = time.monotonic()
        while True:
            wake = self._wake
            if wake is None:
                await asyncio.sleep(self.refresh_s)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.refresh_s)
            try:
                await self.reload_announced()
                version = await _in_thread(current_version)
                if version != self.tables.version or time.monotonic() - last_full > self.reload_s:
                    await self.reload()
                    last_full = time.monotonic()
            except Exception:
                log.warning("could not refresh the gateway's tables", exc_info=True)

    async def reload(self) -> None:
        async with self._lock:
            self.use(await _in_thread(load_tables))
        self.changed()

    async def reload_announced(self) -> None:
        """Read the tables now if a change was announced and no reload has read it yet."""
        wake = self._wake
        if wake is None or not wake.is_set():
            return
        async with self._lock:
            if not wake.is_set():
                return  # another request (or the refresh loop) just read them
            wake.clear()
            self.use(await _in_thread(load_tables))
        self.changed()

    async def confirm_miss(self) -> None:
        """Before a key or model the tables lack is refused: if the database has moved on since the
        tables were read (a key made, a model applied a moment ago), read them again now rather than
        at the next refresh. Requests that miss together wait on one check."""
        task = self._miss_check
        if task is None:
            if time.monotonic() - self._miss_checked_at < MISS_RECHECK_S:
                return
            task = self._miss_check = asyncio.create_task(self._check_version())
        await asyncio.shield(task)

    async def _check_version(self) -> None:
        try:
            if await _in_thread(current_version) != self.tables.version:
                await self.reload()
        except Exception:
            log.warning("could not check the gateway's tables after a miss", exc_info=True)
        finally:
            self._miss_checked_at = time.monotonic()
            self._miss_check = None
