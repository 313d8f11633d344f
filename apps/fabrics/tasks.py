from __future__ import annotations

from celery import shared_task


@shared_task(ignore_result=True)
def map_fabrics() -> int:
    from apps.fabrics.maps import map_fabrics as run

    return len(run())


@shared_task(ignore_result=True)
def run_fabric_test(test_id: int) -> None:
    from apps.fabrics.perf import run_test

    run_test(test_id)
