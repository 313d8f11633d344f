from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["NodeStatus"]


class NodeStatus(models.TextChoices):
    PENDING = "pending", _("waiting for its agent")
    READY = "ready", _("ready")
    UNREACHABLE = "unreachable", _("unreachable")
    REVOKED = "revoked", _("revoked")
