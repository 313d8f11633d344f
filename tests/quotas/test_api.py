"""The usage, request and rate-limit endpoints, who sees what, and `llmgw ctl usage`."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership
from apps.quotas.limiter import limits_for, load_all_limits, pick_limits
from apps.quotas.models import RateLimit, UsageRecord
from apps.quotas.usage import write_records_sync
from llmgw.cli import main
from tests.conftest import make_user
from tests.quotas.conftest import make_key, record


def usage(api: Any, user: Any, **params: str) -> dict[str, Any]:
    api.force_authenticate(user)
    response = api.get("/api/v1/usage", params)
    assert response.status_code == 200, response.content
    return response.json()


def groups(answer: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    return {row["label"]: row for row in answer["results"]}


@pytest.fixture
def traffic(bob, charlie, tree) -> dict[str, Any]:
    """Bob calls through a Vision key (twice), Charlie through a Speech key (once)."""
    bob_key = make_key(bob, tree.project, name="bob-ci")
    charlie_key = make_key(charlie, tree.other_project, name="charlie-ci")
    records = [record(bob_key), record(bob_key, status=429, total_ms=None, first_token_ms=None),
               record(charlie_key, model="whisper", endpoint="embeddings")]
    write_records_sync(records)
    return {"bob_key": bob_key, "charlie_key": charlie_key, "records": records}


# Usage visibility --------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_administrator_sees_everyones_usage(api, alice, traffic) -> None:
    answer = usage(api, alice, group_by="user")
    rows = groups(answer)
    assert set(rows) == {"bob@example.com", "charlie@example.com"}
    bob = rows["bob@example.com"]
    assert (bob["requests"], bob["refusals"], bob["errors"]) == (2, 1, 0)
    assert (bob["prompt_tokens"], bob["completion_tokens"]) == (20, 40)
    assert bob["latency_ms_p50"] is not None
    assert answer["period"] == "hour"  # 24 hours by default


@pytest.mark.django_db
def test_a_viewer_sees_everyones_usage_by_model(api, viola, traffic) -> None:
    answer = usage(api, viola, group_by="model", since=(datetime.now(UTC) - timedelta(hours=1)).isoformat())
    assert answer["period"] == "minute"
    assert {row["group"]: row["requests"] for row in answer["results"]} == {"llama-3-8b": 2, "whisper": 1}


@pytest.mark.django_db
def test_a_person_sees_only_their_own_keys_usage(api, bob, traffic) -> None:
    rows = groups(usage(api, bob, group_by="key"))
    assert list(rows) == [f"bob-ci ({traffic['bob_key'].prefix}…)"]


@pytest.mark.django_db
def test_charlie_sees_nothing_of_bobs(api, charlie, traffic) -> None:
    rows = groups(usage(api, charlie, group_by="user"))
    assert list(rows) == ["charlie@example.com"]
    assert usage(api, charlie, group_by="team")["results"][0]["requests"] == 1


@pytest.mark.django_db
def test_someone_without_usage_sees_an_empty_list(api, traffic) -> None:
    dora = make_user("dora@example.com")
    assert usage(api, dora, group_by="model")["results"] == []


@pytest.mark.django_db
def test_a_team_manager_sees_their_team_and_no_other(api, tree, traffic) -> None:
    manager = make_user("mona@example.com")
    Membership.objects.create(user=manager, organization=tree.org, team=tree.team, role=MembershipRole.MANAGER)
    rows = groups(usage(api, manager, group_by="team"))
    assert list(rows) == ["Acme / Vision"]


@pytest.mark.django_db
def test_an_organisation_manager_sees_the_whole_organisation(api, tree, traffic) -> None:
    manager = make_user("olga@example.com")
    Membership.objects.create(user=manager, organization=tree.org, role=MembershipRole.MANAGER)
    member = make_user("mike@example.com")
    Membership.objects.create(user=member, organization=tree.org, role=MembershipRole.MEMBER)
    assert set(groups(usage(api, manager, group_by="team"))) == {"Acme / Vision", "Acme / Speech"}
    assert usage(api, member, group_by="team")["results"] == []


@pytest.mark.django_db
def test_a_bad_query_is_refused_with_the_reason(api, alice) -> None:
    api.force_authenticate(alice)
    assert api.get("/api/v1/usage", {"group_by": "colour"}).status_code == 400
    now = datetime.now(UTC)
    response = api.get("/api/v1/usage", {"since": now.isoformat(), "until": (now - timedelta(hours=1)).isoformat()})
    assert response.status_code == 400
    assert "The start must be before the end." in response.content.decode()


@pytest.mark.django_db
def test_usage_needs_a_signed_in_caller(api) -> None:
    assert api.get("/api/v1/usage").status_code in (401, 403)


# One request ---------------------------------------------------------------------------------

@pytest.mark.django_db
def test_the_owner_and_staff_see_a_request_and_strangers_get_404(api, alice, bob, charlie, traffic) -> None:
    request_id = traffic["records"][0]["request_id"]
    api.force_authenticate(bob)
    response = api.get(f"/api/v1/requests/{request_id}")
    assert response.status_code == 200
    body = response.json()
    assert (body["request_id"], body["user"], body["team"], body["model"]) == (request_id, "bob@example.com",
                                                                              "Vision", "llama-3-8b")
    assert body["first_token_ms"] == 40.0 and body["status"] == 200
    api.force_authenticate(alice)
    assert api.get(f"/api/v1/requests/{request_id}").status_code == 200
    api.force_authenticate(charlie)
    stranger = api.get(f"/api/v1/requests/{request_id}")
    assert stranger.status_code == 404
    assert stranger.json() == api.get("/api/v1/requests/req_nothing").json()  # no hint that it exists


# Rate limits ---------------------------------------------------------------------------------

@pytest.mark.django_db
def test_an_administrator_sets_a_teams_limits(api, alice, tree) -> None:
    api.force_authenticate(alice)
    response = api.post("/api/v1/limits", {"team": tree.team.pk, "requests_per_minute": 60}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["scope"], body["requests_per_minute"], body["tokens_per_day"]) == (f"team:{tree.team.pk}", 60, None)
    assert AuditEvent.objects.filter(action="rate_limit.create", actor=alice).count() == 1
    limit_id = body["id"]
    response = api.patch(f"/api/v1/limits/{limit_id}", {"tokens_per_day": 100000, "team": tree.other_team.pk},
                         format="json")
    assert response.status_code == 200, response.content
    assert response.json()["tokens_per_day"] == 100000
    assert response.json()["team"] == tree.team.pk  # the owner does not move
    assert AuditEvent.objects.get(action="rate_limit.update").changes == {
        "tokens_per_day": [None, 100000], "scope": f"team:{tree.team.pk}"}
    assert api.delete(f"/api/v1/limits/{limit_id}").status_code == 204
    assert not RateLimit.objects.exists()


@pytest.mark.django_db
def test_a_limit_has_one_owner_and_positive_values(api, alice, tree) -> None:
    api.force_authenticate(alice)
    both = api.post("/api/v1/limits", {"team": tree.team.pk, "project": tree.project.pk}, format="json")
    assert both.status_code == 400
    assert "exactly one organisation, team, project or API key" in both.content.decode()
    assert api.post("/api/v1/limits", {"team": tree.team.pk, "tokens_per_minute": 0}, format="json").status_code == 400
    assert api.post("/api/v1/limits", {"team": tree.team.pk}, format="json").status_code == 201
    assert api.post("/api/v1/limits", {"team": tree.team.pk}, format="json").status_code == 400  # one per owner


@pytest.mark.django_db
def test_billing_may_change_limits_and_other_staff_only_read(api, viola, bob, tree) -> None:
    billie = make_user("billie@example.com", role=StaffRole.BILLING)
    api.force_authenticate(billie)
    assert api.post("/api/v1/limits", {"organization": tree.org.pk, "monthly_token_budget": 10**9},
                    format="json").status_code == 201
    api.force_authenticate(viola)
    assert api.get("/api/v1/limits").json()["count"] == 1
    assert api.post("/api/v1/limits", {"team": tree.team.pk}, format="json").status_code == 403
    api.force_authenticate(bob)
    assert api.get("/api/v1/limits").status_code == 403


@pytest.mark.django_db
def test_the_gateway_loads_limits_narrowest_first_with_labels(bob, tree) -> None:
    key = make_key(bob, tree.project, name="laptop")
    RateLimit.objects.create(organization=tree.org, monthly_token_budget=1000)
    RateLimit.objects.create(team=tree.team, requests_per_minute=60)
    RateLimit.objects.create(team=tree.other_team, requests_per_minute=1)
    RateLimit.objects.create(api_key=key, tokens_per_minute=500)
    limits = limits_for(key.pk, bob.pk, tree.project.pk, tree.team.pk, tree.org.pk)
    assert [(limit.scope, limit.label) for limit in limits] == [
        (f"key:{key.pk}", f"API key laptop ({key.prefix}…)"),
        (f"team:{tree.team.pk}", "team Vision"),
        (f"org:{tree.org.pk}", "organisation Acme"),
    ]
    assert limits[1].requests_per_minute == 60 and limits[1].tokens_per_day is None
    table = load_all_limits()
    assert len(table) == 4
    assert pick_limits(table, key_id=key.pk, project_id=tree.project.pk, team_id=tree.team.pk,
                       org_id=tree.org.pk) == limits
    assert limits_for(None, None, None, None, None) == []


# llmgw ctl ------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_ctl_usage_prints_a_dash_where_nothing_was_timed(live_server, bob, tree, key_for, capsys, monkeypatch,
                                                         tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    key = make_key(bob, tree.project)
    write_records_sync([
        record(key, model="timed", total_ms=300.0, first_token_ms=30.0),
        record(key, model="untimed", total_ms=None, first_token_ms=None, prompt_tokens=None,
               completion_tokens=None, status=502, error="upstream refused the connection"),
    ])
    secret = key_for(bob, name="cli")
    assert main(["ctl", "--server", live_server.url, "--key", secret, "usage", "--by", "model", "--since", "1h"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["GROUP", "REQUESTS", "ERRORS", "429", "PROMPT", "COMPLETION", "TTFT_P50", "TTFT_P95",
                                "TTFT_P99", "LAT_P50", "LAT_P95", "LAT_P99"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["untimed"] == ["untimed", "1", "1", "0", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert rows["timed"][:6] == ["timed", "1", "0", "0", "10", "20"]
    assert rows["timed"][9] == "375"  # one value in the 250-500 bucket: its middle

    request_id = UsageRecord.objects.filter(user=bob, status=502).values_list("request_id", flat=True).get()
    assert main(["ctl", "--server", live_server.url, "--key", secret, "request", request_id]) == 0
    out = capsys.readouterr().out
    assert "upstream refused the connection" in out
    assert "prompt_tokens" in out
