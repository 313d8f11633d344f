from __future__ import annotations

from django.apps import AppConfig


class FabricsConfig(AppConfig):
    name = "apps.fabrics"
    label = "fabrics"
