from __future__ import annotations

from celery import shared_task


@shared_task(ignore_result=True)
def map_fabrics() -> int:
    from apps.fabrics.maps import map_fabrics as run

    return len(run())
