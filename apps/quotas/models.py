"""Limits: how much of the cluster an organisation, team or project may hold."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import Organization, Project, Team

__all__ = ["CapacityQuota"]


class CapacityQuota(models.Model):
    """The most GPUs, cores, memory and replicas one branch's models may hold at once.

    A limit left empty is no limit. Placement refuses a replica that would pass any limit
    of any branch above it.
    """

    organization = models.OneToOneField(Organization, on_delete=models.CASCADE, null=True, blank=True,
                                        related_name="capacity_quota", verbose_name=_("organisation"))
    team = models.OneToOneField(Team, on_delete=models.CASCADE, null=True, blank=True,
                                related_name="capacity_quota", verbose_name=_("team"))
    project = models.OneToOneField(Project, on_delete=models.CASCADE, null=True, blank=True,
                                   related_name="capacity_quota", verbose_name=_("project"))
    gpus = models.PositiveIntegerField(_("GPUs"), null=True, blank=True)
    cpu_cores = models.FloatField(_("CPU cores"), null=True, blank=True)
    memory_bytes = models.BigIntegerField(_("memory (bytes)"), null=True, blank=True)
    replicas = models.PositiveIntegerField(_("replicas"), null=True, blank=True)

    class Meta:
        verbose_name = _("capacity quota")
        verbose_name_plural = _("capacity quotas")
        constraints = [
            models.CheckConstraint(
                condition=(Q(organization__isnull=False, team__isnull=True, project__isnull=True)
                           | Q(organization__isnull=True, team__isnull=False, project__isnull=True)
                           | Q(organization__isnull=True, team__isnull=True, project__isnull=False)),
                name="%(app_label)s_%(class)s_exactly_one_owner",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.owner}"

    @property
    def owner(self) -> Organization | Team | Project:
        return self.organization or self.team or self.project  # type: ignore[return-value]

    @property
    def owner_key(self) -> str:
        if self.organization_id:
            return f"org:{self.organization_id}"
        if self.team_id:
            return f"team:{self.team_id}"
        return f"project:{self.project_id}"

    def clean(self) -> None:
        if sum(x is not None for x in (self.organization_id, self.team_id, self.project_id)) != 1:
            raise ValidationError(_("A capacity quota belongs to exactly one organisation, team or project."))
