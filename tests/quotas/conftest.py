"""Builders for usage tests: an organisation tree, keys in it, and usage records."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from apps.accounts import services
from apps.accounts.models import ApiKey, Organization, Project, Team, User

_ids = itertools.count(1)


@dataclass
class Tree:
    org: Organization
    team: Team
    project: Project
    other_team: Team
    other_project: Project


@pytest.fixture
def tree(db: Any) -> Tree:
    org = services.create_organization(name="Acme", actor=None)
    team = services.create_team(org, name="Vision", actor=None)
    other_team = services.create_team(org, name="Speech", actor=None)
    return Tree(
        org=org,
        team=team,
        project=services.create_project(team, name="Search", actor=None),
        other_team=other_team,
        other_project=services.create_project(other_team, name="Dictation", actor=None),
    )


def make_key(user: User, project: Project | None = None, name: str = "ci") -> ApiKey:
    return services.create_api_key(user, name=name, project=project, actor=user).key


def recent_minute(minutes_ago: int = 5) -> datetime:
    """The start of a minute a few minutes ago, so records fall inside the default ranges."""
    return (datetime.now(UTC) - timedelta(minutes=minutes_ago)).replace(second=0, microsecond=0)


def record(key: ApiKey | None = None, **fields: Any) -> dict[str, Any]:
    """A usage record as the gateway emits it: ids, not objects."""
    project = key.project if key is not None else None
    base: dict[str, Any] = {
        "request_id": f"req_{next(_ids):08d}",
        "created_at": recent_minute() + timedelta(seconds=10),
        "user_id": key.user_id if key is not None else None,
        "api_key_id": key.pk if key is not None else None,
        "organization_id": project.team.organization_id if project else None,
        "team_id": project.team_id if project else None,
        "project_id": project.pk if project else None,
        "model": "llama-3-8b",
        "endpoint": "chat.completions",
        "replica": "r1",
        "hardware": "H100",
        "stream": True,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "tokens_estimated": False,
        "first_token_ms": 40.0,
        "total_ms": 400.0,
        "status": 200,
        "error": "",
    }
    base.update(fields)
    return base
