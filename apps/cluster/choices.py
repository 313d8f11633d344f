from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["NodeStatus", "ReplicaState", "ShardState", "StopReason"]


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
    # Its replica is stopping: no new request reaches it, and its engine runs on for those in flight.
    DRAINING = "draining", _("draining")
    FAILED = "failed", _("failed")
    STOPPED = "stopped", _("stopped")


class StopReason(models.TextChoices):
    """Why a replica was stopped: said on its card and in the error a request it still held gets."""

    ROLLED = "rolled", _("a profile change replaced it")
    DRAINED = "drained", _("its node is being drained")
    SCALED_DOWN = "scaled_down", _("the model was scaled down")
    DELETED = "deleted", _("the model was deleted")
    PREEMPTED = "preempted", _("a model of a higher class needed its room")
