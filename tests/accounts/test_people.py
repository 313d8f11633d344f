"""The People page: the tree, a panel per branch in three tabs, and the changes made from it."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.utils import timezone

from apps.accounts import people_services
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership, Organization, Project, Team, User
from apps.quotas.models import CapacityQuota, RateLimit
from apps.quotas.usage import write_records_sync
from tests.conftest import make_user
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db


# Builders ----------------------------------------------------------------------------------


@dataclass
class Tree:
    orgs: list[Organization]
    teams: list[Team]
    projects: list[Project]


def make_tree(orgs: int = 2, teams: int = 2, projects: int = 2) -> Tree:
    """Orgs "Org 0".., each with teams "Team 0".., each with projects "Project 0"..."""
    tree = Tree([], [], [])
    for o in range(orgs):
        org = Organization.objects.create(name=f"Org {o}", slug=f"org-{o}")
        tree.orgs.append(org)
        for t in range(teams):
            team = Team.objects.create(organization=org, name=f"Team {o}{t}", slug=f"team-{t}")
            tree.teams.append(team)
            for p in range(projects):
                tree.projects.append(Project.objects.create(team=team, name=f"Project {o}{t}{p}", slug=f"p-{p}"))
    return tree


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def actions(actor: User) -> list[str]:
    return list(AuditEvent.objects.filter(actor=actor).order_by("id").values_list("action", flat=True))


def cell(html: str, row: str, column: str) -> str:
    """The text of one usage cell: the row labelled `row`, the column `column`."""
    match = re.search(rf'<tr[^>]*data-row="{re.escape(row)}".*?data-col="{column}"[^>]*>([^<]*)<', html, re.S)
    assert match, f"no cell {column} in row {row}"
    return match.group(1).strip()


@pytest.fixture
def tree(db: Any) -> Tree:
    return make_tree()


@pytest.fixture
def billing(db: Any) -> User:
    return make_user("billing@example.com", role=StaffRole.BILLING, name="Bill")


@pytest.fixture
def manager(tree: Tree) -> User:
    """Manages Team 00 in Org 0, and nothing else."""
    person = make_user("manager@example.com", name="Mona")
    Membership.objects.create(user=person, organization=tree.orgs[0], team=tree.teams[0], role=MembershipRole.MANAGER)
    return person


# Administrators ----------------------------------------------------------------------------


def test_an_administrator_adds_and_removes_members(alice: User, bob: User, tree: Tree) -> None:
    client = signed_in(alice)
    team = tree.teams[1]
    response = client.post(
        "/people/members/add", {"branch": f"team:{team.pk}", "email": "BOB@example.com", "role": "manager"}
    )
    assert response.status_code == 302
    assert response["Location"] == f"/people/members/?branch=team%3A{team.pk}"
    membership = Membership.objects.get(user=bob)
    assert (membership.organization_id, membership.team_id, membership.project_id, membership.role) == (
        team.organization_id,
        team.pk,
        None,
        "manager",
    )

    page = client.get(f"/people/members/?branch=team:{team.pk}").content.decode()
    assert 'data-member="bob@example.com"' in page

    response = client.post(f"/people/members/{membership.pk}/remove")
    assert response.status_code == 302
    assert not Membership.objects.filter(user=bob).exists()
    assert actions(alice) == ["membership.add", "membership.remove"]
    added = AuditEvent.objects.get(action="membership.add")
    assert added.changes == {"user": "bob@example.com", "branch": f"team:{team.pk}", "role": "manager"}


def test_an_administrator_creates_a_team_and_a_project(alice: User, tree: Tree) -> None:
    client = signed_in(alice)
    org = tree.orgs[0]
    response = client.post("/people/teams/add", {"branch": f"org:{org.pk}", "name": "Vision"})
    team = Team.objects.get(name="Vision")
    assert (team.organization, team.slug) == (org, "vision")
    assert response["Location"] == f"/people/members/?branch=team%3A{team.pk}"
    client.post("/people/projects/add", {"branch": f"team:{team.pk}", "name": "Detector"})
    assert Project.objects.get(name="Detector").team == team
    assert actions(alice) == ["team.create", "project.create"]
    # A project under an organisation, or a nameless team, is refused.
    assert client.post("/people/projects/add", {"branch": f"org:{org.pk}", "name": "X"}).status_code == 404
    client.post("/people/teams/add", {"branch": f"org:{org.pk}", "name": "  "})
    assert actions(alice) == ["team.create", "project.create"]


def test_the_tree_folds_the_new_team_and_project_boxes(alice: User, tree: Tree) -> None:
    page = signed_in(alice).get("/people/members/").content.decode()
    assert page.count('data-form="add-team"') == len(tree.orgs)
    assert page.count('data-form="add-project"') == len(tree.teams)
    # Each box is inside a <details> whose summary is the "+ team" / "+ project" link.
    assert re.search(r'<details>\s*<summary[^>]*>\+ team</summary>\s*<form[^>]*data-form="add-team"', page)
    assert re.search(r'<details>\s*<summary[^>]*>\+ project</summary>\s*<form[^>]*data-form="add-project"', page)


def test_an_administrator_suspends_and_reactivates_a_person(alice: User, bob: User, tree: Tree) -> None:
    client = signed_in(alice)
    Membership.objects.create(user=bob, organization=tree.orgs[0])
    branch = f"org:{tree.orgs[0].pk}"
    response = client.post(f"/people/users/{bob.pk}/suspend", {"branch": branch}, HTTP_HX_REQUEST="true")
    assert response.status_code == 200
    bob.refresh_from_db()
    assert not bob.is_active
    panel = response.content.decode()
    assert 'data-state="suspended"' in panel and 'data-form="reactivate"' in panel
    # Suspended people cannot sign in.
    assert (
        Client()
        .post("/login/", {"username": "bob@example.com", "password": "correct horse battery"})
        .wsgi_request.user.is_anonymous
    )

    client.post(f"/people/users/{bob.pk}/reactivate", {"branch": branch})
    bob.refresh_from_db()
    assert bob.is_active
    assert actions(alice) == ["user.suspend", "user.reactivate"]
    assert AuditEvent.objects.get(action="user.suspend").changes == {"is_active": [True, False]}


def test_the_last_administrator_cannot_be_suspended(alice: User, bob: User, tree: Tree) -> None:
    client = signed_in(alice)
    Membership.objects.create(user=alice, organization=tree.orgs[0])
    response = client.post(
        f"/people/users/{alice.pk}/suspend", {"branch": f"org:{tree.orgs[0].pk}"}, HTTP_HX_REQUEST="true"
    )
    assert "only active administrator" in response.content.decode()
    alice.refresh_from_db()
    assert alice.is_active
    with pytest.raises(ValidationError, match="only active administrator"):
        people_services.suspend_user(alice, actor=alice)
    assert actions(alice) == []
    # With a second administrator, either may be suspended.
    other = make_user("root@example.com", role=StaffRole.ADMIN)
    people_services.suspend_user(other, actor=alice)
    with pytest.raises(ValidationError):
        people_services.suspend_user(alice, actor=alice)


def test_suspend_and_remove_are_red_and_behind_a_menu(alice: User, bob: User, tree: Tree) -> None:
    Membership.objects.create(user=bob, organization=tree.orgs[0])
    panel = (
        signed_in(alice).get(f"/people/members/?branch=org:{tree.orgs[0].pk}", HTTP_HX_REQUEST="true").content.decode()
    )
    menu = re.search(r"<details[^>]*data-menu>(.*?)</details>", panel, re.S)
    assert menu is not None
    assert "⋯</summary>" in menu.group(1)
    assert re.search(r'class="btn-danger[^"]*">Suspend<', menu.group(1))
    assert re.search(r'class="btn-danger[^"]*">Remove from this branch<', menu.group(1))
    # The add-to picker and its button are on one line.
    picker = re.search(r'data-form="add-member".*?<div class="([^"]*)">(.*?)</div>', panel, re.S)
    assert picker is not None and "flex-nowrap" in picker.group(1)
    assert 'name="email"' in picker.group(2) and 'name="role"' in picker.group(2) and "<button" in picker.group(2)


def test_adding_a_person_twice_is_a_form_error_and_writes_nothing(alice: User, bob: User, tree: Tree) -> None:
    client = signed_in(alice)
    body = {"branch": f"org:{tree.orgs[0].pk}", "email": "bob@example.com", "role": "member"}
    client.post("/people/members/add", body)
    events = AuditEvent.objects.count()
    for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
        response = client.post("/people/members/add", body, **headers)
        assert response.status_code == 200
        assert "bob@example.com is already a member of Org 0." in response.content.decode()
        assert Membership.objects.filter(user=bob).count() == 1
        assert AuditEvent.objects.count() == events
    with pytest.raises(ValidationError):
        people_services.add_member(tree.orgs[0], bob, "member", actor=alice)
    # An address nobody has is a form error too.
    response = client.post("/people/members/add", {**body, "email": "nobody@example.com"})
    assert "No account has the address nobody@example.com." in response.content.decode()


def test_memberships_show_two_and_a_count(alice: User, bob: User, tree: Tree) -> None:
    Membership.objects.create(user=bob, organization=tree.orgs[0])
    Membership.objects.create(user=bob, organization=tree.orgs[0], team=tree.teams[0], role=MembershipRole.MANAGER)
    Membership.objects.create(user=bob, organization=tree.orgs[1])
    Membership.objects.create(user=bob, organization=tree.orgs[1], team=tree.teams[2], project=tree.projects[4])
    panel = (
        signed_in(alice).get(f"/people/members/?branch=org:{tree.orgs[0].pk}", HTTP_HX_REQUEST="true").content.decode()
    )
    row = re.search(r'data-col="memberships">(.*?)</td>', panel, re.S)
    assert row is not None
    assert ">Org 0, Org 0 / Team 00 (manager)</span>" in row.group(1)
    assert 'title="Org 1, Org 1 / Team 10 / Project 100">+2 more</span>' in row.group(1)


def test_an_administrator_at_org_is_sent_to_the_people_page(alice: User, tree: Tree) -> None:
    client = signed_in(alice)
    team = tree.teams[0]
    response = client.get(f"/org/?branch=team:{team.pk}")
    assert (response.status_code, response["Location"]) == (302, f"/people/members/?branch=team%3A{team.pk}")
    assert client.get(f"/org/usage/?branch=team:{team.pk}")["Location"] == f"/people/usage/?branch=team%3A{team.pk}"
    assert client.get("/people/")["Location"] == "/people/members/"


def test_an_unknown_branch_is_404(alice: User, tree: Tree) -> None:
    client = signed_in(alice)
    for key in ("team:999", "org:x", "fleet:1", "project:"):
        assert client.get(f"/people/members/?branch={key}").status_code == 404, key


# The panel ---------------------------------------------------------------------------------


def test_the_htmx_request_returns_only_the_panel(alice: User, tree: Tree) -> None:
    client = signed_in(alice)
    team = tree.teams[0]
    for tab in ("members", "limits", "usage"):
        url = f"/people/{tab}/?branch=team:{team.pk}"
        fragment = client.get(url, HTTP_HX_REQUEST="true").content.decode()
        assert fragment.lstrip().startswith(f'<section id="panel" class="min-w-0 flex-1" data-tab="{tab}"')
        assert "<html" not in fragment and "data-tree" not in fragment
        page = client.get(url).content.decode()
        assert "<html" in page and "data-tree" in page and f'data-panel="team:{team.pk}"' in page
    # Every branch in the tree is a link that works without script and swaps the panel with it.
    page = client.get("/people/limits/").content.decode()
    key = f"team:{team.pk}"
    assert (
        f'<a href="/people/limits/?branch={key}" hx-get="/people/limits/?branch={key}" '
        f'hx-target="#panel" hx-swap="outerHTML" hx-push-url="true"'
    ) in page


def test_billing_changes_a_limit_but_not_members(billing: User, bob: User, tree: Tree) -> None:
    client = signed_in(billing)
    team = tree.teams[0]
    panel = client.get(f"/people/limits/?branch=team:{team.pk}", HTTP_HX_REQUEST="true").content.decode()
    assert 'data-form="rate-limit"' in panel and 'data-form="capacity-quota"' in panel

    body = {
        "branch": f"team:{team.pk}",
        "requests_per_minute": "60",
        "tokens_per_minute": "",
        "tokens_per_day": "",
        "monthly_token_budget": "1000000",
    }
    assert client.post("/people/limits/rate", body).status_code == 302
    limit = RateLimit.objects.get(team=team)
    assert (limit.requests_per_minute, limit.tokens_per_minute, limit.monthly_token_budget) == (60, None, 1000000)
    # Only what changed is applied, and audited.
    response = client.post("/people/limits/rate", {**body, "requests_per_minute": "90"}, HTTP_HX_REQUEST="true")
    assert 'value="90"' in response.content.decode()
    assert AuditEvent.objects.filter(action="rate_limit.update").get().changes == {
        "requests_per_minute": [60, 90],
        "scope": f"team:{team.pk}",
    }
    # Clearing every box removes the limit.
    client.post("/people/limits/rate", {"branch": f"team:{team.pk}"})
    assert not RateLimit.objects.filter(team=team).exists()

    client.post("/people/limits/capacity", {"branch": f"team:{team.pk}", "gpus": "4", "memory": "64GB"})
    quota = CapacityQuota.objects.get(team=team)
    assert (quota.gpus, quota.memory_bytes, quota.replicas) == (4, 64 * 1024**3, None)
    response = client.post("/people/limits/capacity", {"branch": f"team:{team.pk}", "memory": "lots"})
    assert "Write memory as 64GB" in response.content.decode()
    assert actions(billing) == ["rate_limit.create", "rate_limit.update", "rate_limit.delete", "capacity_quota.create"]

    # Members, people and the tree are not billing's to change.
    assert client.get(f"/people/members/?branch=team:{team.pk}").status_code == 200
    assert (
        client.post(
            "/people/members/add", {"branch": f"team:{team.pk}", "email": "bob@example.com", "role": "member"}
        ).status_code
        == 403
    )
    assert client.post(f"/people/users/{bob.pk}/suspend").status_code == 403
    assert client.post("/people/teams/add", {"branch": f"org:{tree.orgs[0].pk}", "name": "X"}).status_code == 403
    assert not Membership.objects.exists()
    assert 'data-form="add-member"' not in client.get(f"/people/members/?branch=team:{team.pk}").content.decode()


def test_a_viewer_sees_every_panel_and_no_forms(viola: User, bob: User, tree: Tree) -> None:
    client = signed_in(viola)
    Membership.objects.create(user=bob, organization=tree.orgs[0])
    RateLimit.objects.create(organization=tree.orgs[0], requests_per_minute=60)
    for key in (f"org:{tree.orgs[0].pk}", f"team:{tree.teams[0].pk}", f"project:{tree.projects[0].pk}"):
        for tab in ("members", "limits", "usage"):
            url = f"/people/{tab}/?branch={key}"
            panel = client.get(url, HTTP_HX_REQUEST="true")
            assert panel.status_code == 200, url
            assert "<form" not in panel.content.decode(), url
            page = client.get(url).content.decode()
            assert "data-form=" not in page, url
    limits = client.get(f"/people/limits/?branch=org:{tree.orgs[0].pk}", HTTP_HX_REQUEST="true").content.decode()
    assert re.search(r'data-col="requests_per_minute">60<', limits)
    assert re.search(r'data-col="gpus">-<', limits)
    assert client.post("/people/limits/rate", {"branch": f"org:{tree.orgs[0].pk}"}).status_code == 403
    assert client.post("/people/members/add", {"branch": f"org:{tree.orgs[0].pk}"}).status_code == 403


def test_people_without_a_staff_role_or_a_branch_are_refused(bob: User, tree: Tree) -> None:
    client = signed_in(bob)
    for url in ("/people/", "/people/members/", "/people/limits/", "/people/usage/", "/org/"):
        assert client.get(url).status_code == 403, url
    assert "My teams" not in client.get("/").content.decode()
    assert Client().get("/people/members/")["Location"].startswith("/login/")


# Managers ----------------------------------------------------------------------------------


def test_a_manager_sees_only_their_branch_at_org(manager: User, tree: Tree) -> None:
    client = signed_in(manager)
    team = tree.teams[0]
    page = client.get("/org/").content.decode()
    assert f'data-panel="team:{team.pk}"' in page
    shown = set(re.findall(r'data-branch="([a-z]+:\d+)"', page))
    assert shown == {f"team:{team.pk}", *(f"project:{p.pk}" for p in tree.projects if p.team_id == team.pk)}
    assert 'data-form="add-team"' not in page and 'data-form="add-project"' not in page
    assert ">My teams</a>" in page

    for key in (
        f"team:{tree.teams[1].pk}",
        f"org:{tree.orgs[0].pk}",
        f"team:{tree.teams[2].pk}",
        f"project:{tree.projects[-1].pk}",
        "team:999",
    ):
        assert client.get(f"/org/?branch={key}").status_code == 404, key
    project = tree.projects[1]
    assert client.get(f"/org/?branch=project:{project.pk}").status_code == 200
    # Limits and usage are read, not changed.
    limits = client.get(f"/org/limits/?branch=team:{team.pk}", HTTP_HX_REQUEST="true").content.decode()
    assert "<form" not in limits
    assert client.get(f"/org/usage/?branch=team:{team.pk}").status_code == 200
    assert (
        client.post("/people/limits/rate", {"branch": f"team:{team.pk}", "requests_per_minute": "1"}).status_code == 403
    )
    assert client.get("/people/members/").status_code == 403


def test_a_manager_manages_the_members_of_their_branch_only(manager: User, bob: User, tree: Tree) -> None:
    client = signed_in(manager)
    project = tree.projects[0]
    response = client.post(
        "/people/members/add", {"branch": f"project:{project.pk}", "email": "bob@example.com", "role": "member"}
    )
    assert response["Location"] == f"/org/?branch=project%3A{project.pk}"
    membership = Membership.objects.get(user=bob)
    assert membership.project == project
    panel = client.get(f"/org/?branch=project:{project.pk}", HTTP_HX_REQUEST="true").content.decode()
    assert 'data-form="remove"' in panel and 'data-form="suspend"' not in panel
    assert client.post(f"/people/users/{bob.pk}/suspend").status_code == 403

    elsewhere = Membership.objects.create(user=bob, organization=tree.orgs[1])
    assert (
        client.post(
            "/people/members/add", {"branch": f"team:{tree.teams[2].pk}", "email": "bob@example.com", "role": "member"}
        ).status_code
        == 404
    )
    assert client.post(f"/people/members/{elsewhere.pk}/remove").status_code == 404
    assert client.post(f"/people/members/{membership.pk}/remove", HTTP_HX_REQUEST="true").status_code == 200
    assert list(Membership.objects.filter(user=bob)) == [elsewhere]
    assert actions(manager) == ["membership.add", "membership.remove"]


def test_the_managers_page_obeys_the_policy(manager: User, tree: Tree) -> None:
    client = signed_in(manager)
    team = tree.teams[0]
    for url in ("/org/", f"/org/limits/?branch=team:{team.pk}", f"/org/usage/?branch=team:{team.pk}"):
        for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
            response = client.get(url, **headers)
            assert response.status_code == 200, url
            check_body(response, check_strict(response, url), url)


def test_the_people_pages_obey_the_policy(alice: User, bob: User, tree: Tree) -> None:
    client = signed_in(alice)
    Membership.objects.create(user=bob, organization=tree.orgs[0])
    for key in (f"org:{tree.orgs[0].pk}", f"team:{tree.teams[0].pk}", f"project:{tree.projects[0].pk}"):
        for tab in ("members", "limits", "usage"):
            url = f"/people/{tab}/?branch={key}"
            for headers in ({}, {"HTTP_HX_REQUEST": "true"}):
                response = client.get(url, **headers)
                check_body(response, check_strict(response, url), url)


# Usage -------------------------------------------------------------------------------------


def usage(
    project: Project, *, model: str = "llama", first_token_ms: float = 80.0, total_ms: float = 900.0, status: int = 200
) -> dict[str, Any]:
    return {
        "request_id": f"req_{uuid.uuid4().hex}",
        "created_at": timezone.now(),
        "model": model,
        "organization_id": project.team.organization_id,
        "team_id": project.team_id,
        "project_id": project.pk,
        "endpoint": "chat.completions",
        "status": status,
        "prompt_tokens": 10,
        "completion_tokens": 20,
        "first_token_ms": first_token_ms,
        "total_ms": total_ms,
    }


def test_the_usage_panel_shows_percentiles_and_dashes_for_no_use(viola: User, tree: Tree) -> None:
    used = tree.projects[0]
    write_records_sync(
        [usage(used) for _ in range(9)]
        + [usage(used, status=500, first_token_ms=None), usage(used, status=429, first_token_ms=None)]
    )
    client = signed_in(viola)
    html = client.get(f"/people/usage/?branch=team:{used.team_id}").content.decode()
    assert cell(html, used.name, "requests") == "11"
    assert (cell(html, used.name, "errors"), cell(html, used.name, "refusals")) == ("1", "1")
    for column in ("first_token_p50", "first_token_p95", "first_token_p99", "latency_p50", "latency_p99"):
        assert re.fullmatch(r"\d+ ms", cell(html, used.name, column)), column
    assert cell(html, "total", "requests") == "11"
    assert cell(html, "llama", "latency_p50").endswith("ms")
    # The team's other project, and a team nobody used, say "-" where nothing is known.
    other = tree.projects[1]
    assert cell(html, other.name, "requests") == "0"
    for column in ("prompt_tokens", "first_token_p50", "latency_p99"):
        assert cell(html, other.name, column) == "-"
    idle = client.get(f"/people/usage/?branch=team:{tree.teams[1].pk}").content.decode()
    for column in ("first_token_p50", "first_token_p95", "latency_p50", "completion_tokens"):
        assert cell(idle, "total", column) == "-"
    assert "No requests in this period." in idle
    # An organisation's panel is by team.
    org = client.get(f"/people/usage/?branch=org:{tree.orgs[0].pk}&period=hour").content.decode()
    assert cell(org, tree.teams[0].name, "requests") == "11"
    assert cell(org, tree.teams[1].name, "latency_p50") == "-"


# Cost --------------------------------------------------------------------------------------


def test_the_tree_page_does_not_query_per_branch(alice: User, django_assert_max_num_queries: Any) -> None:
    tree = make_tree(orgs=5, teams=4, projects=3)
    for index, project in enumerate(tree.projects[:10]):
        person = make_user(f"p{index}@example.com")
        Membership.objects.create(user=person, organization=tree.orgs[0])
        Membership.objects.create(
            user=person, organization=project.team.organization, team=project.team, project=project
        )
    client = signed_in(alice)
    client.get("/people/members/")  # the session, warmed
    # Session and user, the branch, the tree (3), and the panel: members with their memberships (2),
    # the limit and the quota (2), or the children and usage by child and by model (3) with the
    # GPU time each held (2).
    for tab, queries in (("members", 8), ("limits", 8), ("usage", 11)):
        with django_assert_max_num_queries(queries):
            response = client.get(f"/people/{tab}/?branch=org:{tree.orgs[0].pk}")
        assert response.status_code == 200
        assert response.content.decode().count("data-branch=") == 5 + 5 * 4 + 5 * 4 * 3
