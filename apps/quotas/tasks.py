from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db import InterfaceError, OperationalError


# A database that went away (restarting, failing over, cut off) is waited for: the batch is tried
# again with a backoff up to a minute, for about a quarter of an hour. Should it still fail, the web
# process that handed it over writes what it finds missing when it checks the batch.
@shared_task(
    ignore_result=True,
    acks_late=True,
    autoretry_for=(OperationalError, InterfaceError),
    retry_backoff=2,
    retry_backoff_max=60,
    retry_jitter=True,
    max_retries=20,
)
def write_usage(records: list[dict[str, Any]]) -> int:
    """Write a batch of usage records sent by a gateway (idempotent by request id); each arrives as
    a JSON object, read as apps.quotas.records.UsageRecordDict."""
    from apps.quotas.records import from_json
    from apps.quotas.usage import write_records_sync

    return write_records_sync([from_json(record) for record in records])


@shared_task(ignore_result=True)
def settle_usage_journals() -> int:
    """Write the journaled usage records of web processes on this host that died and were not
    started again (apps/quotas/journal.py); those of living processes are theirs to settle."""
    from django.conf import settings

    from apps.quotas.journal import settle_orphans
    from apps.quotas.usage import write_missing

    return settle_orphans(settings.DATA_DIR / "usage-journal", write_missing)
