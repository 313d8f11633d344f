"""Readiness checks: each service answers "ok" or says what went wrong."""

from __future__ import annotations

import asyncio
import uuid

from asgiref.sync import async_to_sync
from django.conf import settings
from django.db import connection

from llmgw import redis_client

__all__ = ["check_broker", "check_channel_layer", "check_database", "run_checks", "scheduler"]


def _error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:300]


def check_database(*, direct: bool = False) -> str:
    """ "ok", or what went wrong. `direct`: on PostgreSQL, one connection of its own with a short
    timeout rather than one from the pool (which keeps trying for its whole wait, 30 s, and logs
    each try): what a process asks before it starts."""
    if direct and connection.vendor == "postgresql":
        import psycopg

        params = {k: v for k, v in connection.get_connection_params().items() if k not in ("pool", "cursor_factory")}
        params["connect_timeout"] = 3
        try:
            psycopg.connect(**params).close()
        except Exception as exc:
            return _error(exc)
        return "ok"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:
        return _error(exc)
    return "ok"


def check_broker() -> str:
    if settings.REDIS_URL:
        try:
            # A connection of its own, not one the process's cached client already holds.
            client = redis_client.fresh(timeout=2.0)
            client.ping()
            client.close()
        except Exception as exc:
            return _error(exc)
        return "ok"
    folder = settings.CELERY_QUEUE_DIR / "messages"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return _error(exc)
    return "ok"


def check_channel_layer() -> str:
    from channels.layers import get_channel_layer

    try:
        layer = get_channel_layer()
        if layer is None:
            return "not configured"

        async def roundtrip() -> None:
            channel = await layer.new_channel()
            await layer.send(channel, {"type": "readiness.probe"})
            await asyncio.wait_for(layer.receive(channel), timeout=2)

        async_to_sync(roundtrip)()
    except Exception as exc:
        return _error(exc)
    return "ok"


def run_checks() -> dict[str, str]:
    return {"database": check_database(), "broker": check_broker(), "channel_layer": check_channel_layer()}


def scheduler() -> dict[str, str | None]:
    """Which scheduler acts (host:pid, since when, last renewed), all null when none does; with
    `error` when the database cannot tell. Not part of a web process's readiness: a missing
    scheduler stops periodic work, not the serving of requests."""
    from apps.schedule.lease import acting

    try:
        now = acting()
    except Exception as exc:
        return {"acting": None, "since": None, "renewed_at": None, "error": _error(exc)}
    if now is None:
        return {"acting": None, "since": None, "renewed_at": None}
    return {
        "acting": f"{now.host}:{now.pid}",
        "since": now.since.isoformat(),
        "renewed_at": now.renewed_at.isoformat(),
    }
