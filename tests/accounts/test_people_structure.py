"""The tree on the People page: organisations, teams and projects created, renamed and removed.

Administrators do all three (the API's rule for changing the tree); everyone else is refused.
A name follows the API's rules; a removal is refused, with what is left, while anything
depends on the branch; every change is audited.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from apps.accounts import services
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User
from apps.catalog.models import Model
from apps.quotas.models import CapacityQuota, RateLimit
from tests.accounts.test_people import actions, signed_in
from tests.conftest import make_user
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db

HTMX = {"HTTP_HX_REQUEST": "true"}


@dataclass
class Acme:
    org: Organization
    vision: Team
    speech: Team
    detector: Project
    globex: Organization


@pytest.fixture
def acme(db: Any) -> Acme:
    """Acme with teams Vision (project Detector) and Speech, and Globex beside it, all empty."""
    org = services.create_organization(name="Acme", actor=None)
    vision = services.create_team(org, name="Vision", actor=None)
    return Acme(
        org=org,
        vision=vision,
        speech=services.create_team(org, name="Speech", actor=None),
        detector=services.create_project(vision, name="Detector", actor=None),
        globex=services.create_organization(name="Globex", actor=None),
    )


def page_messages(response: Any) -> list[str]:
    return [str(message) for message in response.context["messages"]]


def event(action: str) -> AuditEvent:
    return AuditEvent.objects.get(action=action)


# Creating -----------------------------------------------------------------------------------


def test_an_administrator_creates_an_organisation_a_team_and_a_project(alice: User) -> None:
    client = signed_in(alice)
    response = client.post("/people/organizations/add", {"name": "  Initech  "})
    org = Organization.objects.get()
    assert (org.name, org.slug) == ("Initech", "initech")
    assert (response.status_code, response["Location"]) == (302, f"/people/members/?branch=org%3A{org.pk}")
    # Through htmx the whole page is fetched again, since the tree changed.
    response = client.post("/people/teams/add", {"branch": f"org:{org.pk}", "name": "Vision"}, **HTMX)
    team = Team.objects.get(organization=org)
    assert response.status_code == 200
    assert response["HX-Redirect"] == f"/people/members/?branch=team%3A{team.pk}"
    client.post("/people/projects/add", {"branch": f"team:{team.pk}", "name": "Detector"}, **HTMX)
    project = Project.objects.get(team=team)
    assert project.name == "Detector"
    assert actions(alice) == ["organization.create", "team.create", "project.create"]
    assert event("organization.create").address == "127.0.0.1"
    page = client.get(f"/people/members/?branch=project:{project.pk}")
    assert page_messages(page) == [
        "Initech created.",
        "Initech / Vision created.",
        "Initech / Vision / Detector created.",
    ]
    assert f'data-branch="project:{project.pk}"' in page.content.decode()


def test_the_tree_has_a_folded_box_for_a_new_organisation(alice: User, acme: Acme) -> None:
    page = signed_in(alice).get("/people/members/").content.decode()
    assert page.count('data-form="add-org"') == 1
    assert re.search(
        r"<details>\s*<summary[^>]*>\+ organisation</summary>\s*"
        r'<form[^>]*action="/people/organizations/add"[^>]*hx-post="/people/organizations/add"'
        r'[^>]*data-form="add-org"',
        page,
    )
    # A fresh installation starts there: no organisation yet, and the box to make the first one.
    Project.objects.all().delete()
    Team.objects.all().delete()
    Organization.objects.all().delete()
    empty = signed_in(alice).get("/people/members/").content.decode()
    assert "No organisations yet." in empty and 'data-form="add-org"' in empty


def test_a_duplicate_name_is_refused_in_the_form_that_sent_it(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    before = AuditEvent.objects.count()
    response = client.post("/people/teams/add", {"branch": f"org:{acme.org.pk}", "name": "vision"}, **HTMX)
    assert response.status_code == 200
    fragment = response.content.decode()
    # Only the folded form comes back, holding the name typed and why it was refused.
    assert fragment.lstrip().startswith('<form method="post" action="/people/teams/add"')
    assert 'data-form="add-team"' in fragment and 'value="vision"' in fragment
    assert f'<input type="hidden" name="branch" value="org:{acme.org.pk}">' in fragment
    assert re.search(r'role="alert" data-error="name">Acme already has a team named vision.</p>', fragment)
    check_body(response, check_strict(response, "add-team"), "add-team")
    # Without script: back to the page, with the reason.
    response = client.post("/people/teams/add", {"branch": f"org:{acme.org.pk}", "name": "VISION"}, follow=True)
    assert page_messages(response) == ["Acme already has a team named VISION."]
    response = client.post("/people/organizations/add", {"name": "globex"}, **HTMX)
    assert "There is already an organisation named globex." in response.content.decode()
    response = client.post("/people/projects/add", {"branch": f"team:{acme.vision.pk}", "name": "Detector "}, **HTMX)
    assert "Acme / Vision already has a project named Detector." in response.content.decode()
    assert (Team.objects.count(), Project.objects.count(), Organization.objects.count()) == (2, 1, 2)
    assert AuditEvent.objects.count() == before
    # The same name under another parent is another branch, and welcome.
    client.post("/people/teams/add", {"branch": f"org:{acme.globex.pk}", "name": "Vision"})
    assert Team.objects.filter(name="Vision").count() == 2


def test_a_blank_or_overlong_name_is_refused_with_the_numbers(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    answers = {
        ("/people/organizations/add", ""): "Give the organisation a name.",
        ("/people/teams/add", f"org:{acme.org.pk}"): "Give the team a name.",
        ("/people/projects/add", f"team:{acme.vision.pk}"): "Give the project a name.",
    }
    for (url, branch), message in answers.items():
        response = client.post(url, {"branch": branch, "name": "   "}, **HTMX)
        assert message in response.content.decode(), url
    response = client.post("/people/organizations/add", {"name": "x" * 201}, **HTMX)
    assert "A name is at most 200 characters; this one has 201." in response.content.decode()
    assert Organization.objects.count() == 2
    assert actions(alice) == []


def test_the_api_refuses_a_duplicate_name_by_the_same_rule(api: Any, alice: User, acme: Acme) -> None:
    api.force_authenticate(alice)
    response = api.post("/api/v1/teams/", {"organization": acme.org.pk, "name": "Speech"}, format="json")
    assert response.status_code == 400
    assert response.json()["errors"]["name"] == ["Acme already has a team named Speech."]
    response = api.post("/api/v1/organizations/", {"name": "ACME"}, format="json")
    assert response.json()["errors"]["name"] == ["There is already an organisation named ACME."]
    assert (
        api.post("/api/v1/teams/", {"organization": acme.globex.pk, "name": "Speech"}, format="json").status_code == 201
    )


# Renaming -----------------------------------------------------------------------------------


def test_renaming_keeps_the_row_its_slug_and_everything_attached(alice: User, bob: User, acme: Acme) -> None:
    team = acme.vision
    Membership.objects.create(user=bob, organization=acme.org, team=team, role=MembershipRole.MANAGER)
    limit = RateLimit.objects.create(team=team, requests_per_minute=60)
    quota = CapacityQuota.objects.create(team=team, gpus=4)
    model = Model.objects.create(name="detector-v2", team=team)
    key = services.create_api_key(bob, name="ci", project=acme.detector, actor=bob).key
    client = signed_in(alice)
    response = client.post(
        "/people/branches/rename", {"branch": f"team:{team.pk}", "name": "Computer Vision", "tab": "limits"}, **HTMX
    )
    assert response["HX-Redirect"] == f"/people/limits/?branch=team%3A{team.pk}"
    renamed = Team.objects.get(pk=team.pk)
    assert (renamed.name, renamed.slug, renamed.organization_id) == ("Computer Vision", "vision", acme.org.pk)
    assert Membership.objects.get(user=bob).team_id == team.pk
    assert RateLimit.objects.get(pk=limit.pk).team_id == CapacityQuota.objects.get(pk=quota.pk).team_id == team.pk
    assert Model.objects.get(pk=model.pk).team_id == team.pk
    assert ApiKey.objects.get(pk=key.pk).project.team_id == team.pk
    renamed_event = event("team.rename")
    assert (renamed_event.actor, renamed_event.target_id) == (alice, str(team.pk))
    assert renamed_event.changes == {"name": ["Vision", "Computer Vision"]}
    page = client.get(f"/people/limits/?branch=team:{team.pk}")
    assert page_messages(page) == ["Acme / Vision renamed to Acme / Computer Vision."]
    assert ">Computer Vision</a>" in page.content.decode()


def test_each_kind_is_renamed_and_audited(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    client.post("/people/branches/rename", {"branch": f"org:{acme.org.pk}", "name": "Acme Corporation"})
    client.post("/people/branches/rename", {"branch": f"project:{acme.detector.pk}", "name": "Detector 2"})
    acme.org.refresh_from_db()
    acme.detector.refresh_from_db()
    assert (acme.org.name, acme.org.slug) == ("Acme Corporation", "acme")
    assert (acme.detector.name, acme.detector.slug) == ("Detector 2", "detector")
    assert actions(alice) == ["organization.rename", "project.rename"]
    # A change of letter case alone is a rename; the same name again changes nothing.
    client.post("/people/branches/rename", {"branch": f"team:{acme.speech.pk}", "name": "SPEECH"})
    client.post("/people/branches/rename", {"branch": f"team:{acme.speech.pk}", "name": "SPEECH"})
    assert Team.objects.get(pk=acme.speech.pk).name == "SPEECH"
    assert actions(alice) == ["organization.rename", "project.rename", "team.rename"]


def test_a_rename_to_a_siblings_name_shows_the_error_in_the_panel(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    body = {"branch": f"team:{acme.speech.pk}", "name": "Vision", "tab": "members"}
    response = client.post("/people/branches/rename", body, **HTMX)
    assert response.status_code == 200
    panel = response.content.decode()
    assert panel.lstrip().startswith('<section id="panel"')
    menu = re.search(r"<details[^>]*data-branch-menu open>(.*?)</details>", panel, re.S)
    assert menu is not None, "the menu is open on the error"
    assert 'value="Vision"' in menu.group(1)
    assert 'data-error="name">Acme already has a team named Vision.</p>' in menu.group(1)
    check_body(response, check_strict(response, "rename"), "rename")
    # Without script the whole page, with the same error in the form.
    page = client.post("/people/branches/rename", {**body, "name": ""}).content.decode()
    assert "<html" in page and 'data-error="name">Give the team a name.</p>' in page
    assert Team.objects.get(pk=acme.speech.pk).name == "Speech"
    assert actions(alice) == []


# Removing -----------------------------------------------------------------------------------


def test_an_empty_branch_is_removed_with_its_limits_and_the_removal_is_audited(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    project = acme.detector
    RateLimit.objects.create(project=project, requests_per_minute=10)
    CapacityQuota.objects.create(project=project, gpus=1)
    response = client.post("/people/branches/remove", {"branch": f"project:{project.pk}", "tab": "usage"}, **HTMX)
    assert response["HX-Redirect"] == f"/people/usage/?branch=team%3A{acme.vision.pk}"
    assert not Project.objects.filter(pk=project.pk).exists()
    assert not RateLimit.objects.exists() and not CapacityQuota.objects.exists()
    assert actions(alice) == ["rate_limit.delete", "capacity_quota.delete", "project.remove"]
    removed = event("project.remove")
    assert (removed.target_id, removed.target_label) == (str(project.pk), "Acme / Vision / Detector")
    assert removed.changes == {"name": "Detector", "slug": "detector"}
    assert page_messages(client.get(f"/people/usage/?branch=team:{acme.vision.pk}")) == [
        "Acme / Vision / Detector removed."
    ]

    response = client.post("/people/branches/remove", {"branch": f"team:{acme.vision.pk}"})
    assert response["Location"] == f"/people/members/?branch=org%3A{acme.org.pk}"
    client.post("/people/branches/remove", {"branch": f"team:{acme.speech.pk}"})
    response = client.post("/people/branches/remove", {"branch": f"org:{acme.org.pk}"})
    assert response["Location"] == "/people/members/"
    assert list(Organization.objects.values_list("name", flat=True)) == ["Globex"]
    assert actions(alice)[-3:] == ["team.remove", "team.remove", "organization.remove"]


def test_removing_a_team_that_still_has_things_is_refused_with_what_is_left(
    alice: User, bob: User, charlie: User, acme: Acme
) -> None:
    team = acme.vision
    Membership.objects.create(user=bob, organization=acme.org, team=team)
    Membership.objects.create(user=charlie, organization=acme.org, team=team, project=acme.detector)
    Model.objects.create(name="detector-v2", team=team)
    Model.objects.create(name="detector-v3", project=acme.detector)
    for name in ("ci", "laptop", "old"):
        services.create_api_key(bob, name=name, project=acme.detector, actor=bob)
    client = signed_in(alice)
    before = AuditEvent.objects.count()
    reason = "Team Vision cannot be removed: it still has 1 project, 2 members, 2 models and 3 API keys."
    response = client.post("/people/branches/remove", {"branch": f"team:{team.pk}", "tab": "members"}, **HTMX)
    assert response.status_code == 200
    panel = response.content.decode()
    assert panel.lstrip().startswith('<section id="panel"') and f'data-panel="team:{team.pk}"' in panel
    assert f'role="alert">{reason}</p>' in panel
    # Without script: back to the team, with the same reason.
    response = client.post("/people/branches/remove", {"branch": f"team:{team.pk}"}, follow=True)
    assert page_messages(response) == [reason]
    assert Team.objects.filter(pk=team.pk).exists() and Membership.objects.count() == 2
    assert AuditEvent.objects.count() == before
    with pytest.raises(ValidationError, match="it still has 1 project"):
        services.remove_team(team, actor=alice)


def test_each_kind_names_what_stops_its_removal(alice: User, bob: User, acme: Acme) -> None:
    client = signed_in(alice)
    Membership.objects.create(user=bob, organization=acme.org)
    services.create_api_key(bob, name="ci", project=acme.detector, actor=bob)
    Model.objects.create(name="acme-chat", organization=acme.org)

    def refusal(key: str) -> str:
        panel = client.post("/people/branches/remove", {"branch": key}, **HTMX).content.decode()
        found = re.search(r'role="alert">([^<]*)</p>', panel)
        assert found, panel
        return found.group(1)

    assert refusal(f"org:{acme.org.pk}") == (
        "Organisation Acme cannot be removed: it still has 2 teams, 1 project, 1 member, 1 model and 1 API key."
    )
    assert refusal(f"project:{acme.detector.pk}") == "Project Detector cannot be removed: it still has 1 API key."
    # A revoked key still names its project, so it counts until it is gone.
    services.revoke_api_key(ApiKey.objects.get(), actor=bob)
    assert refusal(f"project:{acme.detector.pk}") == "Project Detector cannot be removed: it still has 1 API key."
    assert (Organization.objects.count(), Project.objects.count()) == (2, 1)


def test_the_remove_button_asks_first_and_the_menu_is_for_administrators(alice: User, viola: User, acme: Acme) -> None:
    panel = signed_in(alice).get(f"/people/members/?branch=team:{acme.vision.pk}", **HTMX).content.decode()
    menu = re.search(r"<details[^>]*data-branch-menu>(.*?)</details>", panel, re.S)
    assert menu is not None
    assert "⋯</summary>" in menu.group(1)
    remove = re.search(r'<form[^>]*hx-post="/people/branches/remove"[^>]*>', menu.group(1))
    assert remove is not None
    assert (
        'hx-confirm="Remove the team Vision? Its limits and capacity quota go with it; its usage history '
        'stays. This cannot be undone."'
    ) in remove.group(0)
    assert re.search(r'class="btn-danger[^"]*">Remove team<', menu.group(1))
    assert 'data-form="rename-branch"' in menu.group(1) and 'value="Vision"' in menu.group(1)
    # Staff who only read see the tree, without these.
    page = signed_in(viola).get(f"/people/members/?branch=team:{acme.vision.pk}").content.decode()
    assert "data-branch-menu" not in page and 'data-form="add-org"' not in page


# Who may ------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [StaffRole.VIEWER, StaffRole.BILLING, StaffRole.OPERATOR, "manager"])
def test_nobody_but_an_administrator_changes_the_tree(role: str, acme: Acme) -> None:
    if role == "manager":  # manages Vision, and may change its members, not the tree
        person = make_user("mona@example.com")
        Membership.objects.create(user=person, organization=acme.org, team=acme.vision, role=MembershipRole.MANAGER)
    else:
        person = make_user(f"{role}@example.com", role=role)
    client = signed_in(person)
    before = AuditEvent.objects.count()
    for url, body in (
        ("/people/organizations/add", {"name": "Initech"}),
        ("/people/teams/add", {"branch": f"org:{acme.org.pk}", "name": "Ops"}),
        ("/people/branches/rename", {"branch": f"team:{acme.vision.pk}", "name": "Mine"}),
        ("/people/branches/remove", {"branch": f"project:{acme.detector.pk}"}),
    ):
        for headers in ({}, HTMX):
            assert client.post(url, body, **headers).status_code == 403, (role, url)
    assert AuditEvent.objects.count() == before
    assert Team.objects.get(pk=acme.vision.pk).name == "Vision" and Project.objects.filter(pk=acme.detector.pk)
    assert (
        Client().post("/people/branches/remove", {"branch": f"org:{acme.globex.pk}"})["Location"].startswith("/login/")
    )


def test_an_unknown_branch_is_404(alice: User, acme: Acme) -> None:
    client = signed_in(alice)
    for url in ("/people/branches/rename", "/people/branches/remove"):
        for key in ("team:999", "org:x", ""):
            assert client.post(url, {"branch": key, "name": "X"}).status_code == 404, (url, key)
    assert client.get("/people/branches/remove").status_code == 405
