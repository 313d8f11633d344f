"""The Celery beat scheduler of every llmgw process that schedules (`llmgw beat`, and a worker's
embedded beat): Celery's own, sending only while it holds the lease of apps/schedule/lease.py and
only tasks whose interval has passed whichever scheduler sent them last.

Set as `CELERY_BEAT_SCHEDULER`. Its schedule lives in memory and in the database (`PeriodicRun`),
so it needs no schedule file.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import time
from typing import Any

from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import schedule as every
from django.db import DatabaseError, connection

from apps.schedule import lease

__all__ = ["LeasedScheduler"]

log = logging.getLogger(__name__)


class LeasedScheduler(Scheduler):
    """Celery's in-memory scheduler, acting only while it holds the lease."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.holder = f"{socket.gethostname()[:120]}:{os.getpid()}:{secrets.token_hex(3)}"
        self.acting = False
        self._asked = False
        self._next_ask = 0.0
        super().__init__(*args, **kwargs)

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Ask for the lease when it is time; while not acting, only wait for the next ask."""
        if time.monotonic() >= self._next_ask:
            self._ask()
            self._next_ask = time.monotonic() + lease.renew_every()
        until_ask = max(0.0, self._next_ask - time.monotonic())
        if not self.acting:
            return max(until_ask, 0.05)
        return float(min(super().tick(*args, **kwargs), until_ask))

    def _ask(self) -> None:
        was = self.acting
        try:
            self.acting = lease.hold(self.holder)
        except DatabaseError as exc:
            self.acting = False
            connection.close()  # the next ask connects afresh
            log.warning("scheduler %s: cannot reach the database to hold the lease: %s", self.holder, exc)
        if self.acting != was or not self._asked:
            self._asked = True
            log.warning(
                "scheduler %s: %s", self.holder, "acting" if self.acting else "standing by (another scheduler acts)"
            )

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        """Send a due task only while acting, and only once its interval has passed since any
        scheduler sent it."""
        if not self.acting:
            return
        interval = entry.schedule.run_every.total_seconds() if isinstance(entry.schedule, every) else None
        try:
            allowed = lease.claim_run(entry.name, interval, self.holder)
        except DatabaseError as exc:
            log.warning("scheduler %s: %s not sent: the database is away: %s", self.holder, entry.name, exc)
            return
        if allowed:
            super().apply_entry(entry, producer)

    def close(self) -> None:
        if self.acting:
            with contextlib.suppress(DatabaseError):  # else it expires by itself
                lease.release(self.holder)
            self.acting = False
        super().close()
