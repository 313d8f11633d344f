"""Reads for the People page (/people/) and the managers' page (/org/): the organisation tree,
one branch and its members, narrowed to what each person may see (the limits and usage tabs
are the quotas app's: apps.quotas.people).

A branch is named by a key, "org:1", "team:3" or "project:7". Staff who read everything see
every branch; a manager sees the branches they manage and everything under them. A branch
that does not exist and one a person may not see are the same 404.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.db.models import F, Prefetch, Q
from django.http import Http404
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.accounts.choices import MembershipRole
from apps.accounts.models import Membership, Organization, Project, Team, User
from llmgw.ids import parse_id

__all__ = [
    "EVERYTHING",
    "Branch",
    "MemberRow",
    "Scope",
    "TreeRow",
    "default_branch_key",
    "get_branch",
    "get_branch_for_user",
    "member_rows",
    "scope_for",
    "tree_rows",
]

KINDS: dict[str, type[Organization] | type[Team] | type[Project]] = {
    "org": Organization,
    "team": Team,
    "project": Project,
}
KIND_LABELS = {"org": gettext_lazy("Organisation"), "team": gettext_lazy("Team"), "project": gettext_lazy("Project")}


@dataclass(frozen=True)
class Branch:
    """One organisation, team or project, as the page names and shows it."""

    kind: str  # "org", "team" or "project"
    obj: Organization | Team | Project

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.obj.pk}"

    @property
    def name(self) -> str:
        return self.obj.name

    @property
    def path(self) -> str:
        """ "Acme / Research / Search": the branch with every branch above it."""
        return str(self.obj)

    @property
    def kind_label(self) -> str:
        return str(KIND_LABELS[self.kind])

    @property
    def owner(self) -> dict[str, Any]:
        """The owner field of its RateLimit and CapacityQuota."""
        return {{"org": "organization"}.get(self.kind, self.kind): self.obj}

    @property
    def usage_within(self) -> dict[str, int]:
        """The usage rollup column that holds it."""
        return {{"org": "organization_id", "team": "team_id", "project": "project_id"}[self.kind]: self.obj.pk}

    @property
    def members_filter(self) -> Q:
        """Memberships of exactly this branch (not of the branches under it)."""
        if self.kind == "project":
            return Q(project=self.obj)
        if self.kind == "team":
            return Q(team=self.obj, project__isnull=True)
        return Q(organization=self.obj, team__isnull=True)


# Who sees which branches ------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """The branches a person may see: everything, or those they manage and what is under them."""

    everything: bool = False
    org_ids: frozenset[int] = frozenset()
    team_ids: frozenset[int] = frozenset()
    project_ids: frozenset[int] = frozenset()

    def covers(self, branch: Branch) -> bool:
        if self.everything:
            return True
        obj = branch.obj
        if isinstance(obj, Organization):
            return obj.pk in self.org_ids
        if isinstance(obj, Team):
            return obj.pk in self.team_ids or obj.organization_id in self.org_ids
        return obj.pk in self.project_ids or obj.team_id in self.team_ids or obj.team.organization_id in self.org_ids


EVERYTHING = Scope(everything=True)


def scope_for(user: User) -> Scope:
    """The branches `user` manages, with everything under them."""
    orgs: set[int] = set()
    teams: set[int] = set()
    projects: set[int] = set()
    for org_id, team_id, project_id in Membership.objects.filter(user=user, role=MembershipRole.MANAGER).values_list(
        "organization_id", "team_id", "project_id"
    ):
        if project_id:
            projects.add(project_id)
        elif team_id:
            teams.add(team_id)
        else:
            orgs.add(org_id)
    return Scope(org_ids=frozenset(orgs), team_ids=frozenset(teams), project_ids=frozenset(projects))


def get_branch(key: str | None) -> Branch | None:
    """The branch a key names, or None when the key is malformed or names nothing."""
    kind, _sep, text = (key or "").partition(":")
    number = parse_id(text)
    if kind not in KINDS or number is None:
        return None
    if kind == "project":
        obj: Organization | Team | Project | None = (
            Project.objects.select_related("team__organization").filter(pk=number).first()
        )
    elif kind == "team":
        obj = Team.objects.select_related("organization").filter(pk=number).first()
    else:
        obj = Organization.objects.filter(pk=number).first()
    return Branch(kind, obj) if obj is not None else None


def get_branch_for_user(scope: Scope, key: str | None) -> Branch:
    """The branch a key names, if the scope covers it; 404 otherwise, whichever the reason."""
    branch = get_branch(key)
    if branch is None or not scope.covers(branch):
        raise Http404(_("No such organisation, team or project."))
    return branch


# The tree ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreeRow:
    """One line of the tree: a branch, or the folded form adding a team or a project under one."""

    kind: str  # "org", "team", "project", "add-team", "add-project"
    key: str  # the branch's key; for an add row, its parent's
    label: str
    title: str  # the whole path, shown on hover
    depth: int

    @property
    def is_branch(self) -> bool:
        return self.kind in KINDS


def tree_rows(scope: Scope, *, can_add: bool) -> list[TreeRow]:
    """Organisations, their teams and the teams' projects, in three queries, as indented lines.

    For a manager the roots are the highest branches they manage. `can_add` adds the folded
    "+ team" line under every organisation and "+ project" under every team.
    """
    orgs = Organization.objects.order_by("name", "pk")
    teams = Team.objects.select_related("organization").order_by("organization__name", "name", "pk")
    projects = Project.objects.select_related("team__organization").order_by("name", "pk")
    if not scope.everything:
        orgs = orgs.filter(pk__in=scope.org_ids)
        teams = teams.filter(Q(organization_id__in=scope.org_ids) | Q(pk__in=scope.team_ids))
        projects = projects.filter(
            Q(team__organization_id__in=scope.org_ids) | Q(team_id__in=scope.team_ids) | Q(pk__in=scope.project_ids)
        )
    org_list = list(orgs)
    team_list = list(teams)
    org_ids = {org.pk for org in org_list}
    team_ids = {team.pk for team in team_list}
    teams_of: dict[int, list[Team]] = defaultdict(list)
    projects_of: dict[int, list[Project]] = defaultdict(list)
    root_projects: list[Project] = []
    for team in team_list:
        teams_of[team.organization_id].append(team)
    for project in projects:
        if project.team_id in team_ids:
            projects_of[project.team_id].append(project)
        else:
            root_projects.append(project)

    rows: list[TreeRow] = []

    def add_team(team: Team, depth: int) -> None:
        rows.append(TreeRow("team", f"team:{team.pk}", team.name if depth else str(team), str(team), depth))
        for project in projects_of[team.pk]:
            rows.append(TreeRow("project", f"project:{project.pk}", project.name, str(project), depth + 1))
        if can_add:
            rows.append(TreeRow("add-project", f"team:{team.pk}", "", str(team), depth + 1))

    for org in org_list:
        rows.append(TreeRow("org", f"org:{org.pk}", org.name, org.name, 0))
        for team in teams_of[org.pk]:
            add_team(team, 1)
        if can_add:
            rows.append(TreeRow("add-team", f"org:{org.pk}", "", org.name, 1))
    for team in team_list:
        if team.organization_id not in org_ids:
            add_team(team, 0)
    for project in sorted(root_projects, key=str):
        rows.append(TreeRow("project", f"project:{project.pk}", str(project), str(project), 0))
    return rows


def default_branch_key(rows: list[TreeRow]) -> str | None:
    return next((row.key for row in rows if row.is_branch), None)


# Members -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemberRow:
    """One member of a branch, with every place the person has in the tree."""

    membership: Membership
    places: list[str]

    @property
    def user(self) -> User:
        return self.membership.user

    @property
    def shown(self) -> list[str]:
        return self.places[:2]

    @property
    def more(self) -> list[str]:
        return self.places[2:]

    @property
    def shown_text(self) -> str:
        return ", ".join(self.shown)

    @property
    def more_text(self) -> str:
        return ", ".join(self.more)

    @property
    def places_text(self) -> str:
        return ", ".join(self.places)


def _place(membership: Membership) -> str:
    parts = [membership.organization.name]
    if membership.team is not None:
        parts.append(membership.team.name)
    if membership.project is not None:
        parts.append(membership.project.name)
    place = " / ".join(parts)
    if membership.role == MembershipRole.MANAGER:
        return _("%(place)s (manager)") % {"place": place}
    return place


def member_rows(branch: Branch) -> list[MemberRow]:
    """The branch's own members by email, each with all their memberships: two queries."""
    # A branch before what is inside it, on every database (PostgreSQL sorts NULL last, SQLite first).
    everywhere = Membership.objects.select_related("organization", "team", "project").order_by(
        "organization__name", F("team__name").asc(nulls_first=True), F("project__name").asc(nulls_first=True), "pk"
    )
    memberships = (
        Membership.objects.filter(branch.members_filter)
        .select_related("user")
        .prefetch_related(Prefetch("user__memberships", queryset=everywhere))
        .order_by("user__email")
    )
    return [MemberRow(m, [_place(place) for place in m.user.memberships.all()]) for m in memberships]
