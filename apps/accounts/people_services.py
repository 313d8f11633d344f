"""Changes made on the People page: who is in which branch, who may sign in, and the tree itself.

Each is atomic and audited, and nothing is half-written when one fails: a refusal is a
ValidationError raised before anything is saved, or after the inner savepoint was rolled back.
"""

from __future__ import annotations

import math
import re
from typing import Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils.translation import gettext as _

from apps.accounts import audit, services
from apps.accounts.access import is_administrator
from apps.accounts.choices import Band, MembershipRole, StaffRole
from apps.accounts.models import ApiKey, Membership, Organization, Project, Team, User

__all__ = [
    "WEIGHT_MAX",
    "WEIGHT_MIN",
    "add_member",
    "branch_fields",
    "create_organization",
    "create_project",
    "create_team",
    "parse_band",
    "parse_weight",
    "reactivate_user",
    "remove_branch",
    "remove_member",
    "rename_branch",
    "manages_share",
    "set_share",
    "share_refusal",
    "suspend_user",
]

Branch = Organization | Team | Project


def branch_fields(branch: Branch) -> dict[str, Any]:
    """The Membership columns that place a membership exactly at `branch`."""
    if isinstance(branch, Project):
        return {"organization_id": branch.team.organization_id, "team_id": branch.team_id, "project_id": branch.pk}
    if isinstance(branch, Team):
        return {"organization_id": branch.organization_id, "team_id": branch.pk, "project_id": None}
    return {"organization_id": branch.pk, "team_id": None, "project_id": None}


def _branch_key(branch: Branch) -> str:
    kind = "project" if isinstance(branch, Project) else "team" if isinstance(branch, Team) else "org"
    return f"{kind}:{branch.pk}"


@transaction.atomic
def add_member(branch: Branch, user: User, role: str, *, actor: User | None, address: str | None = None) -> Membership:
    """Put a person in an organisation, team or project with a role.

    The unique constraints decide whether they are in it already, so two administrators adding
    the same person at once cannot both succeed; the insert runs in its own savepoint, and the
    refusal is a ValidationError with nothing written.
    """
    role = MembershipRole(role)
    fields = branch_fields(branch)
    try:
        with transaction.atomic():
            membership = Membership.objects.create(user=user, role=role, **fields)
    except IntegrityError:
        if Membership.objects.filter(user=user, **fields).exists():
            raise ValidationError(
                _("%(email)s is already a member of %(branch)s.") % {"email": user.email, "branch": branch},
                code="duplicate",
            ) from None
        raise
    audit.record(
        actor,
        "membership.add",
        membership,
        user=user.email,
        branch=_branch_key(branch),
        role=str(role),
        address=address,
    )
    return membership


@transaction.atomic
def remove_member(membership: Membership, *, actor: User | None, address: str | None = None) -> None:
    """Take a person out of one branch. Their memberships elsewhere, and their account, stay."""
    branch = membership.project or membership.team or membership.organization
    audit.record(
        actor,
        "membership.remove",
        membership,
        user=membership.user.email,
        branch=_branch_key(branch),
        role=membership.role,
        from_sso=membership.from_sso or None,
        address=address,
    )
    membership.delete()


def _other_active_administrators(user: User) -> bool:
    # Locked, so two administrators suspending each other at once cannot leave none.
    others = User.objects.select_for_update().filter(is_active=True).exclude(pk=user.pk)
    return others.filter(is_superuser=True).exists() or others.filter(staff_role=StaffRole.ADMIN).exists()


@transaction.atomic
def suspend_user(user: User, *, actor: User | None, address: str | None = None) -> User:
    """Stop a person signing in and their API keys working; their memberships and keys stay.

    The last active administrator cannot be suspended, so the installation cannot lock itself out.
    """
    if not user.is_active:
        return user
    if user.is_admin and not _other_active_administrators(user):
        raise ValidationError(
            _("%(email)s is the only active administrator; make someone else one first.") % {"email": user.email},
            code="last_admin",
        )
    user.is_active = False
    user.save(update_fields=["is_active"])
    audit.record(
        actor, "user.suspend", user, changes=audit.diff({"is_active": True}, {"is_active": False}), address=address
    )
    return user


@transaction.atomic
def reactivate_user(user: User, *, actor: User | None, address: str | None = None) -> User:
    """Let a suspended person sign in again."""
    if user.is_active:
        return user
    user.is_active = True
    user.save(update_fields=["is_active"])
    audit.record(
        actor, "user.reactivate", user, changes=audit.diff({"is_active": False}, {"is_active": True}), address=address
    )
    return user


# The tree: a refusal from accounts.services (a name's rules, what still depends on a branch) is a
# ValidationError with nothing written; so is a slug taken by a change made at the same moment.


@transaction.atomic
def create_organization(*, name: str, actor: User | None, address: str | None = None) -> Organization:
    """A new organisation; its slug is made from the name. Audited by accounts.services."""
    try:
        with transaction.atomic():
            return services.create_organization(name=name, actor=actor, address=address)
    except IntegrityError:  # another organisation took the same slug between the check and the insert
        raise ValidationError(
            _("An organisation with that name was just added; try again."), code="duplicate"
        ) from None


@transaction.atomic
def create_team(organization: Organization, *, name: str, actor: User | None, address: str | None = None) -> Team:
    """A new team in an organisation; its slug is made from the name. Audited by accounts.services."""
    try:
        with transaction.atomic():
            return services.create_team(organization, name=name, actor=actor, address=address)
    except IntegrityError:  # another team took the same slug between the check and the insert
        raise ValidationError(_("A team with that name was just added; try again."), code="duplicate") from None


@transaction.atomic
def create_project(team: Team, *, name: str, actor: User | None, address: str | None = None) -> Project:
    """A new project in a team; its slug is made from the name. Audited by accounts.services."""
    try:
        with transaction.atomic():
            return services.create_project(team, name=name, actor=actor, address=address)
    except IntegrityError:
        raise ValidationError(_("A project with that name was just added; try again."), code="duplicate") from None


def rename_branch(branch: Branch, *, name: str, actor: User | None, address: str | None = None) -> Branch:
    """A new name for an organisation, team or project: the same row, so every relation stays."""
    if isinstance(branch, Project):
        return services.rename_project(branch, name=name, actor=actor, address=address)
    if isinstance(branch, Team):
        return services.rename_team(branch, name=name, actor=actor, address=address)
    return services.rename_organization(branch, name=name, actor=actor, address=address)


def remove_branch(branch: Branch, *, actor: User | None, address: str | None = None) -> None:
    """Remove an organisation, team or project, refused while anything depends on it."""
    if isinstance(branch, Project):
        services.remove_project(branch, actor=actor, address=address)
    elif isinstance(branch, Team):
        services.remove_team(branch, actor=actor, address=address)
    else:
        services.remove_organization(branch, actor=actor, address=address)


# Shares of a busy model: weights and bands ---------------------------------------------------
#
# A weight divides a busy model among siblings (apps.gateway.fairness), so it is set by whoever
# manages the level above them, never by the branch itself: an organisation's by administrators,
# a team's also by its organisation's managers, a project's (and its band) also by its team's and
# organisation's managers, a key's by the managers of its project and above. A key's owner may
# lower its band, never raise it; no key's band is above its project's.

ShareTarget = Organization | Team | Project | ApiKey

WEIGHT_MIN, WEIGHT_MAX = 1, 1000
# The bands from the highest down: a request may use its ceiling's band or one after it.
BAND_ORDER = (Band.INTERACTIVE, Band.BATCH)
_WHOLE = re.compile(r"[+-]?\d{1,12}")


def _weight_error(value: object) -> ValidationError:
    shown = str(value).strip()[:40] or '""'
    return ValidationError(
        {
            "weight": ValidationError(
                _("The weight is a whole number from %(low)d to %(high)d; %(value)s is not.")
                % {"low": WEIGHT_MIN, "high": WEIGHT_MAX, "value": shown},
                code="weight",
            )
        }
    )


def parse_weight(value: object) -> int:
    """A weight as given by a form, the API or ctl (a whole number, or text holding one), checked
    against 1..1000; a ValidationError on "weight" naming the range otherwise (NaN, 2.5, "x", true)."""
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        number = int(value.strip())
    if number is None or not WEIGHT_MIN <= number <= WEIGHT_MAX:
        raise _weight_error(value)
    return number


def parse_band(value: object) -> str:
    """A band's name ("interactive" or "batch"); a ValidationError on "band" naming them otherwise."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in Band.values:
        shown = str(value).strip()[:40] or '""'
        raise ValidationError(
            {
                "band": ValidationError(
                    _("The band is one of %(bands)s; %(value)s is not.")
                    % {"bands": ", ".join(Band.values), "value": shown},
                    code="band",
                )
            }
        )
    return str(text)


def _kind_of(target: ShareTarget) -> str:
    return "api_key" if isinstance(target, ApiKey) else services._kind(target)


def _managers_above(target: ShareTarget) -> Q | None:
    """The memberships that manage the level above `target` (None: only administrators do)."""
    manager = Q(role=MembershipRole.MANAGER)
    if isinstance(target, Team):
        return manager & Q(organization_id=target.organization_id, team__isnull=True)
    project = target if isinstance(target, Project) else target.project if isinstance(target, ApiKey) else None
    if project is None:
        return None
    above = Q(organization_id=project.team.organization_id, team__isnull=True) | Q(
        team_id=project.team_id, project__isnull=True
    )
    if isinstance(target, ApiKey):
        above |= Q(project_id=project.pk)
    return manager & above


def manages_share(user: User, target: ShareTarget) -> bool:
    """Whether `user` may set `target`'s weight and band: an administrator, or a manager of the level
    above it (all of a project's keys answer alike)."""
    if is_administrator(user):
        return True
    above = _managers_above(target)
    return above is not None and Membership.objects.filter(above, user=user).exists()


def _refusal_text(target: ShareTarget) -> str:
    if isinstance(target, Organization):
        return _("Only administrators may change the weight of organisation %(name)s.") % {"name": target.name}
    if isinstance(target, Team):
        return _("Only administrators and the managers of %(parent)s may change the weight of team %(name)s.") % {
            "parent": target.organization.name,
            "name": target.name,
        }
    if isinstance(target, Project):
        return _(
            "Only administrators and the managers of %(parent)s may change the weight or band of project %(name)s."
        ) % {"parent": target.team, "name": target.name}
    if target.project is None:
        return _(
            "Only administrators may change the weight or band of key %(name)s, which has no project; "
            "its owner may lower its band."
        ) % {"name": target.name}
    return _(
        "Only administrators and the managers of %(project)s may change the weight or band of key %(name)s; "
        "its owner may lower its band."
    ) % {"project": target.project, "name": target.name}


def share_refusal(user: User | None, target: ShareTarget, *, weight: int | None = None, band: str | None = None) -> str:
    """Why `user` may not make `target`'s weight `weight` and band `band` (None: left as it is);
    empty when they may. Without `weight` and `band`: whether they may change anything of it."""
    if user is None or manages_share(user, target):
        return ""
    if isinstance(target, ApiKey) and target.user_id == user.pk and weight in (None, target.weight):
        lowers = band is None or BAND_ORDER.index(Band(band)) >= BAND_ORDER.index(Band(target.band))
        if lowers:  # its owner lowers its band (or leaves it)
            return ""
    return _refusal_text(target)


def _band_check(target: ShareTarget, band: str) -> None:
    """A band is a project's or a key's, and no key's is above its project's."""
    if isinstance(target, Organization | Team):
        raise ValidationError(
            {"band": ValidationError(_("Organisations and teams have no band: set it on a project or a key."))}
        )
    if isinstance(target, ApiKey) and target.project is not None:
        ceiling = Band(target.project.band)
        if BAND_ORDER.index(Band(band)) < BAND_ORDER.index(ceiling):
            raise ValidationError(
                {
                    "band": ValidationError(
                        _(
                            "Key %(name)s may not use a higher band than its project %(project)s, "
                            "which is limited to %(band)s."
                        )
                        % {"name": target.name, "project": target.project.name, "band": ceiling.label},
                        code="above_project",
                    )
                }
            )


def _locked[T: (Organization, Team, Project, ApiKey)](target: T) -> T:
    """The row again, locked until the transaction ends, with what the rules read of it."""
    related = {
        ApiKey: ("project__team__organization", "user"),
        Project: ("team__organization",),
        Team: ("organization",),
    }.get(type(target), ())
    # Only the row itself is locked: PostgreSQL cannot lock the nullable side of a key's project join.
    rows = type(target).objects.select_for_update(of=("self",))  # type: ignore[attr-defined]
    if related:
        rows = rows.select_related(*related)
    return rows.get(pk=target.pk)  # type: ignore[no-any-return]


@transaction.atomic
def set_share[T: (Organization, Team, Project, ApiKey)](
    target: T, *, weight: object = None, band: object = None, actor: User | None, address: str | None = None
) -> T:
    """Set the weight and, for a project or a key, the band of `target` (None: left as it is).

    1. Parse both: a ValidationError naming the field and its range, nothing saved.
    2. Lock the row and read it again, so two changes at once queue up.
    3. Refuse (PermissionDenied, saying who may) unless `actor` manages the level above it or,
       for a key, is its owner lowering its band; refuse a key's band above its project's.
    4. Save only what changed and audit it. The save bumps the gateway's table version
       (apps.gateway.signals), so every gateway process uses the new share at once.
    """
    errors: dict[str, list[str]] = {}
    values: dict[str, Any] = {}
    for name, raw, parse in (("weight", weight, parse_weight), ("band", band, parse_band)):
        if raw is None:
            continue
        try:
            values[name] = parse(raw)
        except ValidationError as error:
            errors.update(error.message_dict)
    if errors:
        raise ValidationError(errors)
    fresh = _locked(target)
    if "band" in values:
        _band_check(fresh, values["band"])
    refusal = share_refusal(actor, fresh, weight=values.get("weight"), band=values.get("band"))
    if refusal:
        raise PermissionDenied(refusal)
    before = {name: getattr(fresh, name) for name in values}
    changed = [name for name, value in values.items() if before[name] != value]
    if not changed:
        return fresh  # type: ignore[no-any-return]
    for name in changed:
        setattr(fresh, name, values[name])
    fresh.save(update_fields=changed)
    audit.record(
        actor,
        f"{_kind_of(fresh)}.share",
        fresh,
        changes=audit.diff({n: before[n] for n in changed}, {n: values[n] for n in changed}),
        address=address,
    )
    return fresh  # type: ignore[no-any-return]
