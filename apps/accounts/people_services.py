"""Changes made on the People page: who is in which branch, who may sign in, and the tree itself.

Each is atomic and audited, and nothing is half-written when one fails: a refusal is a
ValidationError raised before anything is saved, or after the inner savepoint was rolled back.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils.translation import gettext as _

from apps.accounts import audit, services
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import Membership, Organization, Project, Team, User

__all__ = [
    "add_member",
    "branch_fields",
    "create_organization",
    "create_project",
    "create_team",
    "reactivate_user",
    "remove_branch",
    "remove_member",
    "rename_branch",
    "set_capacity_quota",
    "set_rate_limit",
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


# Limits, as the People page edits them ----------------------------------------------------


@transaction.atomic
def set_rate_limit(
    owner: dict[str, Branch], values: dict[str, Any], *, actor: User | None, address: str | None = None
) -> None:
    """Make a branch's rate limit say `values` (None: no limit), changing only what differs.

    `owner` is {"organization": org}, {"team": team} or {"project": project}. A limit is created
    when the branch has none, and deleted when every value is cleared. Audited by quotas.services.
    """
    from apps.quotas import services as quotas
    from apps.quotas.models import RateLimit

    _set(
        RateLimit.objects.filter(**owner).first(),
        owner,
        values,
        create=quotas.create_rate_limit,
        update=quotas.update_rate_limit,
        delete=quotas.delete_rate_limit,
        actor=actor,
        address=address,
    )


@transaction.atomic
def set_capacity_quota(
    owner: dict[str, Branch], values: dict[str, Any], *, actor: User | None, address: str | None = None
) -> None:
    """Make a branch's capacity quota say `values` (None: no limit), as set_rate_limit does."""
    from apps.quotas import services as quotas
    from apps.quotas.models import CapacityQuota

    _set(
        CapacityQuota.objects.filter(**owner).first(),
        owner,
        values,
        create=quotas.create_capacity_quota,
        update=quotas.update_capacity_quota,
        delete=quotas.delete_capacity_quota,
        actor=actor,
        address=address,
    )


def _set(
    current: Any,
    owner: dict[str, Branch],
    values: dict[str, Any],
    *,
    create: Any,
    update: Any,
    delete: Any,
    actor: User | None,
    address: str | None,
) -> None:
    wanted = {name: value for name, value in values.items() if value is not None}
    if current is None:
        if wanted:
            create(actor=actor, address=address, **owner, **wanted)
    elif not wanted:
        delete(current, actor=actor, address=address)
    else:
        changes = {name: value for name, value in values.items() if getattr(current, name) != value}
        if changes:
            update(current, actor=actor, address=address, **changes)
