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


class Budget(models.Model):
    """A power cap on a domain (rack=r12, pdu=r12-a, row=3), from server.yaml's facility.budgets or
    the API. `feeds`: the circuits feeding it, each [{"name": "A", "watts": 17300}]; an A/B-fed
    (`redundant`) domain's budget is one feed, since either must carry it alone, not their sum."""

    level = models.CharField(_("level"), max_length=8, choices=[(level, level) for level in LEVELS])
    name = models.CharField(_("name"), max_length=100)
    watts = models.PositiveIntegerField(_("cap (W)"), null=True, blank=True)
    feeds = models.JSONField(_("feeds"), default=list, blank=True)
    redundant = models.BooleanField(_("A/B fed"), default=False)
    source = models.CharField(_("source"), max_length=16, default="api")
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        verbose_name = _("power budget")
        verbose_name_plural = _("power budgets")
        ordering = ["level", "name"]
        constraints = [models.UniqueConstraint(fields=["level", "name"], name="facility_one_budget_per_domain")]

    def __str__(self) -> str:
        return f"{self.level}={self.name}"

    @property
    def domain(self) -> str:
        return f"{self.level}={self.name}"

    @property
    def cap_watts(self) -> int | None:
        """What the domain may draw: one feed when A/B fed (the smallest), all of them otherwise."""
        feeds = [int(f["watts"]) for f in self.feeds or [] if isinstance(f, dict) and isinstance(f.get("watts"), int)]
        if feeds:
            return min(feeds) if self.redundant else sum(feeds)
        return self.watts
