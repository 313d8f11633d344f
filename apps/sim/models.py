"""Simulations asked from the console and the API: each is a row the worker runs and fills in."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

__all__ = ["SimRun"]


class SimRun(models.Model):
    """One simulation: a scenario (or a what-if question of the live fleet), queued by the web,
    run by the worker in a child process held to a memory and a time budget, and its report or
    why it failed. Removed SIM_KEEP_SECONDS after it was asked."""

    class State(models.TextChoices):
        QUEUED = "queued", _("queued")
        RUNNING = "running", _("running")
        DONE = "done", _("done")
        FAILED = "failed", _("failed")

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sim_runs")
    state = models.CharField(_("state"), max_length=16, choices=State.choices, default=State.QUEUED)
    title = models.CharField(_("title"), max_length=300, blank=True)  # a what-if's question, in words
    scenario = models.TextField(_("scenario"), blank=True)  # the YAML text as given
    document = models.JSONField(_("scenario as a mapping"), null=True, blank=True)  # given as a mapping instead
    language = models.CharField(_("language"), max_length=16, blank=True)  # the report's words
    report = models.JSONField(_("report"), null=True, blank=True)
    problems = models.JSONField(_("problems"), default=list, blank=True)  # what the run found wrong with it
    error = models.TextField(_("error"), blank=True)  # why it failed otherwise (a budget passed ...)
    created_at = models.DateTimeField(_("asked"), default=timezone.now, db_index=True)
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("simulation")
        verbose_name_plural = _("simulations")
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["state", "created_at"], name="sim_run_state_created")]

    def __str__(self) -> str:
        return f"simulation {self.pk} ({self.state})"

    @property
    def finished(self) -> bool:
        return self.state in (self.State.DONE, self.State.FAILED)
