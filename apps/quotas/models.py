"""Limits and usage: how much of the cluster a branch may hold, how fast it may call models,
and what every request through the gateway used."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import ApiKey, Organization, Project, Team
from apps.quotas.choices import Endpoint, RollupPeriod

__all__ = ["CapacityQuota", "RateLimit", "UsageRecord", "UsageRollup"]


class CapacityQuota(models.Model):
    """The most GPUs, cores, memory and replicas one branch's models may hold at once.

    A limit left empty is no limit. Placement refuses a replica that would pass any limit
    of any branch above it.
    """

    organization = models.OneToOneField(
        Organization,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="capacity_quota",
        verbose_name=_("organisation"),
    )
    team = models.OneToOneField(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="capacity_quota", verbose_name=_("team")
    )
    project = models.OneToOneField(
        Project,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="capacity_quota",
        verbose_name=_("project"),
    )
    gpus = models.PositiveIntegerField(_("GPUs"), null=True, blank=True)
    cpu_cores = models.FloatField(_("CPU cores"), null=True, blank=True)
    memory_bytes = models.BigIntegerField(_("memory (bytes)"), null=True, blank=True)
    replicas = models.PositiveIntegerField(_("replicas"), null=True, blank=True)

    class Meta:
        verbose_name = _("capacity quota")
        verbose_name_plural = _("capacity quotas")
        constraints = [
            models.CheckConstraint(
                condition=(
                    Q(organization__isnull=False, team__isnull=True, project__isnull=True)
                    | Q(organization__isnull=True, team__isnull=False, project__isnull=True)
                    | Q(organization__isnull=True, team__isnull=True, project__isnull=False)
                ),
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


# Rate limits ---------------------------------------------------------------------------

LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "monthly_token_budget")


class RateLimit(models.Model):
    """How fast one organisation, team, project or API key may call models, and how many tokens it may use.

    Exactly one owner is set. A limit left empty is no limit. The gateway checks every
    limit of every branch above a request (key, project, team, organisation) and refuses
    with 429 when any is used up; windows are fixed: the current minute, the UTC day and
    the UTC calendar month.
    """

    organization = models.OneToOneField(
        Organization,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="rate_limit",
        verbose_name=_("organisation"),
    )
    team = models.OneToOneField(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="rate_limit", verbose_name=_("team")
    )
    project = models.OneToOneField(
        Project, on_delete=models.CASCADE, null=True, blank=True, related_name="rate_limit", verbose_name=_("project")
    )
    api_key = models.OneToOneField(
        ApiKey, on_delete=models.CASCADE, null=True, blank=True, related_name="rate_limit", verbose_name=_("API key")
    )
    requests_per_minute = models.PositiveIntegerField(
        _("requests per minute"), null=True, blank=True, validators=[MinValueValidator(1)]
    )
    tokens_per_minute = models.PositiveBigIntegerField(
        _("tokens per minute"), null=True, blank=True, validators=[MinValueValidator(1)]
    )
    tokens_per_day = models.PositiveBigIntegerField(
        _("tokens per day"), null=True, blank=True, validators=[MinValueValidator(1)]
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        _("monthly token budget"), null=True, blank=True, validators=[MinValueValidator(1)]
    )
    updated_at = models.DateTimeField(_("updated"), default=timezone.now)

    class Meta:
        verbose_name = _("rate limit")
        verbose_name_plural = _("rate limits")
        constraints = [
            models.CheckConstraint(
                condition=(
                    Q(organization__isnull=False, team__isnull=True, project__isnull=True, api_key__isnull=True)
                    | Q(organization__isnull=True, team__isnull=False, project__isnull=True, api_key__isnull=True)
                    | Q(organization__isnull=True, team__isnull=True, project__isnull=False, api_key__isnull=True)
                    | Q(organization__isnull=True, team__isnull=True, project__isnull=True, api_key__isnull=False)
                ),
                name="%(app_label)s_%(class)s_exactly_one_owner",
                violation_error_message=_(
                    "A rate limit belongs to exactly one organisation, team, project or API key."
                ),
            ),
            models.CheckConstraint(
                condition=(
                    (Q(requests_per_minute__isnull=True) | Q(requests_per_minute__gte=1))
                    & (Q(tokens_per_minute__isnull=True) | Q(tokens_per_minute__gte=1))
                    & (Q(tokens_per_day__isnull=True) | Q(tokens_per_day__gte=1))
                    & (Q(monthly_token_budget__isnull=True) | Q(monthly_token_budget__gte=1))
                ),
                name="%(app_label)s_%(class)s_limits_positive",
                violation_error_message=_("A limit is at least 1; leave it empty for no limit."),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.scope}"

    @property
    def owner(self) -> Organization | Team | Project | ApiKey:
        return self.api_key or self.project or self.team or self.organization  # type: ignore[return-value]

    @property
    def scope(self) -> str:
        """The limiter's name for the owner: "org:1", "team:3", "project:7" or "key:12"."""
        if self.api_key_id:
            return f"key:{self.api_key_id}"
        if self.project_id:
            return f"project:{self.project_id}"
        if self.team_id:
            return f"team:{self.team_id}"
        return f"org:{self.organization_id}"


# Usage ---------------------------------------------------------------------------------


class UsageRecord(models.Model):
    """One request through the gateway: who made it, to which model, what it used and how long it took.

    Written in batches by the gateway's usage writer, never inline. Every reference is
    kept as SET_NULL so deleting a person or a key keeps the history. Unknown is not zero:
    a token count the engine did not report is null, and a time that was never measured
    (no first token, a refusal) is null.
    """

    request_id = models.CharField(_("request id"), max_length=40, unique=True)
    created_at = models.DateTimeField(_("time"), default=timezone.now, db_index=True)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("person"),
    )
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("API key")
    )
    organization = models.ForeignKey(
        Organization, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("organisation")
    )
    team = models.ForeignKey(
        Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("team")
    )
    project = models.ForeignKey(
        Project, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("project")
    )
    model = models.CharField(_("model"), max_length=200)
    endpoint = models.CharField(_("endpoint"), max_length=32, choices=Endpoint.choices)
    replica = models.CharField(_("replica"), max_length=100, blank=True)
    # The GPU class that answered, "cpu", or "external" for a provider outside the cluster.
    hardware = models.CharField(_("hardware"), max_length=64, blank=True)
    stream = models.BooleanField(_("streamed"), default=False)
    prompt_tokens = models.PositiveIntegerField(_("prompt tokens"), null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(_("completion tokens"), null=True, blank=True)
    # Counted by the gateway from the stream because the engine sent no usage.
    tokens_estimated = models.BooleanField(_("tokens estimated"), default=False)
    first_token_ms = models.FloatField(_("time to first token (ms)"), null=True, blank=True)
    total_ms = models.FloatField(_("total time (ms)"), null=True, blank=True)
    # How long it waited in the gateway's queue for a slot: 0 when it took a free one, null when
    # unknown (refused before it asked for one, or recorded before waits were kept).
    queue_ms = models.FloatField(_("queue wait (ms)"), null=True, blank=True)
    status = models.PositiveSmallIntegerField(_("HTTP status"))
    error = models.TextField(_("error"), blank=True)
    # What guardrail policies did: [{"policy", "rule", "kind", "action"}, ...]; null when none matched.
    guardrail = models.JSONField(_("guardrail verdict"), null=True, blank=True)
    # The batch (apps.batches) this request was a line of, "" for a request sent by a client itself.
    batch = models.CharField(_("batch"), max_length=40, blank=True, default="")

    class Meta:
        verbose_name = _("usage record")
        verbose_name_plural = _("usage records")
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["api_key", "created_at"], name="quotas_usage_key_time_idx"),
            models.Index(fields=["model", "created_at"], name="quotas_usage_model_time_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status}"


class UsageRollup(models.Model):
    """Usage summed per minute or hour, per organisation, team, project, key, person and model.

    The owner columns are plain integers with 0 for "none" rather than nullable foreign
    keys: NULLs are distinct in a unique constraint (on PostgreSQL and SQLite alike), so a
    nullable key would let two writers create two rows for the same bucket. Plain ids also
    keep the sums of a deleted key or team.

    Tokens sum only the requests whose counts are known; `requests_without_tokens` says
    how many requests are missing from those sums, so a sum is never passed off as
    complete. Refusals (429) are counted as requests and refusals but not timed.
    `client_errors` is null in rows begun before client errors were counted: unknown, not 0.
    """

    period = models.CharField(_("period"), max_length=8, choices=RollupPeriod.choices)
    bucket_start = models.DateTimeField(_("from"))
    organization_id = models.PositiveBigIntegerField(_("organisation"), default=0)
    team_id = models.PositiveBigIntegerField(_("team"), default=0)
    project_id = models.PositiveBigIntegerField(_("project"), default=0)
    api_key_id = models.PositiveBigIntegerField(_("API key"), default=0)
    user_id = models.PositiveBigIntegerField(_("person"), default=0)
    model = models.CharField(_("model"), max_length=200)
    requests = models.PositiveIntegerField(_("requests"), default=0)
    # Status 500 and above, or a failure after the answer began (a broken stream).
    errors = models.PositiveIntegerField(_("server errors"), default=0)
    # Status 400 to 499 other than 429: a model that does not exist, a bad body, a client gone.
    client_errors = models.PositiveIntegerField(_("client errors"), null=True, blank=True, default=0)
    # Status 429: refused by a limit.
    refusals = models.PositiveIntegerField(_("refusals"), default=0)
    prompt_tokens = models.PositiveBigIntegerField(_("prompt tokens"), default=0)
    completion_tokens = models.PositiveBigIntegerField(_("completion tokens"), default=0)
    requests_without_tokens = models.PositiveIntegerField(_("requests without token counts"), default=0)
    # Sketches of apps.quotas.histograms (older rows: lists of counts per LEGACY_BOUNDS_MS bucket).
    first_token_hist = models.JSONField(_("time to first token histogram"), default=dict, blank=True)
    latency_hist = models.JSONField(_("latency histogram"), default=dict, blank=True)
    # The waits for a slot of the requests whose wait is known (rows begun before: none counted).
    queue_hist = models.JSONField(_("queue wait histogram"), default=dict, blank=True)

    class Meta:
        verbose_name = _("usage rollup")
        verbose_name_plural = _("usage rollups")
        constraints = [
            models.UniqueConstraint(
                fields=[
                    "period",
                    "bucket_start",
                    "organization_id",
                    "team_id",
                    "project_id",
                    "api_key_id",
                    "user_id",
                    "model",
                ],
                name="%(app_label)s_%(class)s_unique_bucket",
            ),
        ]
        indexes = [
            models.Index(fields=["period", "bucket_start"], name="quotas_rollup_bucket_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.period} {self.bucket_start:%Y-%m-%d %H:%M} {self.model} key {self.api_key_id}"


class HeldTime(models.Model):
    """The time replicas held their cards (or, without a GPU, their cores), per hour, per model,
    its owner (organisation, team and project ids, 0 for none, as in UsageRollup) and GPU class.

    `gpu_seconds` is cards × seconds held (a replica on 8 cards for an hour adds 28,800);
    `core_seconds` the same for cores claimed by shards that hold no GPU. Held means claimed by
    placement: from the moment a replica's shard is placed until it is released, starting and
    stopping included, whether or not requests came (apps.cluster.held writes these rows).
    """

    bucket_start = models.DateTimeField(_("hour"))
    model = models.CharField(_("model"), max_length=200)
    organization_id = models.PositiveBigIntegerField(_("organisation"), default=0)
    team_id = models.PositiveBigIntegerField(_("team"), default=0)
    project_id = models.PositiveBigIntegerField(_("project"), default=0)
    gpu_class = models.CharField(_("GPU class"), max_length=100, blank=True)
    gpu_seconds = models.FloatField(_("GPU seconds"), default=0)
    core_seconds = models.FloatField(_("core seconds"), default=0)
    # The energy the held cards drew (their measured power), or for a CPU shard its share of the
    # node's RAPL package power by cores, over `measured_seconds`: the part of the held card- or
    # core-seconds for which a reading was known. Unmeasured time adds nothing to either.
    energy_joules = models.FloatField(_("energy (J)"), default=0)
    measured_seconds = models.FloatField(_("measured seconds"), default=0)

    class Meta:
        verbose_name = _("held time")
        verbose_name_plural = _("held time")
        constraints = [
            models.UniqueConstraint(
                fields=["bucket_start", "model", "organization_id", "team_id", "project_id", "gpu_class"],
                name="%(app_label)s_%(class)s_unique_bucket",
            ),
        ]
        indexes = [models.Index(fields=["bucket_start"], name="quotas_heldtime_bucket_idx")]

    def __str__(self) -> str:
        return f"{self.bucket_start:%Y-%m-%d %H:00} {self.model} {self.gpu_class or 'cpu'}"
