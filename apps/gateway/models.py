"""The version of what the gateway holds in memory, bumped whenever keys, limits or replicas change."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["TableVersion"]


class TableVersion(models.Model):
    """One row. Every gateway process polls it (one cheap query a second) and reloads its key
    and routing tables when it moved, whichever process made the change."""

    version = models.PositiveBigIntegerField(_("version"), default=0)

    class Meta:
        verbose_name = _("gateway table version")
        verbose_name_plural = _("gateway table versions")

    def __str__(self) -> str:
        return str(self.version)
