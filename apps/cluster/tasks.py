from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings

from apps.cluster import reports


@shared_task(ignore_result=True)
def mark_unreachable_nodes() -> int:
    grace = timedelta(seconds=settings.AGENT_HEARTBEAT_INTERVAL * settings.AGENT_MISSED_HEARTBEATS)
    return reports.mark_unreachable_nodes(grace)


@shared_task(ignore_result=True)
def reconcile() -> None:
    from apps.cluster.reconciler import reconcile as run

    report = run()
    if report.ran and (report.placed or report.stopping or report.released or report.preempted):
        import logging

        logging.getLogger(__name__).info(
            "reconciler: placed %s, stopping %s, released %s, preempted %s, pending %s",
            report.placed,
            report.stopping,
            report.released,
            report.preempted,
            report.pending,
        )


@shared_task(ignore_result=True)
def push_desired_state() -> None:
    from apps.cluster.reconciler import push_desired_state as push

    push()


@shared_task(ignore_result=True)
def accrue_held_time() -> int:
    """Count the GPU and core time every placed replica held since the last count (every minute)."""
    from apps.cluster.held import accrue_held_time as accrue

    return accrue()


@shared_task(ignore_result=True)
def fetch_engine_releases() -> None:
    from apps.cluster.engines import fetch_wanted_releases

    fetch_wanted_releases()


@shared_task(ignore_result=True)
def expire_agent_requests() -> int:
    from apps.cluster.agent_requests import expire

    return expire()


@shared_task(ignore_result=True)
def summarise_idle_cards() -> None:
    """The fleet's held idle replicas, worked out for the cluster page (apps.cluster.overview)."""
    from apps.cluster.overview import summarise_idle

    summarise_idle(keep=True)
