"""The batches' Celery task: a thin wrapper over apps.batches.services.sweep."""

from __future__ import annotations

import os
import socket

from celery import shared_task

__all__ = ["sweep_batches"]


@shared_task(ignore_result=True)
def sweep_batches() -> dict[str, int]:
    """Expire batches past their 24 h window (even with no web process running lines), remove files
    past their expiry and temporary files left by processes that died mid-write."""
    from apps.batches.services import sweep

    return sweep(f"worker:{socket.gethostname()[:60]}:{os.getpid()}")
