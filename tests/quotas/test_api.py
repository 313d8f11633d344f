"""The usage, request and rate-limit endpoints, who sees what, and `llmgw ctl usage`."""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

import pytest

from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership
from apps.quotas import histograms
from apps.quotas.limiter import limits_for, load_all_limits, pick_limits
from apps.quotas.models import RateLimit, UsageRecord, UsageRollup
from apps.quotas.usage import write_records_sync
from llmgw.cli import main
from tests.conftest import make_user
from tests.quotas.conftest import make_key, recent_minute, record


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
    records = [
        record(bob_key),
        record(bob_key, status=429, total_ms=None, first_token_ms=None),
        record(charlie_key, model="whisper", endpoint="embeddings"),
    ]
    write_records_sync(records)
    return {"bob_key": bob_key, "charlie_key": charlie_key, "records": records}


# Usage visibility --------------------------------------------------------------------------


@pytest.mark.django_db
def test_an_administrator_sees_everyones_usage(api, alice, traffic) -> None:
    answer = usage(api, alice, group_by="user")
    rows = groups(answer)
    assert set(rows) == {"bob@example.com", "charlie@example.com"}
    bob = rows["bob@example.com"]
    assert (bob["requests"], bob["refusals"], bob["errors"], bob["server_errors"], bob["client_errors"]) == (
        2,
        1,
        0,
        0,
        0,
    )
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
    assert (body["request_id"], body["user"], body["team"], body["model"]) == (
        request_id,
        "bob@example.com",
        "Vision",
        "llama-3-8b",
    )
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
    response = api.patch(
        f"/api/v1/limits/{limit_id}", {"tokens_per_day": 100000, "team": tree.other_team.pk}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["tokens_per_day"] == 100000
    assert response.json()["team"] == tree.team.pk  # the owner does not move
    assert AuditEvent.objects.get(action="rate_limit.update").changes == {
        "tokens_per_day": [None, 100000],
        "scope": f"team:{tree.team.pk}",
    }
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
    assert (
        api.post(
            "/api/v1/limits", {"organization": tree.org.pk, "monthly_token_budget": 10**9}, format="json"
        ).status_code
        == 201
    )
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
    assert (
        pick_limits(table, key_id=key.pk, project_id=tree.project.pk, team_id=tree.team.pk, org_id=tree.org.pk)
        == limits
    )
    assert limits_for(None, None, None, None, None) == []


# Percentiles, end to end -----------------------------------------------------------------------


def exact(values: list[float], q: Fraction) -> float:
    """Nearest-rank: the ⌈q·n⌉-th smallest (at least the first)."""
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


PERCENTILES = (("p50", Fraction(1, 2)), ("p95", Fraction(95, 100)), ("p99", Fraction(99, 100)))


@pytest.mark.django_db
@pytest.mark.parametrize("hours", [1, 24])  # read from minute rollups, and from hour rollups
def test_usage_percentiles_are_within_two_percent_of_the_exact_ones(api, alice, bob, charlie, tree, hours) -> None:
    rng = random.Random(hours)
    keys = [make_key(bob, tree.project), make_key(charlie, tree.other_project)]
    records = []
    for minutes_ago in range(1, 7):
        for _ in range(rng.randint(1, 150)):
            total = math.exp(rng.uniform(math.log(0.01), math.log(600_000)))  # 0.01 ms to 10 minutes
            records.append(
                record(
                    rng.choice(keys),
                    model=rng.choice(["llama", "qwen", "whisper"]),
                    created_at=recent_minute(minutes_ago) + timedelta(seconds=rng.randint(0, 59)),
                    first_token_ms=total * rng.random(),
                    total_ms=total,
                )
            )
    rng.shuffle(records)
    for start in range(0, len(records), 97):  # in batches, so rows are added into as well as created
        write_records_sync(records[start : start + 97])
    since = (datetime.now(UTC) - timedelta(hours=hours)).isoformat()
    for group_by, group_of in (
        ("model", lambda r: r["model"]),
        ("team", lambda r: r["team_id"]),
        ("key", lambda r: r["api_key_id"]),
    ):
        answer = usage(api, alice, group_by=group_by, since=since)
        assert answer["period"] == ("minute" if hours == 1 else "hour")
        assert sum(row["requests"] for row in answer["results"]) == len(records)
        for row in answer["results"]:
            mine = [r for r in records if group_of(r) == row["group"]]
            assert row["requests"] == len(mine)
            for name, field in (("first_token", "first_token_ms"), ("latency", "total_ms")):
                for suffix, q in PERCENTILES:
                    assert row[f"{name}_ms_{suffix}"] == pytest.approx(exact([r[field] for r in mine], q), rel=0.02)


@pytest.mark.django_db
def test_one_30_s_request_reads_30_s_at_p50_and_p99(api, alice, bob, tree) -> None:
    write_records_sync([record(make_key(bob, tree.project), first_token_ms=0.36, total_ms=30_000.0)])
    (row,) = usage(api, alice, group_by="model")["results"]
    for suffix in ("p50", "p95", "p99"):
        assert row[f"latency_ms_{suffix}"] == pytest.approx(30_000.0, rel=0.02)
        assert row[f"first_token_ms_{suffix}"] == pytest.approx(0.36, rel=0.02)


# Rollups from before sketches and client errors ------------------------------------------------------


def old_rollups(key: Any, model: str = "llama-3-8b") -> None:
    """A minute and an hour rollup as they were written before: fixed buckets, no client errors."""
    start = recent_minute()
    for period, bucket_start in (("minute", start), ("hour", start.replace(minute=0))):
        UsageRollup.objects.create(
            period=period,
            bucket_start=bucket_start,
            organization_id=key.project.team.organization_id,
            team_id=key.project.team_id,
            project_id=key.project.pk,
            api_key_id=key.pk,
            user_id=key.user_id,
            model=model,
            requests=3,
            errors=1,
            client_errors=None,
            refusals=0,
            prompt_tokens=30,
            completion_tokens=60,
            requests_without_tokens=0,
            # one in (25, 50] ms and one in (30, 60] s; one first token in (100, 250] ms
            first_token_hist=[0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0],
            latency_hist=[0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        )


@pytest.mark.django_db
def test_old_rollups_read_as_their_buckets_said_and_client_errors_as_unknown(api, alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    old_rollups(key)
    for hours in (1, 24):
        (row,) = usage(api, alice, group_by="model", since=(datetime.now(UTC) - timedelta(hours=hours)).isoformat())[
            "results"
        ]
        assert (row["requests"], row["server_errors"], row["client_errors"]) == (3, 1, None)
        assert row["latency_ms_p50"] == pytest.approx(37.5, rel=0.02)  # the middle of (25, 50]
        assert row["latency_ms_p99"] == pytest.approx(45_000.0, rel=0.02)  # the middle of (30, 60] s
        assert row["first_token_ms_p50"] == pytest.approx(175.0, rel=0.02)


@pytest.mark.django_db
def test_a_new_request_into_an_old_rollup_turns_it_into_a_sketch(api, alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    old_rollups(key)
    write_records_sync([record(key, total_ms=30.0, first_token_ms=20.0, status=404, error="no such model")])
    minute = UsageRollup.objects.get(period="minute")
    assert isinstance(minute.latency_hist, dict) and histograms.count(minute.latency_hist) == 3
    assert (minute.requests, minute.client_errors) == (4, None)  # still partly uncounted: unknown
    (row,) = usage(api, alice, group_by="model")["results"]
    assert row["latency_ms_p50"] == pytest.approx(37.5, rel=0.02)
    assert row["latency_ms_p95"] == pytest.approx(45_000.0, rel=0.02)
    assert row["first_token_ms_p50"] == pytest.approx(20.0, rel=0.02)
    # Another model's rollup, all new, knows its client errors.
    write_records_sync([record(key, model="new", status=404, error="no such model")])
    assert groups(usage(api, alice, group_by="model"))["new"]["client_errors"] == 1


@pytest.mark.django_db(transaction=True)
def test_the_migration_leaves_client_errors_of_existing_rollups_unknown() -> None:
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    before = ("quotas", "0002_usagerollup_ratelimit_usagerecord")
    after = ("quotas", "0003_usagerollup_client_errors_sketches")
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    try:
        old = executor.loader.project_state([before]).apps.get_model("quotas", "UsageRollup")
        old.objects.create(
            period="minute",
            bucket_start=recent_minute(),
            model="m",
            requests=2,
            latency_hist=[1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        )
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate([after])
        executor = MigrationExecutor(connection)
        executor.migrate(executor.loader.graph.leaf_nodes())  # and on to the latest, for the tests after this one
    row = UsageRollup.objects.get()
    assert row.client_errors is None and row.latency_hist[:2] == [1, 1]
    assert UsageRollup.objects.create(period="hour", bucket_start=recent_minute(), model="m").client_errors == 0


# llmgw ctl ------------------------------------------------------------------------------------

CTL_HEADER = [
    "GROUP",
    "REQUESTS",
    "SERVER_ERRORS",
    "CLIENT_ERRORS",
    "REFUSALS",
    "TOKENS_IN",
    "TOKENS_OUT",
    "GPU_HOURS",
    "CORE_HOURS",
    "P50_TTFT_MS",
    "P95_TTFT_MS",
    "P99_TTFT_MS",
    "P50_LATENCY_MS",
    "P95_LATENCY_MS",
    "P99_LATENCY_MS",
    "P50_QUEUE_MS",
    "P99_QUEUE_MS",
]


@pytest.mark.django_db(transaction=True)
def test_ctl_usage_prints_a_dash_where_nothing_was_timed(
    live_server, bob, tree, key_for, capsys, monkeypatch, tmp_path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    key = make_key(bob, tree.project)
    write_records_sync(
        [
            record(key, model="timed", total_ms=300.0, first_token_ms=0.36),
            record(
                key,
                model="untimed",
                total_ms=None,
                first_token_ms=None,
                prompt_tokens=None,
                completion_tokens=None,
                status=502,
                error="upstream refused the connection",
            ),
            record(
                key,
                model="-",
                total_ms=2.0,
                first_token_ms=None,
                prompt_tokens=None,
                completion_tokens=None,
                status=404,
                error="The model “gpt-4” does not exist.",
            ),
        ]
    )
    secret = key_for(bob, name="cli")
    assert main(["ctl", "--server", live_server.url, "--key", secret, "usage", "--by", "model", "--since", "1h"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == CTL_HEADER
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["untimed"] == ["untimed", "1", "1", "0", "0", *["-"] * 12]  # GPU time too: not his to see
    assert rows["timed"][:9] == ["timed", "1", "0", "0", "0", "10", "20", "-", "-"]
    assert float(rows["timed"][9]) == pytest.approx(0.36, rel=0.02)  # TTFT in ms, not rounded to 0
    assert float(rows["timed"][12]) == pytest.approx(300.0, rel=0.02)
    assert line_of(lines, "(no such model)")[:4] == ["1", "0", "1", "0"]

    request_id = UsageRecord.objects.filter(user=bob, status=502).values_list("request_id", flat=True).get()
    assert main(["ctl", "--server", live_server.url, "--key", secret, "request", request_id]) == 0
    out = capsys.readouterr().out
    assert "upstream refused the connection" in out
    assert "prompt_tokens" in out


def line_of(lines: list[str], label: str) -> list[str]:
    """The cells after a row's label (which may hold spaces)."""
    line = next(line for line in lines if line.startswith(label))
    return line[len(label) :].split()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("where", ["before", "after"])
def test_ctl_usage_json_may_come_before_or_after_the_command(
    live_server, bob, tree, key_for, capsys, monkeypatch, tmp_path, where
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write_records_sync([record(make_key(bob, tree.project), total_ms=30_000.0, status=400, error="bad body")])
    secret = key_for(bob, name="cli")
    common = ["--server", live_server.url, "--key", secret]
    argv = ["ctl", *common, "--json", "usage"] if where == "before" else ["ctl", *common, "usage", "--json"]
    assert main([*argv, "--since", "1h"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert (row["requests"], row["client_errors"], row["server_errors"], row["refusals"]) == (1, 1, 0, 0)
    assert row["latency_ms_p50"] == pytest.approx(30_000.0, rel=0.02)


@pytest.mark.django_db(transaction=True)
def test_ctl_takes_json_after_any_command(live_server, alice, tree, key_for, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    RateLimit.objects.create(team=tree.team, requests_per_minute=600)
    common = ["ctl", "--server", live_server.url, "--key", key_for(alice, name="cli")]
    for argv in (["limits", "--json"], ["limits", "list", "--json"], ["--json", "limits", "list"]):
        assert main([*common, *argv]) == 0
        (limit,) = json.loads(capsys.readouterr().out)
        assert (limit["scope"], limit["requests_per_minute"]) == (f"team:{tree.team.pk}", 600)
    assert main([*common, "limits"]) == 0
    assert capsys.readouterr().out.split()[:6] == ["ID", "SCOPE", "RPM", "TPM", "TPD", "BUDGET"]
