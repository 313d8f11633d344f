"""The simulator's tests: Celery's eager mode, so a run queued by the web goes through the
worker's task and its child process where the test is."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def eager(django_capture_on_commit_callbacks: Any) -> Iterator[Any]:
    """Celery runs the simulator's tasks where they are sent (its own eager mode), after the commit."""
    from llmgw.celery import app

    app.conf.task_always_eager = True
    try:
        yield django_capture_on_commit_callbacks
    finally:
        app.conf.task_always_eager = False
