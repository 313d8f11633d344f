from __future__ import annotations

from datetime import timedelta

from celery import shared_task
from django.conf import settings

from apps.cluster import services


@shared_task(ignore_result=True)
def mark_unreachable_nodes() -> int:
    grace = timedelta(seconds=settings.AGENT_HEARTBEAT_INTERVAL * settings.AGENT_MISSED_HEARTBEATS)
    return services.mark_unreachable_nodes(grace)
