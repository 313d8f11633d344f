from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["Band", "MembershipRole", "StaffRole"]


class StaffRole(models.TextChoices):
    """What a person may do across the whole installation (not within a team)."""

    NONE = "", _("None")
    ADMIN = "admin", _("Administrator")
    OPERATOR = "operator", _("Operator")
    VIEWER = "viewer", _("Viewer")
    BILLING = "billing", _("Billing")


class MembershipRole(models.TextChoices):
    """What a person may do inside one organisation, team or project."""

    MANAGER = "manager", _("Manager")
    MEMBER = "member", _("Member")


class Band(models.TextChoices):
    """The priority bands of the gateway's queues (apps.gateway.fairness): interactive requests take
    a model's free slots before batch ones, which get one grant in ten while they wait."""

    INTERACTIVE = "interactive", _("interactive")
    BATCH = "batch", _("batch")
