from __future__ import annotations

from django.apps import AppConfig


class ThemeConfig(AppConfig):
    """The Tailwind build (static_src/) and its compiled stylesheet (static/css/dist/)."""

    name = "llmgw.theme"
    label = "theme"
