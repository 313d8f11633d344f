from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(ignore_result=True, acks_late=True)
def write_usage(records: list[dict[str, Any]]) -> int:
    """Write a batch of usage records sent by a gateway (idempotent by request id)."""
    from apps.quotas.usage import write_records_sync

    return write_records_sync(records)
