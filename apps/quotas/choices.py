from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["Endpoint", "RollupPeriod", "UsageGroup"]


class Endpoint(models.TextChoices):
    """The client API a request came in through."""

    CHAT_COMPLETIONS = "chat.completions", _("Chat completions")
    COMPLETIONS = "completions", _("Completions")
    EMBEDDINGS = "embeddings", _("Embeddings")
    MESSAGES = "messages", _("Messages")
    RESPONSES = "responses", _("Responses")


class RollupPeriod(models.TextChoices):
    """How long one usage rollup bucket is."""

    MINUTE = "minute", _("Minute")
    HOUR = "hour", _("Hour")


class UsageGroup(models.TextChoices):
    """What usage can be summed by."""

    ORGANIZATION = "organization", _("Organisation")
    TEAM = "team", _("Team")
    PROJECT = "project", _("Project")
    KEY = "key", _("API key")
    MODEL = "model", _("Model")
    USER = "user", _("Person")
