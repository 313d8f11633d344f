"""Every change to people, the organisation tree and API keys goes through here."""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import ProtectedError, QuerySet, RestrictedError
from django.utils import timezone
from django.utils.text import get_text_list, slugify
from django.utils.translation import gettext as _
from django.utils.translation import ngettext, pgettext

from apps.accounts import audit
from apps.accounts.choices import StaffRole
from apps.accounts.extensions import EXTENSIONS
from apps.accounts.models import ApiKey, Membership, Organization, Project, Team, User, hash_key

__all__ = [
    "KeyCheck",
    "branch_dependents",
    "check_api_key",
    "check_branch_name",
    "create_api_key",
    "create_organization",
    "create_project",
    "create_team",
    "ensure_first_admin",
    "record_sign_in",
    "removal_refusal",
    "remove_organization",
    "remove_project",
    "remove_team",
    "rename_organization",
    "rename_project",
    "rename_team",
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
    audit.record(
        actor,
        "api_key.create",
        key,
        owner=user.email,
        project=str(project) if project else None,
        expires_at=expires_at.isoformat() if expires_at else None,
        address=address,
        session_key=True if is_session_key else None,
    )
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


# The organisation tree ---------------------------------------------------------------------

Branch = Organization | Team | Project

NAME_MAX_LENGTH = 200  # the column's length, and the API's bound


def _kind(model: type[Branch] | Branch) -> str:
    model = model if isinstance(model, type) else type(model)
    return {Organization: "organization", Team: "team", Project: "project"}[model]


def check_branch_name(
    model: type[Branch], name: str, *, parent: Organization | Team | None, exclude: Branch | None = None
) -> str:
    """The name as it will be stored, or a ValidationError on "name" that says what is wrong.

    The rules are the API's and the People page's alike: surrounding spaces are dropped; the
    name is required, at most 200 characters and holds no NUL; and no sibling has it in any
    letter case (organisations among organisations, a team among its organisation's teams, a
    project among its team's projects), since the tree, the usage tables and the gateway's
    refusals name branches by name. `exclude` is the branch being renamed.
    """
    kind = _kind(model)
    name = (name or "").strip()
    if not name:
        message = {
            "organization": _("Give the organisation a name."),
            "team": _("Give the team a name."),
            "project": _("Give the project a name."),
        }[kind]
        raise ValidationError({"name": ValidationError(message, code="required")})
    if len(name) > NAME_MAX_LENGTH:
        raise ValidationError(
            {
                "name": ValidationError(
                    _("A name is at most %(limit)d characters; this one has %(length)d.")
                    % {"limit": NAME_MAX_LENGTH, "length": len(name)},
                    code="max_length",
                )
            }
        )
    if "\x00" in name:
        raise ValidationError({"name": ValidationError(_("A name may not contain a NUL character."), code="null")})
    siblings: QuerySet[Any]
    if kind == "organization" and parent is None:
        siblings = Organization.objects.all()
    elif kind == "team" and isinstance(parent, Organization):
        siblings = Team.objects.filter(organization=parent)
    elif kind == "project" and isinstance(parent, Team):
        siblings = Project.objects.filter(team=parent)
    else:
        raise TypeError(f"a {kind} cannot be under {parent!r}")
    if exclude is not None:
        siblings = siblings.exclude(pk=exclude.pk)
    if siblings.filter(name__iexact=name).exists():
        if kind == "organization":
            message = _("There is already an organisation named %(name)s.") % {"name": name}
        elif kind == "team":
            message = _("%(parent)s already has a team named %(name)s.") % {"parent": parent, "name": name}
        else:
            message = _("%(parent)s already has a project named %(name)s.") % {"parent": parent, "name": name}
        raise ValidationError({"name": ValidationError(message, code="duplicate")})
    return name


def _lock(branch: Branch | None) -> None:
    """Hold the row until the transaction ends, so two changes under one parent queue up."""
    if branch is not None:
        type(branch).objects.select_for_update().filter(pk=branch.pk).exists()


@transaction.atomic
def create_organization(*, name: str, actor: User | None, slug: str = "", address: str | None = None) -> Organization:
    name = check_branch_name(Organization, name, parent=None)
    org = Organization.objects.create(name=name, slug=slug or _unique_slug(Organization, name))
    audit.record(actor, "organization.create", org, address=address)
    return org


@transaction.atomic
def create_team(
    organization: Organization, *, name: str, actor: User | None, slug: str = "", address: str | None = None
) -> Team:
    _lock(organization)
    name = check_branch_name(Team, name, parent=organization)
    team = Team.objects.create(
        organization=organization, name=name, slug=slug or _unique_slug(Team, name, organization=organization)
    )
    audit.record(actor, "team.create", team, address=address)
    return team


@transaction.atomic
def create_project(team: Team, *, name: str, actor: User | None, slug: str = "", address: str | None = None) -> Project:
    _lock(team)
    name = check_branch_name(Project, name, parent=team)
    project = Project.objects.create(team=team, name=name, slug=slug or _unique_slug(Project, name, team=team))
    audit.record(actor, "project.create", project, address=address)
    return project


def _parent(branch: Branch) -> Organization | Team | None:
    if isinstance(branch, Project):
        return branch.team
    if isinstance(branch, Team):
        return branch.organization
    return None


def _rename[B: (Organization, Team, Project)](branch: B, name: str, *, actor: User | None, address: str | None) -> B:
    parent = _parent(branch)
    _lock(parent)
    name = check_branch_name(type(branch), name, parent=parent, exclude=branch)
    if name == branch.name:
        return branch
    before = branch.name
    branch.name = name
    branch.save(update_fields=["name"])
    audit.record(
        actor, f"{_kind(branch)}.rename", branch, changes=audit.diff({"name": before}, {"name": name}), address=address
    )
    return branch


@transaction.atomic
def rename_organization(
    organization: Organization, *, name: str, actor: User | None, address: str | None = None
) -> Organization:
    """A new name for the same row: its slug, teams, members, limits, models and usage stay."""
    return _rename(organization, name, actor=actor, address=address)


@transaction.atomic
def rename_team(team: Team, *, name: str, actor: User | None, address: str | None = None) -> Team:
    """A new name for the same row; the slug (which single sign-on's mapping names) stays."""
    return _rename(team, name, actor=actor, address=address)


@transaction.atomic
def rename_project(project: Project, *, name: str, actor: User | None, address: str | None = None) -> Project:
    """A new name for the same row; the slug, API keys and usage stay."""
    return _rename(project, name, actor=actor, address=address)


def branch_dependents(branch: Branch) -> dict[str, int]:
    """What still hangs from a branch and stops its removal, with how many of each (none: absent).

    Teams and projects below it, the people with a membership in it or below it, what other apps
    keep of it or of anything below it (apps.accounts.extensions: the models it owns), and the API
    keys of its projects (revoked ones too: a key keeps its project for the record). Usage history
    is not counted: it keeps the branch's id.
    """
    if isinstance(branch, Organization):
        counts = {
            "teams": Team.objects.filter(organization=branch).count(),
            "projects": Project.objects.filter(team__organization=branch).count(),
            "members": Membership.objects.filter(organization=branch).values("user_id").distinct().count(),
            **EXTENSIONS.dependents(branch),
            "api_keys": ApiKey.objects.filter(project__team__organization=branch).count(),
        }
    elif isinstance(branch, Team):
        counts = {
            "projects": Project.objects.filter(team=branch).count(),
            "members": Membership.objects.filter(team=branch).values("user_id").distinct().count(),
            **EXTENSIONS.dependents(branch),
            "api_keys": ApiKey.objects.filter(project__team=branch).count(),
        }
    else:
        counts = {
            "members": Membership.objects.filter(project=branch).values("user_id").distinct().count(),
            **EXTENSIONS.dependents(branch),
            "api_keys": ApiKey.objects.filter(project=branch).count(),
        }
    return {what: count for what, count in counts.items() if count}


def _dependents_text(counts: dict[str, int]) -> str:
    phrases = {
        "teams": lambda n: ngettext("%(count)d team", "%(count)d teams", n),
        "projects": lambda n: ngettext("%(count)d project", "%(count)d projects", n),
        "members": lambda n: ngettext("%(count)d member", "%(count)d members", n),
        "api_keys": lambda n: ngettext("%(count)d API key", "%(count)d API keys", n),
    }
    return get_text_list(
        [
            (phrases[what](count) if what in phrases else EXTENSIONS.dependent_phrase(what, count)) % {"count": count}
            for what, count in counts.items()
        ],
        pgettext("before the last item of a list", "and"),
    )


def removal_refusal(branch: Branch) -> str:
    """Why `branch` cannot be removed, with the numbers; empty when it can."""
    counts = branch_dependents(branch)
    if not counts:
        return ""
    values = {"name": branch.name, "left": _dependents_text(counts)}
    if isinstance(branch, Organization):
        return _("Organisation %(name)s cannot be removed: it still has %(left)s.") % values
    if isinstance(branch, Team):
        return _("Team %(name)s cannot be removed: it still has %(left)s.") % values
    return _("Project %(name)s cannot be removed: it still has %(left)s.") % values


def _remove(branch: Branch, *, actor: User | None, address: str | None) -> None:
    """Refuse while anything depends on the branch; otherwise remove it with its own limits.

    1. Lock the row and count what hangs from it; anything at all is a refusal, with nothing
       written.
    2. What other apps keep of only it goes first, each audited (apps.accounts.extensions: its
       rate limit and capacity quota).
    3. Audit the removal and delete the row. A model or key added since the count is caught by
       the PROTECT foreign keys and refused the same way (the whole change rolls back).
    """
    _lock(branch)
    refusal = removal_refusal(branch)
    if refusal:
        raise ValidationError(refusal, code="in_use")
    EXTENSIONS.remove_with(branch, actor, address)
    audit.record(actor, f"{_kind(branch)}.remove", branch, name=branch.name, slug=branch.slug, address=address)
    try:
        branch.delete()
    except (ProtectedError, RestrictedError):
        raise ValidationError(removal_refusal(branch), code="in_use") from None


@transaction.atomic
def remove_organization(organization: Organization, *, actor: User | None, address: str | None = None) -> None:
    """Remove an organisation with no teams, members, models or keys left; refused otherwise."""
    _remove(organization, actor=actor, address=address)


@transaction.atomic
def remove_team(team: Team, *, actor: User | None, address: str | None = None) -> None:
    """Remove a team with no projects, members, models or keys left; refused otherwise."""
    _remove(team, actor=actor, address=address)


@transaction.atomic
def remove_project(project: Project, *, actor: User | None, address: str | None = None) -> None:
    """Remove a project with no members, models or API keys left; refused otherwise."""
    _remove(project, actor=actor, address=address)


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
    new_role = StaffRole(role)
    admin = new_role == StaffRole.ADMIN
    before = {"staff_role": user.staff_role, "is_staff": user.is_staff, "is_superuser": user.is_superuser}
    after = {"staff_role": str(new_role), "is_staff": admin, "is_superuser": admin}
    if before == after:
        return user
    if not admin and user.is_admin:
        others = User.objects.filter(is_active=True).exclude(pk=user.pk)
        if not (others.filter(is_superuser=True).exists() or others.filter(staff_role=StaffRole.ADMIN).exists()):
            raise ValidationError(
                _("%(email)s is the only administrator; make someone else one first.") % {"email": user.email},
                code="last_admin",
            )
    user.staff_role, user.is_staff, user.is_superuser = str(new_role), admin, admin
    user.save(update_fields=["staff_role", "is_staff", "is_superuser"])
    audit.record(actor, "user.staff_role", user, changes=audit.diff(before, after), address=address)
    return user
