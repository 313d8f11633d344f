from __future__ import annotations

from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The console's shell: layout, landing page, sign-in, language switch."""

    name = "llmgw.console"
    label = "console"

    def ready(self) -> None:
        # Make the project's Celery app the current one, so .delay() in web processes uses
        # the configured broker.
        from llmgw import celery  # noqa: F401
