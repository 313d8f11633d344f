from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["NodeStatus", "ReplicaState", "ShardState"]


class NodeStatus(models.TextChoices):
    PENDING = "pending", _("waiting for its agent")
    READY = "ready", _("ready")
    UNREACHABLE = "unreachable", _("unreachable")
    REVOKED = "revoked", _("revoked")


class ReplicaState(models.TextChoices):
    PENDING = "pending", _("pending")  # wanted, not placed (its reasons are kept)
    STARTING = "starting", _("starting")  # placed, engines starting
    READY = "ready", _("ready")
    FAILED = "failed", _("failed")  # an engine failed; retried with backoff
    STOPPING = "stopping", _("stopping")  # draining; its claims are held until every shard stopped


class ShardState(models.TextChoices):
    ASSIGNED = "assigned", _("assigned")  # desired on the node, nothing reported yet
    STARTING = "starting", _("starting")
    READY = "ready", _("ready")
    FAILED = "failed", _("failed")
    STOPPED = "stopped", _("stopped")
