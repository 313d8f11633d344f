from __future__ import annotations

from celery import shared_task


@shared_task(ignore_result=True, acks_late=False)
def fetch_mirror_file(pk: int) -> None:
    """Download one mirrored file (resumable), then start the next queued ones."""
    from apps.mirror.services import fetch_one

    fetch_one(pk)


@shared_task(ignore_result=True)
def start_mirror_fetches() -> None:
    """Start what waits in the mirror's queue (also after a worker restart left files downloading)."""
    from apps.mirror.services import resume_interrupted, start_fetches

    resume_interrupted()
    start_fetches()
