"""The Celery application: Redis when LLMGW_REDIS_URL is set, else kombu's filesystem transport."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")

app = Celery("llmgw")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def ensure_queue_folders() -> None:
    """The filesystem transport needs its folders to exist before the first message."""
    from django.conf import settings

    options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
    for key in ("data_folder_in", "data_folder_out", "control_folder"):
        folder = options.get(key)
        if isinstance(folder, str):
            os.makedirs(folder, exist_ok=True)
