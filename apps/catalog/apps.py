from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class CatalogConfig(AppConfig):
    name = "apps.catalog"
    label = "catalog"
    verbose_name = _("Model catalogue")

    def ready(self) -> None:
        from apps.accounts.extensions import EXTENSIONS
        from apps.catalog import branches

        EXTENSIONS.add_branch_dependent("models", branches.count_models, branches.models_phrase)
        EXTENSIONS.live_models = branches.live_models
