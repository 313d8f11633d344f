"""Every change to people, the organisation tree and API keys goes through here."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
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
    "record_sign_in",
    "revoke_api_key",
    "set_staff_role",
    "sign_up",
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
    is_session_key: bool = False,
) -> NewKey:
    """A new key for `user`; `is_session_key` marks the short-lived ones the console's chat page holds."""
    secret = settings.API_KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        name=name.strip() or "key",
        user=user,
        project=project,
        prefix=secret[: len(settings.API_KEY_PREFIX) + 6],
        key_hash=hash_key(secret),
        expires_at=expires_at,
        allowed_models=sorted(set(allowed_models or [])),
        is_session_key=is_session_key,
    )
    audit.record(actor, "api_key.create", key, owner=user.email, project=str(project) if project else None,
                 expires_at=expires_at.isoformat() if expires_at else None, address=address,
                 session_key=True if is_session_key else None)
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


def sign_up(*, email: str, name: str, password: str, address: str | None = None) -> User | None:
    """Create the account someone asked for on the sign-up page; None when the address has one.

    1. Hash the password first, so that a taken address costs the same time as a new one.
    2. Insert, and let the unique constraint on email decide: SQLite's "UNIQUE constraint
       failed" and PostgreSQL's unique_violation (23505) both arrive as IntegrityError, and two
       sign-ups racing for one address cannot both win. The insert runs in its own atomic
       block (a savepoint inside a caller's transaction), so on PostgreSQL the connection is
       still usable after the violation.
    3. An IntegrityError with no account at that address is some other fault: re-raised.

    Older accounts may differ only in letter case, which the constraint does not see; those
    are looked for first.
    """
    user = User(email=User.objects.normalize_email(email).strip().lower(), name=name.strip())
    user.set_password(password)
    if User.objects.filter(email__iexact=user.email).exclude(email=user.email).exists():
        return None
    try:
        with transaction.atomic():
            user.save(force_insert=True)
            audit.record(user, "user.sign_up", user, address=address)
    except IntegrityError:
        if User.objects.filter(email=user.email).exists():
            return None
        raise
    return user


@transaction.atomic
def record_sign_in(user: User, *, address: str | None) -> None:
    """Audit a successful sign-in. Failed ones are only counted in the cache (accounts.throttle)."""
    audit.record(user, "user.sign_in", user, address=address)


@transaction.atomic
def set_staff_role(user: User, role: str, *, actor: User | None, address: str | None = None) -> User:
    """Give a person a staff role, or none, and keep Django admin access in step with it.

    Only administrators reach the Django admin: is_staff, and is_superuser (which the admin
    needs to show them anything, and which the access functions read as administrator), are
    set for the administrator role and cleared for every other. The last active administrator
    keeps the role, so the installation cannot lock itself out.
    """
    from django.core.exceptions import ValidationError

    new_role = StaffRole(role)
    admin = new_role == StaffRole.ADMIN
    before = {"staff_role": user.staff_role, "is_staff": user.is_staff, "is_superuser": user.is_superuser}
    after = {"staff_role": str(new_role), "is_staff": admin, "is_superuser": admin}
    if before == after:
        return user
    if not admin and user.is_admin:
        others = User.objects.filter(is_active=True).exclude(pk=user.pk)
        if not (others.filter(is_superuser=True).exists() or others.filter(staff_role=StaffRole.ADMIN).exists()):
            raise ValidationError(_("%(email)s is the only administrator; make someone else one first.")
                                  % {"email": user.email}, code="last_admin")
    user.staff_role, user.is_staff, user.is_superuser = str(new_role), admin, admin
    user.save(update_fields=["staff_role", "is_staff", "is_superuser"])
    audit.record(actor, "user.staff_role", user, changes=audit.diff(before, after), address=address)
    return user
