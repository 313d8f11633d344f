"""What the chat page offers: the models a person may talk to, and where each runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.db.models import Prefetch
from django.utils.translation import gettext as _

from apps.catalog.models import Model
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Replica

__all__ = ["ChatModel", "chat_models", "hardware_label"]


def hardware_label(hardware: str) -> str:
    """How the page names an accelerator: the GPU class as it is, "CPU", or "external provider"."""
    if hardware.lower() == "cpu":
        return _("CPU")
    if hardware.lower() == "external":
        return _("external provider")
    return hardware


@dataclass(frozen=True)
class ChatModel:
    """One choice of the chat page's picker."""

    name: str
    # Where it answers now (the accelerators of its ready replicas), else where it can run.
    hardware: list[str]
    ready: bool

    @property
    def where(self) -> str:
        return ", ".join(hardware_label(h) for h in self.hardware) or "-"

    @property
    def label(self) -> str:
        if self.ready:
            return _("%(model)s · %(where)s") % {"model": self.name, "where": self.where}
        return _("%(model)s · %(where)s, not running now") % {"model": self.name, "where": self.where}


def _ordered(values: list[str]) -> list[str]:
    """GPU classes first (by name), then CPU, then an external provider."""
    rank = {"cpu": 1, "external": 2}
    return sorted(set(values), key=lambda h: (rank.get(h.lower(), 0), h.lower()))


def chat_models(user: Any) -> list[ChatModel]:
    """Every model the person's chat key may use, each with the hardware that would answer.

    The chat page's key allows every model (as a key its owner makes on the keys page may), so
    this is every model of the catalogue. A model with ready replicas names their accelerators
    (a GPU class, or CPU); one with none names its profiles' and says it is not running now; an
    external one is served by its provider.
    """
    ready = Replica.objects.filter(state=ReplicaState.READY).select_related("profile")
    models = Model.objects.live().order_by("name").prefetch_related("profiles", Prefetch("replicas", queryset=ready))
    choices = []
    for model in models:
        running = [r.profile.accelerator for r in model.replicas.all() if r.profile is not None]
        if model.is_external:
            running.append("external")
        if running:
            choices.append(ChatModel(name=model.name, hardware=_ordered(running), ready=True))
        else:
            possible = [p.accelerator for p in model.profiles.all()]
            choices.append(ChatModel(name=model.name, hardware=_ordered(possible), ready=False))
    return choices
