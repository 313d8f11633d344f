"""Holds on parts of the facility: nothing new is placed in a held site, room, row, rack or PDU."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from apps.facility.locations import LEVELS


class Hold(models.Model):
    """A domain (`level`=`name`, e.g. rack=r12) placement keeps new replicas out of while it is active
    (not released). Replicas already in it keep running, unless `drain`: then they are moved out as
    a node drain moves them (each replaced elsewhere first, the model's minimum kept), until it ends."""

    level = models.CharField(_("level"), max_length=8, choices=[(level, level) for level in LEVELS])
    name = models.CharField(_("name"), max_length=100)
    drain = models.BooleanField(_("drain"), default=False)
    reason = models.CharField(_("reason"), max_length=500, blank=True)
    created_at = models.DateTimeField(_("held"), auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    released_at = models.DateTimeField(_("released"), null=True, blank=True)
    released_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        verbose_name = _("hold")
        verbose_name_plural = _("holds")
        ordering = ["-created_at", "-pk"]
        constraints = [
            models.UniqueConstraint(
                fields=["level", "name"], condition=Q(released_at__isnull=True), name="facility_one_active_hold"
            )
        ]

    def __str__(self) -> str:
        return f"{self.level}={self.name}"

    @property
    def domain(self) -> str:
        return f"{self.level}={self.name}"
