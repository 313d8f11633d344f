from __future__ import annotations

from django.apps import AppConfig


class FacilityConfig(AppConfig):
    name = "apps.facility"
    label = "facility"
