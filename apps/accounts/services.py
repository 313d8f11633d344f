"""Every change to people, the organisation tree and API keys goes through here."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django.utils.text import slugify
from django.utils.translation import gettext as _

from apps.accounts import audit
from apps.accounts.choices import StaffRole
from apps.accounts.models import ApiKey, Organization, Project, Team, User, hash_key

__all__ = [
    "KeyCheck",
    "check_api_key",
    "create_api_key",
    "create_organization",
    "create_project",
    "create_team",
    "ensure_first_admin",
    "revoke_api_key",
]

# How stale last_used_at may get before a request writes it again: one write a minute per
# key instead of one per request.
LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclass(frozen=True)
class NewKey:
    key: ApiKey
    secret: str  # the whole key, shown to its owner once and never stored


@transaction.atomic
def create_api_key(
    user: User,
    *,
    name: str,
    project: Project | None = None,
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
    actor: User | None,
    address: str | None = None,
) -> NewKey:
    secret = settings.API_KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        name=name.strip() or "key",
        user=user,
        project=project,
        prefix=secret[: len(settings.API_KEY_PREFIX) + 6],
        key_hash=hash_key(secret),
        expires_at=expires_at,
        allowed_models=sorted(set(allowed_models or [])),
    )
    audit.record(actor, "api_key.create", key, owner=user.email, project=str(project) if project else None,
                 expires_at=expires_at.isoformat() if expires_at else None, address=address)
    return NewKey(key=key, secret=secret)


@transaction.atomic
def revoke_api_key(key: ApiKey, *, actor: User | None, address: str | None = None) -> ApiKey:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])
        audit.record(actor, "api_key.revoke", key, owner=key.user.email, address=address)
    return key


@dataclass(frozen=True)
class KeyCheck:
    key: ApiKey | None
    reason: str  # empty when the key is good


def check_api_key(raw: str) -> KeyCheck:
    """Find the key a request presented and say whether it may be used.

    The lookup is by the SHA-256 of the whole key, so how long it takes says nothing about
    how much of a guess was right; the final comparison is constant-time anyway. The
    reasons never say anything about whose key it is.
    """
    if not raw.startswith(settings.API_KEY_PREFIX):
        return KeyCheck(None, _("Not an llmgw API key."))
    digest = hash_key(raw)
    key = ApiKey.objects.select_related("user", "project").filter(key_hash=digest).first()
    if key is None or not hmac.compare_digest(key.key_hash, digest):
        return KeyCheck(None, _("Invalid API key."))
    now = timezone.now()
    if key.revoked_at is not None:
        return KeyCheck(None, _("API key revoked."))
    if key.expires_at is not None and key.expires_at <= now:
        return KeyCheck(None, _("API key expired."))
    if not key.user.is_active:
        return KeyCheck(None, _("The key's owner is suspended."))
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return KeyCheck(key, "")


def _unique_slug(model: type[Organization] | type[Team] | type[Project], base: str, **scope: object) -> str:
    root = slugify(base)[:90] or "item"
    slug, n = root, 1
    while model.objects.filter(slug=slug, **scope).exists():  # type: ignore[misc]
        n += 1
        slug = f"{root}-{n}"
    return slug


@transaction.atomic
def create_organization(*, name: str, actor: User | None, slug: str = "") -> Organization:
    org = Organization.objects.create(name=name, slug=slug or _unique_slug(Organization, name))
    audit.record(actor, "organization.create", org)
    return org


@transaction.atomic
def create_team(organization: Organization, *, name: str, actor: User | None, slug: str = "") -> Team:
    team = Team.objects.create(
        organization=organization, name=name, slug=slug or _unique_slug(Team, name, organization=organization)
    )
    audit.record(actor, "team.create", team)
    return team


@transaction.atomic
def create_project(team: Team, *, name: str, actor: User | None, slug: str = "") -> Project:
    project = Project.objects.create(team=team, name=name, slug=slug or _unique_slug(Project, name, team=team))
    audit.record(actor, "project.create", project)
    return project


@transaction.atomic
def ensure_first_admin(email: str) -> tuple[User, str] | None:
    """Create the first administrator when there is no administrator at all.

    Returns the account and its generated password (to print once), or None when an
    administrator already exists. Only the password's hash is stored.
    """
    if User.objects.filter(is_superuser=True).exists() or User.objects.filter(staff_role=StaffRole.ADMIN).exists():
        return None
    password = secrets.token_urlsafe(15)
    user = User.objects.create_superuser(email, password, name="Administrator")
    audit.record(None, "user.create_first_admin", user)
    return user, password
