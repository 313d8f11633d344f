from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class MirrorConfig(AppConfig):
    name = "apps.mirror"
    label = "mirror"
    verbose_name = _("Model mirror")

    def ready(self) -> None:
        from django.db.models.signals import post_save

        from apps.catalog.models import Model
        from apps.cluster.extensions import EXTENSIONS
        from apps.mirror import lora, placement, services

        post_save.connect(_model_saved, sender=Model, dispatch_uid="mirror-model-saved")
        placement.register()
        EXTENSIONS.mirror_fetches = services.node_fetches
        EXTENSIONS.add_model_panel("adapters", lora.adapters_panel)
        EXTENSIONS.add_model_panel("held_adapters", lora.held_adapters_panel)


def _model_saved(sender: object, instance: object, **kwargs: object) -> None:
    """A model whose source is in the mirror: the nodes hear at once what to fetch for it."""
    from django.conf import settings
    from django.db import transaction

    source = str(getattr(instance, "source", "") or "")
    if source.startswith(settings.MIRROR_NODE_DIR + "/"):
        from apps.mirror.services import tell_nodes

        transaction.on_commit(tell_nodes)
