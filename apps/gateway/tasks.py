"""The gateway's Celery tasks: thin wrappers over its services."""

from __future__ import annotations

from celery import shared_task

__all__ = ["delete_expired_responses"]

#: Stored responses removed per run; a full batch queues the next run at once.
BATCH = 1000


@shared_task(ignore_result=True)  # type: ignore[untyped-decorator]  # celery ships no types
def delete_expired_responses() -> int:
    """Remove stored Responses API answers past their retention, a bounded batch at a time."""
    from apps.gateway.response_store import delete_expired

    deleted = delete_expired(BATCH)
    if deleted == BATCH:
        delete_expired_responses.delay()
    return deleted
