"""Reads about people and the organisation tree that views and the API share."""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet

from apps.accounts.access import is_administrator
from apps.accounts.models import Membership, Project

__all__ = ["projects_for_user"]


def projects_for_user(user: Any) -> QuerySet[Project]:
    """The projects a person may charge an API key to.

    Administrators: every project. Anyone else: the projects their memberships reach. A
    membership of an organisation reaches all of its projects, one of a team all of the team's,
    one of a project that project.
    """
    projects = Project.objects.select_related("team__organization")
    if is_administrator(user):
        return projects
    if user is None or not getattr(user, "is_authenticated", False):
        return projects.none()
    mine = Membership.objects.filter(user=user)
    return projects.filter(
        Q(team__organization__in=mine.filter(team__isnull=True).values("organization"))
        | Q(team__in=mine.filter(team__isnull=False, project__isnull=True).values("team"))
        | Q(pk__in=mine.filter(project__isnull=False).values("project"))
    )
