"""The API keys page: create with a project, allowed models and an expiry; list; revoke."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import ApiKey, AuditEvent, Membership, Project, User
from apps.catalog.models import Model

pytestmark = pytest.mark.django_db

PAGE = "/account/keys/"


def make_project(name: str = "Search", *, team: str = "Platform", org: str = "Acme") -> Project:
    organization = services.create_organization(name=org, actor=None)
    return services.create_project(services.create_team(organization, name=team, actor=None), name=name, actor=None)


def join(user: User, project: Project, *, level: str = "project") -> Membership:
    """Make `user` a member of the project itself, or of its team or organisation."""
    team = project.team
    if level == "organization":
        return Membership.objects.create(user=user, organization=team.organization)
    if level == "team":
        return Membership.objects.create(user=user, organization=team.organization, team=team)
    return Membership.objects.create(user=user, organization=team.organization, team=team, project=project)


@pytest.fixture
def models(db: Any) -> list[Model]:
    return [Model.objects.create(name=name) for name in ("qwen3-32b", "llama-3.3-70b", "gemma-3-27b")]


def new_secret(response: Any) -> str:
    match = re.search(rb'id="new-key">(llmgw_[^<]+)<', response.content)
    assert match, response.content[:2000]
    return match.group(1).decode()


def test_it_creates_a_key_for_a_project_and_some_models_and_shows_it_once(client: Client, bob, models) -> None:
    project = make_project()
    join(bob, project)
    client.force_login(bob)
    response = client.post(
        PAGE, {"name": "ci", "project": project.pk, "expires": "90", "allowed_models": ["qwen3-32b", "gemma-3-27b"]}
    )
    assert response.status_code == 200
    secret = new_secret(response)
    key = ApiKey.objects.get(user=bob)
    assert key.name == "ci"
    assert key.project == project
    assert key.allowed_models == ["gemma-3-27b", "qwen3-32b"]
    assert key.expires_at is not None
    assert 89 <= (key.expires_at - timezone.now()).days <= 90
    assert AuditEvent.objects.filter(action="api_key.create", actor=bob).count() == 1

    page = client.get(PAGE).content.decode()
    assert secret not in page
    row = re.search(rf'<tr data-key="{key.pk}">(.*?)</tr>', page, re.S).group(1)
    assert key.prefix in row
    assert str(project) in row
    assert "gemma-3-27b, qwen3-32b" in row
    assert '<td data-field="last_used">-</td>' in row
    assert "active" in row


def test_without_a_project_or_models_the_key_may_use_every_model(client: Client, bob, models) -> None:
    client.force_login(bob)
    response = client.post(PAGE, {"name": "laptop", "project": "", "expires": ""})
    new_secret(response)
    key = ApiKey.objects.get(user=bob)
    assert (key.project, key.allowed_models, key.expires_at) == (None, [], None)
    row = re.search(rf'<tr data-key="{key.pk}">(.*?)</tr>', client.get(PAGE).content.decode(), re.S).group(1)
    assert '<td class="clip" data-field="project">-</td>' in row
    assert '<td class="clip" data-field="allowed_models">all</td>' in row


def test_the_list_says_when_a_key_was_last_used(client: Client, bob, key_for) -> None:
    key_for(bob, name="used")
    used = ApiKey.objects.get(user=bob)
    ApiKey.objects.filter(pk=used.pk).update(last_used_at=timezone.now())
    client.force_login(bob)
    row = re.search(rf'<tr data-key="{used.pk}">(.*?)</tr>', client.get(PAGE).content.decode(), re.S).group(1)
    assert '<td data-field="last_used">-</td>' not in row


def test_the_project_choice_lists_only_the_persons_projects(client: Client, bob, charlie) -> None:
    mine, theirs = make_project("Mine"), make_project("Theirs", team="Other", org="Globex")
    join(bob, mine)
    client.force_login(bob)
    page = client.get(PAGE).content.decode()
    assert f'<option value="{mine.pk}">' in page
    assert f'<option value="{theirs.pk}">' not in page


def test_a_person_cannot_pick_a_project_they_are_not_in(client: Client, bob, charlie) -> None:
    project = make_project()
    join(bob, project)
    client.force_login(charlie)
    response = client.post(PAGE, {"name": "sneaky", "project": project.pk, "expires": "30"})
    assert response.status_code == 200
    assert b'data-error="project"' in response.content
    assert "You are not a member of this project." in response.content.decode()
    assert b'id="new-key"' not in response.content
    assert not ApiKey.objects.exists()
    assert not AuditEvent.objects.filter(action="api_key.create").exists()


@pytest.mark.parametrize("level", ["organization", "team", "project"])
def test_a_membership_reaches_the_projects_below_it(client: Client, bob, level: str) -> None:
    project = make_project()
    join(bob, project, level=level)
    client.force_login(bob)
    new_secret(client.post(PAGE, {"name": level, "project": project.pk, "expires": "30"}))
    assert ApiKey.objects.get(user=bob).project == project


def test_an_administrator_may_pick_any_project(client: Client, alice) -> None:
    project = make_project()
    client.force_login(alice)
    new_secret(client.post(PAGE, {"name": "ops", "project": project.pk, "expires": "30"}))
    assert ApiKey.objects.get(user=alice).project == project


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"name": "   ", "expires": "30"}, "name"),
        ({"name": "x" * 201, "expires": "30"}, "name"),
        ({"name": "ci", "expires": "12"}, "expires"),
        ({"name": "ci", "expires": "30", "allowed_models": ["qwen3-32b", "no-such-model"]}, "allowed_models"),
        ({"name": "ci", "expires": "30", "project": "not-a-number"}, "project"),
        ({"name": "ci", "expires": "30", "project": "999999"}, "project"),
    ],
)
def test_a_bad_form_says_why_and_writes_nothing(client: Client, bob, models, data: dict[str, Any], field: str) -> None:
    client.force_login(bob)
    response = client.post(PAGE, data)
    assert response.status_code == 200
    assert f'data-error="{field}"'.encode() in response.content
    assert b'id="new-key"' not in response.content
    assert not ApiKey.objects.exists()
    assert not AuditEvent.objects.exists()


def test_a_bad_form_keeps_what_was_typed(client: Client, bob, models) -> None:
    client.force_login(bob)
    page = client.post(PAGE, {"name": "ci", "expires": "90", "allowed_models": ["gemma-3-27b", "nope"]}).content
    assert b'value="ci"' in page
    assert b'<option value="90" selected>' in page
    assert b'<option value="gemma-3-27b" selected>' in page


def test_revoking_stops_the_key_and_comes_back_to_the_list(client: Client, bob, key_for) -> None:
    key_for(bob, name="old")
    key = ApiKey.objects.get(user=bob)
    client.force_login(bob)
    response = client.post(PAGE, {"revoke": key.pk})
    assert response.status_code == 302
    assert response["Location"] == PAGE
    key.refresh_from_db()
    assert key.revoked_at is not None
    row = re.search(rf'<tr data-key="{key.pk}">(.*?)</tr>', client.get(PAGE).content.decode(), re.S).group(1)
    assert "revoked" in row
    assert 'name="revoke"' not in row


@pytest.mark.parametrize("value", ["bobs", "abc", ""])
def test_nobody_revokes_a_key_that_is_not_theirs(client: Client, bob, charlie, key_for, value: str) -> None:
    key_for(bob)
    key = ApiKey.objects.get(user=bob)
    client.force_login(charlie)
    assert client.post(PAGE, {"revoke": key.pk if value == "bobs" else value}).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


def test_strangers_are_sent_to_sign_in(client: Client) -> None:
    response = client.get(PAGE)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")
    assert client.post(PAGE, {"name": "x"}).status_code == 302
    assert not ApiKey.objects.exists()


def test_the_list_costs_the_same_queries_for_one_key_or_many(client: Client, bob, key_for) -> None:
    project = make_project()
    join(bob, project)
    client.force_login(bob)
    key_for(bob, project=project)
    client.get(PAGE)
    with CaptureQueriesContext(connection) as one:
        client.get(PAGE)
    for _ in range(4):
        key_for(bob, project=project, allowed_models=["qwen3-32b"])
    with CaptureQueriesContext(connection) as five:
        client.get(PAGE)
    assert len(five) == len(one)
