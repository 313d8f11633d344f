from __future__ import annotations

import pytest
from django.db import IntegrityError, transaction

from apps.accounts import services
from apps.accounts.models import AuditEvent, Membership

pytestmark = pytest.mark.django_db


def test_staff_build_the_tree_and_each_step_is_audited(api, alice) -> None:
    api.force_authenticate(alice)
    org = api.post("/api/v1/organizations/", {"name": "Acme Research"}, format="json").json()
    assert org["slug"] == "acme-research"
    team = api.post("/api/v1/teams/", {"organization": org["id"], "name": "Vision"}, format="json").json()
    project = api.post("/api/v1/projects/", {"team": team["id"], "name": "Detector"}, format="json").json()
    assert project["slug"] == "detector"
    actions = set(AuditEvent.objects.filter(actor=alice).values_list("action", flat=True))
    assert {"organization.create", "team.create", "project.create"} <= actions


def test_a_viewer_reads_the_tree_but_cannot_change_it(api, viola, alice) -> None:
    services.create_organization(name="Acme", actor=alice)
    api.force_authenticate(viola)
    assert api.get("/api/v1/organizations/").status_code == 200
    assert api.post("/api/v1/organizations/", {"name": "Other"}, format="json").status_code == 403


def test_people_without_a_staff_role_cannot_list_organisations(api, bob) -> None:
    api.force_authenticate(bob)
    assert api.get("/api/v1/organizations/").status_code == 403


def test_a_duplicate_slug_is_a_field_error_not_a_crash(api, alice) -> None:
    api.force_authenticate(alice)
    api.post("/api/v1/organizations/", {"name": "Acme", "slug": "acme"}, format="json")
    response = api.post("/api/v1/organizations/", {"name": "Acme 2", "slug": "acme"}, format="json")
    assert response.status_code == 400
    assert "slug" in response.json()["errors"]


def test_a_person_has_one_membership_per_branch(bob, alice) -> None:
    org = services.create_organization(name="Acme", actor=alice)
    team = services.create_team(org, name="Vision", actor=alice)
    Membership.objects.create(user=bob, organization=org)
    Membership.objects.create(user=bob, organization=org, team=team)
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(user=bob, organization=org)
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(user=bob, organization=org, team=team)


def test_a_project_membership_must_name_its_team(bob, alice) -> None:
    org = services.create_organization(name="Acme", actor=alice)
    team = services.create_team(org, name="Vision", actor=alice)
    project = services.create_project(team, name="Detector", actor=alice)
    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(user=bob, organization=org, project=project)


def test_the_first_administrator_is_created_once(db) -> None:
    created = services.ensure_first_admin("root@example.com")
    assert created is not None
    user, password = created
    assert user.check_password(password)
    assert password not in user.password
    assert services.ensure_first_admin("root@example.com") is None
