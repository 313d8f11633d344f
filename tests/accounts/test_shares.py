"""Weights and bands, the shares of a busy model: set on the People page, on the API keys page, through
the REST API and `llmgw ctl share`; each change audited and seen by the gateway's tables; bad input
refused naming the field and the range, with nothing saved; people of another organisation refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import Client

from apps.accounts import services
from apps.accounts.choices import MembershipRole
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User
from apps.gateway.models import TableVersion
from apps.gateway.tables import load_tables
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


@dataclass
class Place:
    """Acme > Research > Search, with Globex beside it; Olga manages Acme, Tom its team Research,
    Paula its project Search, and Gus all of Globex. Bob's key is charged to Search."""

    acme: Organization
    research: Team
    search: Project
    globex: Organization
    olga: User
    tom: User
    paula: User
    gus: User
    bob: User
    key: ApiKey
    secret: str


def manager(email: str, org: Organization, team: Team | None = None, project: Project | None = None) -> User:
    person = make_user(email)
    Membership.objects.create(user=person, organization=org, team=team, project=project, role=MembershipRole.MANAGER)
    return person


@pytest.fixture
def place(bob: User) -> Place:
    acme = Organization.objects.create(name="Acme", slug="acme")
    research = Team.objects.create(organization=acme, name="Research", slug="research")
    search = Project.objects.create(team=research, name="Search", slug="search")
    globex = Organization.objects.create(name="Globex", slug="globex")
    Membership.objects.create(user=bob, organization=acme, team=research, project=search)
    new = services.create_api_key(bob, name="crawler", project=search, actor=bob)
    return Place(
        acme=acme,
        research=research,
        search=search,
        globex=globex,
        olga=manager("olga@example.com", acme),
        tom=manager("tom@example.com", acme, research),
        paula=manager("paula@example.com", acme, research, search),
        gus=manager("gus@example.com", globex),
        bob=bob,
        key=new.key,
        secret=new.secret,
    )


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def patch(user: User, path: str, body: Any) -> Any:
    raw = body if isinstance(body, str) else json.dumps(body)
    return signed_in(user).patch(f"/api/v1/{path}", raw, content_type="application/json")


def shares() -> list[tuple[str, dict[str, Any]]]:
    return list(AuditEvent.objects.filter(action__endswith=".share").order_by("id").values_list("action", "changes"))


def weights(place: Place) -> tuple[int, int, int, int, str, str]:
    for row in (place.acme, place.research, place.search, place.key):
        row.refresh_from_db()
    return (
        place.acme.weight,
        place.research.weight,
        place.search.weight,
        place.key.weight,
        place.search.band,
        place.key.band,
    )


# The REST API ----------------------------------------------------------------------------------


def test_an_administrator_sets_every_weight_and_band_through_the_api(alice: User, place: Place) -> None:
    answers = [
        patch(alice, f"organizations/{place.acme.pk}/share", {"weight": 3}),
        patch(alice, f"teams/{place.research.pk}/share", {"weight": 4}),
        patch(alice, f"projects/{place.search.pk}/share", {"weight": 5, "band": "batch"}),
        patch(alice, f"keys/{place.key.pk}/share", {"weight": 6}),
    ]
    assert [a.status_code for a in answers] == [200, 200, 200, 200], [a.content for a in answers]
    assert answers[2].json()["band"] == "batch" and answers[3].json()["weight"] == 6
    assert weights(place) == (3, 4, 5, 6, "batch", "interactive")
    assert shares() == [
        ("organization.share", {"weight": [1, 3]}),
        ("team.share", {"weight": [1, 4]}),
        ("project.share", {"band": ["interactive", "batch"], "weight": [1, 5]}),
        ("api_key.share", {"weight": [1, 6]}),
    ]
    # The lists show them to staff.
    listed = signed_in(alice).get("/api/v1/projects/").json()["results"]
    assert [(p["weight"], p["band"]) for p in listed] == [(5, "batch")]


@pytest.mark.parametrize("weight", [0, -1, 1001, "NaN", "four", 2.5, True, None, ""])
def test_a_weight_outside_1_to_1000_is_a_400_naming_the_field_and_the_range(
    alice: User, place: Place, weight: Any
) -> None:
    answer = patch(alice, f"teams/{place.research.pk}/share", {"weight": weight})
    assert answer.status_code == 400, answer.content
    [message] = answer.json()["errors"]["weight"]
    assert "from 1 to 1000" in message
    assert weights(place)[1] == 1 and shares() == []


def test_a_literal_nan_and_a_band_that_does_not_exist_are_400s(alice: User, place: Place) -> None:
    answer = patch(alice, f"teams/{place.research.pk}/share", '{"weight": NaN}')
    assert answer.status_code == 400 and "NaN" in answer.json()["detail"]
    answer = patch(alice, f"projects/{place.search.pk}/share", {"weight": 9, "band": "urgent"})
    assert answer.status_code == 400
    assert answer.json()["errors"]["band"] == ["The band is one of interactive, batch; urgent is not."]
    # A team has no band at all.
    answer = patch(alice, f"teams/{place.research.pk}/share", {"band": "batch"})
    assert answer.status_code == 400 and "band" in answer.json()["errors"]
    assert patch(alice, f"teams/{place.research.pk}/share", {}).status_code == 400
    assert weights(place) == (1, 1, 1, 1, "interactive", "interactive") and shares() == []


def test_each_weight_is_set_by_whoever_manages_the_level_above_it(place: Place) -> None:
    # Olga manages Acme: she divides it among its teams, and everything below.
    assert patch(place.olga, f"teams/{place.research.pk}/share", {"weight": 7}).status_code == 200
    # ... but not Acme's own weight against other organisations.
    answer = patch(place.olga, f"organizations/{place.acme.pk}/share", {"weight": 900})
    assert answer.status_code == 403
    assert answer.json()["detail"] == "Only administrators may change the weight of organisation Acme."
    # Tom manages Research: its projects, not Research itself.
    answer = patch(place.tom, f"teams/{place.research.pk}/share", {"weight": 900})
    assert answer.status_code == 403
    assert "the managers of Acme may change the weight of team Research" in answer.json()["detail"]
    assert patch(place.tom, f"projects/{place.search.pk}/share", {"band": "batch"}).status_code == 200
    # Paula manages Search: its keys, not Search itself.
    assert patch(place.paula, f"projects/{place.search.pk}/share", {"weight": 900}).status_code == 403
    assert patch(place.paula, f"keys/{place.key.pk}/share", {"weight": 2}).status_code == 200
    assert weights(place) == (1, 7, 1, 2, "batch", "interactive")
    actors = list(
        AuditEvent.objects.filter(action__endswith=".share").order_by("id").values_list("actor__email", flat=True)
    )
    assert actors == ["olga@example.com", "tom@example.com", "paula@example.com"]


def test_a_manager_of_another_organisation_is_refused_everywhere_in_acme(place: Place) -> None:
    for path, body in (
        (f"organizations/{place.acme.pk}/share", {"weight": 2}),
        (f"teams/{place.research.pk}/share", {"weight": 2}),
        (f"projects/{place.search.pk}/share", {"weight": 2, "band": "batch"}),
        (f"keys/{place.key.pk}/share", {"weight": 2}),
    ):
        assert patch(place.gus, path, body).status_code == 404, path
    # Someone who manages nothing is refused before anything is looked up.
    assert patch(make_user("mia@example.com"), f"teams/{place.research.pk}/share", {"weight": 2}).status_code == 403
    assert weights(place) == (1, 1, 1, 1, "interactive", "interactive") and shares() == []


def test_a_keys_owner_lowers_its_band_but_never_raises_it(place: Place) -> None:
    answer = patch(place.bob, f"keys/{place.key.pk}/share", {"band": "batch"})
    assert answer.status_code == 200 and answer.json()["band"] == "batch"
    answer = patch(place.bob, f"keys/{place.key.pk}/share", {"band": "interactive"})
    assert answer.status_code == 403 and "its owner may lower its band" in answer.json()["detail"]
    # Nor its weight, which divides the project among its keys.
    assert patch(place.bob, f"keys/{place.key.pk}/share", {"weight": 50}).status_code == 403
    assert weights(place)[3:] == (1, "interactive", "batch")
    # Charlie cannot see Bob's key at all.
    assert patch(make_user("charlie@example.com"), f"keys/{place.key.pk}/share", {"band": "batch"}).status_code == 404


def test_no_key_uses_a_higher_band_than_its_project(alice: User, place: Place) -> None:
    Project.objects.filter(pk=place.search.pk).update(band="batch")
    ApiKey.objects.filter(pk=place.key.pk).update(band="batch")
    answer = patch(alice, f"keys/{place.key.pk}/share", {"band": "interactive"})
    assert answer.status_code == 400
    assert answer.json()["errors"]["band"] == [
        "Key crawler may not use a higher band than its project Search, which is limited to batch."
    ]
    assert weights(place)[5] == "batch"


# The gateway's tables ------------------------------------------------------------------------


def test_a_change_reaches_the_gateways_key_table(
    alice: User, place: Place, django_capture_on_commit_callbacks: Any
) -> None:
    before = load_tables().keys[place.key.key_hash]
    assert (before.weights, before.ceiling) == ((1, 1, 1, 1), 0)
    version = TableVersion.objects.filter(pk=1).values_list("version", flat=True).first() or 0
    for path, body in (
        (f"organizations/{place.acme.pk}/share", {"weight": 2}),
        (f"teams/{place.research.pk}/share", {"weight": 3}),
        (f"projects/{place.search.pk}/share", {"weight": 4, "band": "batch"}),
        (f"keys/{place.key.pk}/share", {"weight": 5}),
    ):
        with django_capture_on_commit_callbacks(execute=True):
            assert patch(alice, path, body).status_code == 200
        now = TableVersion.objects.get(pk=1).version
        assert now > version, path  # every gateway process reloads its tables
        version = now
    after = load_tables().keys[place.key.key_hash]
    assert (after.weights, after.ceiling) == ((2, 3, 4, 5), 1)


def test_renaming_a_team_does_not_reload_the_gateways_tables(
    alice: User, place: Place, django_capture_on_commit_callbacks: Any
) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        services.rename_team(place.research, name="R&D", actor=alice)
    assert not TableVersion.objects.exists()


# The console -----------------------------------------------------------------------------------


def test_an_administrator_sets_a_branchs_weight_on_the_people_page(alice: User, place: Place) -> None:
    client = signed_in(alice)
    page = client.get(f"/people/limits/?branch=project:{place.search.pk}").content.decode()
    assert 'data-form="share"' in page and page.count('data-form="key-share"') == 1
    response = client.post(
        "/people/limits/share",
        {"branch": f"project:{place.search.pk}", "branch-weight": "12", "branch-band": "batch"},
    )
    assert response.status_code == 302
    response = client.post(
        "/people/limits/share",
        {"branch": f"project:{place.search.pk}", "key": place.key.pk, f"key{place.key.pk}-weight": "3"},
    )
    assert response.status_code == 302
    assert weights(place) == (1, 1, 12, 3, "batch", "interactive")
    assert [action for action, _changes in shares()] == ["project.share", "api_key.share"]


@pytest.mark.parametrize("weight", ["0", "-3", "1001", "NaN", "x", "2.5", ""])
def test_a_bad_weight_on_the_people_page_is_a_form_error_and_saves_nothing(
    alice: User, place: Place, weight: str
) -> None:
    response = signed_in(alice).post(
        "/people/limits/share", {"branch": f"team:{place.research.pk}", "branch-weight": weight}, HTTP_HX_REQUEST="true"
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-error="weight"' in page and "1 to 1000" in page
    assert weights(place)[1] == 1 and shares() == []


def test_a_band_that_does_not_exist_is_a_form_error(alice: User, place: Place) -> None:
    response = signed_in(alice).post(
        "/people/limits/share",
        {"branch": f"project:{place.search.pk}", "branch-weight": "2", "branch-band": "urgent"},
        HTTP_HX_REQUEST="true",
    )
    assert 'data-error="band"' in response.content.decode()
    assert weights(place) == (1, 1, 1, 1, "interactive", "interactive")


def test_managers_see_forms_only_for_what_is_below_them(place: Place) -> None:
    tom = signed_in(place.tom)
    own = tom.get(f"/org/limits/?branch=team:{place.research.pk}").content.decode()
    assert 'data-form="share"' not in own and 'data-col="weight"' in own
    below = tom.get(f"/org/limits/?branch=project:{place.search.pk}").content.decode()
    assert 'data-form="share"' in below and 'data-form="key-share"' in below
    # A forged post about his own team is refused, saying who may.
    response = tom.post("/people/limits/share", {"branch": f"team:{place.research.pk}", "branch-weight": "50"})
    assert response.status_code == 403
    assert (
        tom.post("/people/limits/share", {"branch": f"project:{place.search.pk}", "branch-weight": "5"}).status_code
        == 302
    )
    assert weights(place)[1:3] == (1, 5)


def test_a_manager_of_another_organisation_cannot_reach_acmes_shares(place: Place) -> None:
    gus = signed_in(place.gus)
    for branch, key in ((f"team:{place.research.pk}", None), (f"project:{place.search.pk}", place.key.pk)):
        body = {"branch": branch, "branch-weight": "9", f"key{place.key.pk}-weight": "9"}
        if key:
            body["key"] = key
        assert gus.post("/people/limits/share", body).status_code == 404
    # A key of another project, named under a branch he manages, is not found either.
    mine = Project.objects.create(team=Team.objects.create(organization=place.globex, name="G", slug="g"), name="P")
    body = {"branch": f"project:{mine.pk}", "key": place.key.pk, f"key{place.key.pk}-weight": "9"}
    assert gus.post("/people/limits/share", body).status_code == 404
    assert weights(place) == (1, 1, 1, 1, "interactive", "interactive") and shares() == []


def test_a_keys_owner_moves_it_to_the_batch_band_on_the_keys_page(place: Place) -> None:
    bob = signed_in(place.bob)
    page = bob.get("/account/keys/").content.decode()
    assert f'name="band_key" value="{place.key.pk}"' in page
    response = bob.post("/account/keys/", {"band_key": place.key.pk, "band": "batch"})
    assert response.status_code == 302
    assert weights(place)[5] == "batch"
    page = bob.get("/account/keys/").content.decode()
    assert "batch" in page and f'name="band_key" value="{place.key.pk}"' not in page
    # Raising it again is refused (a manager of its project may).
    bob.post("/account/keys/", {"band_key": place.key.pk, "band": "interactive"})
    assert weights(place)[5] == "batch"
    # Another person's key is not found.
    charlie = signed_in(make_user("charlie@example.com"))
    assert charlie.post("/account/keys/", {"band_key": place.key.pk, "band": "batch"}).status_code == 404


# llmgw ctl ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_ctl_sets_and_lists_shares(live_server: Any, capsys: Any, monkeypatch: Any, tmp_path: Any) -> None:
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    admin = make_user("admin@example.com", role="admin")
    acme = Organization.objects.create(name="Acme", slug="acme")
    team = Team.objects.create(organization=acme, name="Research", slug="research")
    project = Project.objects.create(team=team, name="Search", slug="search")
    base = ["ctl", "--server", live_server.url, "--key", services.create_api_key(admin, name="cli", actor=admin).secret]
    assert main([*base, "share", "team", str(team.pk), "--weight", "4"]) == 0
    assert f"team {team.pk} (Research): weight 4" in capsys.readouterr().out
    assert main([*base, "share", "project", str(project.pk), "--weight", "2", "--band", "batch"]) == 0
    assert f"project {project.pk} (Search): weight 2, band batch" in capsys.readouterr().out
    assert main([*base, "share", "list"]) == 0
    out = capsys.readouterr().out
    assert "Acme / Research / Search" in out and "batch" in out
    for bad in ("0", "1001", "nan", "four"):
        assert main([*base, "share", "team", str(team.pk), "--weight", bad]) == 1
        assert "error 400" in (err := capsys.readouterr().err) and "from 1 to 1000" in err, bad
    assert main([*base, "share", "project", str(project.pk), "--band", "urgent"]) == 1
    assert "interactive, batch" in capsys.readouterr().err
    # A manager of another organisation.
    gus = manager("gus@example.com", Organization.objects.create(name="Globex", slug="globex"))
    outsider = ["ctl", "--server", live_server.url, "--key", services.create_api_key(gus, name="g", actor=gus).secret]
    assert main([*outsider, "share", "team", str(team.pk), "--weight", "1000"]) == 1
    assert "error 404" in capsys.readouterr().err
    team.refresh_from_db()
    project.refresh_from_db()
    assert (team.weight, project.weight, project.band) == (4, 2, "batch")
