"""People, the organisation tree, API keys and the audit log."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser, BaseUserManager
from django.contrib.auth.models import PermissionsMixin
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from apps.accounts.choices import Band, MembershipRole, StaffRole

__all__ = ["ApiKey", "AuditEvent", "Membership", "Organization", "Project", "Team", "User", "hash_key"]


def hash_key(raw: str) -> str:
    """SHA-256 of a whole API key. Keys are 256-bit random, so no salt or slow hash is needed."""
    return hashlib.sha256(raw.encode()).hexdigest()


class UserManager(BaseUserManager["User"]):
    use_in_migrations = True

    def create_user(self, email: str, password: str | None = None, **extra: Any) -> User:
        if not email:
            raise ValueError("An email address is required")
        user = self.model(email=self.normalize_email(email).lower(), **extra)
        if password:
            user.set_password(password)
        else:
            user.set_unusable_password()
        user.save(using=self._db)
        return user

    def create_superuser(self, email: str, password: str | None = None, **extra: Any) -> User:
        extra.setdefault("is_staff", True)
        extra.setdefault("is_superuser", True)
        extra.setdefault("staff_role", StaffRole.ADMIN)
        return self.create_user(email, password, **extra)


class User(AbstractBaseUser, PermissionsMixin):
    """A person who signs in with an email address (or through single sign-on)."""

    email = models.EmailField(_("email address"), unique=True)
    name = models.CharField(_("name"), max_length=200, blank=True)
    staff_role = models.CharField(
        _("staff role"), max_length=16, choices=StaffRole.choices, blank=True, default=StaffRole.NONE
    )
    is_active = models.BooleanField(_("active"), default=True)
    # Django admin access; kept in step with staff_role by the accounts services.
    is_staff = models.BooleanField(_("Django admin access"), default=False)
    date_joined = models.DateTimeField(_("joined"), default=timezone.now)

    objects = UserManager()

    USERNAME_FIELD = "email"
    EMAIL_FIELD = "email"
    REQUIRED_FIELDS = []  # a class attribute, as Django reads it

    class Meta:
        verbose_name = _("user")
        verbose_name_plural = _("users")
        ordering = ["email"]

    def __str__(self) -> str:
        return self.email

    def get_full_name(self) -> str:
        return self.name or self.email

    def get_short_name(self) -> str:
        return self.name.split(" ")[0] if self.name else self.email

    @property
    def is_admin(self) -> bool:
        return self.is_active and (self.is_superuser or self.staff_role == StaffRole.ADMIN)


class Organization(models.Model):
    """The top of the tree: a company or a division that owns teams, limits and usage."""

    name = models.CharField(_("name"), max_length=200)
    slug = models.SlugField(_("slug"), max_length=100, unique=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    # Its share of a busy model against its siblings', by weight (apps.gateway.fairness).
    weight = models.PositiveSmallIntegerField(
        _("weight"),
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=_("Its share of a busy model against the others at its level, by weight (1 to 1000)."),
    )

    class Meta:
        verbose_name = _("organisation")
        verbose_name_plural = _("organisations")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Team(models.Model):
    """A group of people inside an organisation."""

    organization = models.ForeignKey(
        Organization, on_delete=models.PROTECT, related_name="teams", verbose_name=_("organisation")
    )
    name = models.CharField(_("name"), max_length=200)
    slug = models.SlugField(_("slug"), max_length=100)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    # Its share of a busy model against its siblings', by weight (apps.gateway.fairness).
    weight = models.PositiveSmallIntegerField(
        _("weight"),
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=_("Its share of a busy model against the others at its level, by weight (1 to 1000)."),
    )

    class Meta:
        verbose_name = _("team")
        verbose_name_plural = _("teams")
        ordering = ["organization__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["organization", "slug"], name="%(app_label)s_%(class)s_unique_org_slug"),
        ]

    def __str__(self) -> str:
        return f"{self.organization} / {self.name}"


class Project(models.Model):
    """A unit of work inside a team; API keys and usage are charged to a project."""

    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="projects", verbose_name=_("team"))
    name = models.CharField(_("name"), max_length=200)
    slug = models.SlugField(_("slug"), max_length=100)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    # Its share of a busy model against its siblings', by weight (apps.gateway.fairness).
    weight = models.PositiveSmallIntegerField(
        _("weight"),
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=_("Its share of a busy model against the others at its level, by weight (1 to 1000)."),
    )
    # The highest band its requests may ask for; a request asking more is served at this band.
    band = models.CharField(
        _("highest priority band"),
        max_length=16,
        choices=Band.choices,
        default=Band.INTERACTIVE,
        help_text=_("Requests may ask for this band or a lower one; one asking higher is served at this band."),
    )

    class Meta:
        verbose_name = _("project")
        verbose_name_plural = _("projects")
        ordering = ["team__organization__name", "team__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["team", "slug"], name="%(app_label)s_%(class)s_unique_team_slug"),
        ]

    def __str__(self) -> str:
        return f"{self.team} / {self.name}"

    @property
    def organization(self) -> Organization:
        return self.team.organization


class Membership(models.Model):
    """A person's place in one branch of the tree: an organisation, a team or a project.

    The organisation is always set (so "everyone in org X" is one indexed query); team and
    project narrow it. A project membership names its team too.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships", verbose_name=_("user")
    )
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, related_name="memberships", verbose_name=_("organisation")
    )
    team = models.ForeignKey(
        Team, on_delete=models.CASCADE, null=True, blank=True, related_name="memberships", verbose_name=_("team")
    )
    project = models.ForeignKey(
        Project,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="memberships",
        verbose_name=_("project"),
    )
    role = models.CharField(_("role"), max_length=16, choices=MembershipRole.choices, default=MembershipRole.MEMBER)
    # Made by single sign-on from the provider's groups, and removed by it when the person
    # leaves them; memberships made by hand are never touched by sign-in.
    from_sso = models.BooleanField(_("from single sign-on"), default=False)
    created_at = models.DateTimeField(_("created"), default=timezone.now)

    class Meta:
        verbose_name = _("membership")
        verbose_name_plural = _("memberships")
        constraints = [
            models.CheckConstraint(
                condition=Q(project__isnull=True) | Q(team__isnull=False),
                name="%(app_label)s_%(class)s_project_needs_team",
            ),
            models.UniqueConstraint(
                fields=["user", "organization"],
                condition=Q(team__isnull=True),
                name="%(app_label)s_%(class)s_unique_user_org",
            ),
            models.UniqueConstraint(
                fields=["user", "team"],
                condition=Q(team__isnull=False, project__isnull=True),
                name="%(app_label)s_%(class)s_unique_user_team",
            ),
            models.UniqueConstraint(
                fields=["user", "project"],
                condition=Q(project__isnull=False),
                name="%(app_label)s_%(class)s_unique_user_project",
            ),
        ]

    def __str__(self) -> str:
        target = self.project or self.team or self.organization
        return f"{self.user} in {target} ({self.get_role_display()})"


class ApiKeyQuerySet(models.QuerySet["ApiKey"]):
    def active(self) -> ApiKeyQuerySet:
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))


class ApiKey(models.Model):
    """A secret that lets a program act as its owner. Only the hash is stored; the key is shown once."""

    name = models.CharField(_("name"), max_length=200)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys", verbose_name=_("owner")
    )
    project = models.ForeignKey(
        Project, on_delete=models.PROTECT, null=True, blank=True, related_name="api_keys", verbose_name=_("project")
    )
    # The first characters of the key, shown so people can tell their keys apart.
    prefix = models.CharField(_("prefix"), max_length=32, db_index=True)
    key_hash = models.CharField(_("key hash"), max_length=64, unique=True)
    # Model API names this key may use; empty means every model its owner may use.
    allowed_models = models.JSONField(_("allowed models"), default=list, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    expires_at = models.DateTimeField(_("expires"), null=True, blank=True)
    revoked_at = models.DateTimeField(_("revoked"), null=True, blank=True)
    last_used_at = models.DateTimeField(_("last used"), null=True, blank=True)
    # Short-lived keys the console makes for its own chat page.
    is_session_key = models.BooleanField(_("console session key"), default=False)
    # Its share of a busy model against its siblings', by weight (apps.gateway.fairness).
    weight = models.PositiveSmallIntegerField(
        _("weight"),
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=_("Its share of a busy model against the others at its level, by weight (1 to 1000)."),
    )
    # The highest band its requests may ask for; a request asking more is served at this band.
    band = models.CharField(
        _("highest priority band"),
        max_length=16,
        choices=Band.choices,
        default=Band.INTERACTIVE,
        help_text=_("Requests may ask for this band or a lower one; one asking higher is served at this band."),
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        verbose_name = _("API key")
        verbose_name_plural = _("API keys")
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"

    def state(self, now: datetime | None = None) -> str:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


class AuditEvent(models.Model):
    """One change somebody made. Written by services only; never edited or deleted."""

    created_at = models.DateTimeField(_("time"), default=timezone.now, db_index=True)
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("actor"),
    )
    # The actor's address at the time, kept when the account is gone; "system" for the control plane.
    actor_label = models.CharField(_("actor"), max_length=254)
    action = models.CharField(_("action"), max_length=64, db_index=True)
    target_type = models.CharField(_("target type"), max_length=64, blank=True)
    target_id = models.CharField(_("target id"), max_length=64, blank=True)
    target_label = models.CharField(_("target"), max_length=300, blank=True)
    changes = models.JSONField(_("changes"), default=dict, blank=True)
    address = models.GenericIPAddressField(_("address"), null=True, blank=True)

    class Meta:
        verbose_name = _("audit event")
        verbose_name_plural = _("audit events")
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id"], name="accounts_audit_target_idx")]

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor_label} {self.action} {self.target_label}"
