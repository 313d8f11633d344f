"""The usage page: who sees whose use, the figures and percentiles per group, the charts, htmx."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import Membership, User
from apps.quotas.usage import write_records_sync
from tests.conftest import make_user
from tests.llmgw.test_csp import check_body, check_strict
from tests.quotas.conftest import Tree, make_key, record

pytestmark = pytest.mark.django_db


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def rows(page: str) -> dict[str, dict[str, str]]:
    """{group label: {column: text}} from the usage table."""
    table = page[page.index('id="usage-table"') :]
    found = {}
    for body in re.findall(r"<tr data-group=[^>]*>(.*?)</tr>", table, re.DOTALL):
        label = re.search(r'<td class="clip" title="([^"]*)"', body).group(1)
        cells = dict(re.findall(r'<td data-col="([\w-]+)">(.*?)</td>', body, re.DOTALL))
        found[label] = {k: re.sub(r"<[^>]+>", "", v).strip() for k, v in cells.items()}
    return found


@pytest.fixture
def traffic(bob: User, charlie: User, tree: Tree) -> dict[str, Any]:
    """Bob's key in the Search project and Charlie's in Dictation, each with some requests."""
    bobs = make_key(bob, tree.project, name="bob-ci")
    charlies = make_key(charlie, tree.other_project, name="charlie-ci")
    write_records_sync(
        [
            record(bobs, first_token_ms=40.0, total_ms=400.0),
            record(bobs, first_token_ms=45.0, total_ms=450.0),
            record(bobs, status=503, error="upstream timed out", first_token_ms=None, total_ms=None),
            record(bobs, status=429, prompt_tokens=0, completion_tokens=0, first_token_ms=None, total_ms=None),
            record(
                bobs,
                model="-",
                status=404,
                error="The model “gpt-4” does not exist.",
                first_token_ms=None,
                total_ms=0.36,
                prompt_tokens=None,
                completion_tokens=None,
            ),
            record(charlies, model="qwen-72b", first_token_ms=900.0, total_ms=3000.0),
            # A model nobody timed: its percentiles are unknown.
            record(
                charlies,
                model="untimed",
                first_token_ms=None,
                total_ms=None,
                prompt_tokens=None,
                completion_tokens=None,
                tokens_estimated=False,
            ),
        ]
    )
    return {"bob": bobs, "charlie": charlies}


def test_a_person_sees_only_their_own_use(bob: User, traffic: dict[str, Any]) -> None:
    page = signed_in(bob).get("/usage/?group=key").content.decode()
    shown = rows(page)
    assert list(shown) == [f"bob-ci ({traffic['bob'].prefix}…)"]
    assert "charlie-ci" not in page
    row = shown[f"bob-ci ({traffic['bob'].prefix}…)"]
    assert (row["requests"], row["server-errors"], row["client-errors"], row["refusals"]) == ("5", "1", "1", "1")
    assert (row["prompt-tokens"], row["completion-tokens"].split()[0]) == ("30", "60")


def test_made_up_model_names_are_one_row_of_client_errors(bob: User, traffic: dict[str, Any]) -> None:
    row = rows(signed_in(bob).get("/usage/?group=model").content.decode())["(no such model)"]
    assert (row["requests"], row["server-errors"], row["client-errors"], row["refusals"]) == ("1", "0", "1", "0")
    assert row["latency"].split(" / ")[0] == "0.36 ms"  # not "0 ms"


def test_client_errors_nobody_counted_are_a_dash(alice: User, bob: User, tree: Tree) -> None:
    from apps.quotas.models import UsageRollup
    from tests.quotas.conftest import recent_minute

    key = make_key(bob, tree.project)
    UsageRollup.objects.create(
        period="minute",
        bucket_start=recent_minute(),
        api_key_id=key.pk,
        user_id=bob.pk,
        model="old",
        requests=2,
        errors=1,
        client_errors=None,
        latency_hist=[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0],
    )
    row = rows(signed_in(alice).get("/usage/?period=hour&group=model").content.decode())["old"]
    assert (row["requests"], row["server-errors"], row["client-errors"]) == ("2", "1", "-")
    assert row["latency"].split(" / ")[0].endswith(" s")


def test_first_token_and_latency_percentiles_are_shown(bob: User, traffic: dict[str, Any]) -> None:
    row = rows(signed_in(bob).get("/usage/?group=model").content.decode())["llama-3-8b"]
    first = row["first-token"].split(" / ")
    latency = row["latency"].split(" / ")
    assert len(first) == len(latency) == 3
    assert all(text.endswith("ms") for text in first + latency)
    assert "-" not in first + latency


def test_what_was_never_measured_is_a_dash(alice: User, traffic: dict[str, Any]) -> None:
    row = rows(signed_in(alice).get("/usage/?group=model").content.decode())["untimed"]
    assert row["first-token"] == "- / - / -" and row["latency"] == "- / - / -"
    assert row["prompt-tokens"] == "-" and row["completion-tokens"] == "-"


@pytest.mark.parametrize("role", [StaffRole.ADMIN, StaffRole.BILLING])
def test_billing_and_administrators_see_everyone(role: str, traffic: dict[str, Any]) -> None:
    user = make_user(f"{role}@example.com", role=role)
    shown = rows(signed_in(user).get("/usage/?group=project").content.decode())
    assert set(shown) == {"Acme / Vision / Search", "Acme / Speech / Dictation"}
    assert shown["Acme / Speech / Dictation"]["requests"] == "2"


def test_a_manager_sees_their_branch(tree: Tree, traffic: dict[str, Any]) -> None:
    manager = make_user("manager@example.com")
    Membership.objects.create(user=manager, organization=tree.org, team=tree.other_team, role=MembershipRole.MANAGER)
    shown = rows(signed_in(manager).get("/usage/?group=team").content.decode())
    assert list(shown) == ["Acme / Speech"]


def test_the_charts_are_drawn_on_the_server(bob: User, traffic: dict[str, Any]) -> None:
    page = signed_in(bob).get("/usage/?group=model").content.decode()
    charts = re.findall(r'<figure class="card min-w-0" data-chart="\d+">.*?</figure>', page, re.DOTALL)
    assert len(charts) == 6  # requests, tokens, errors, first token, latency, queue wait
    assert all("<svg" in chart for chart in charts)
    assert "<rect" in charts[0] and "llama-3-8b" in charts[0]


def test_the_page_says_so_when_there_is_nothing(bob: User) -> None:
    page = signed_in(bob).get("/usage/").content.decode()
    assert "No requests in this period." in page
    assert "<svg" not in page


def test_period_and_grouping_are_chosen_by_links(bob: User, traffic: dict[str, Any]) -> None:
    client = signed_in(bob)
    page = client.get("/usage/?period=week&group=team").content.decode()
    assert re.search(r'data-period="week" aria-current="true"', page)
    assert re.search(r'data-group="team" aria-current="true"', page)
    assert 'hx-get="?period=hour&amp;group=team"' in page
    # Anything else falls back to the last day by model.
    page = client.get("/usage/?period=decade&group=password").content.decode()
    assert re.search(r'data-period="day" aria-current="true"', page)
    assert re.search(r'data-group="model" aria-current="true"', page)


def test_an_hour_ago_is_not_in_the_last_hour(bob: User, tree: Tree) -> None:
    from datetime import timedelta

    from tests.quotas.conftest import recent_minute

    key = make_key(bob, tree.project)
    write_records_sync([record(key, created_at=recent_minute(minutes_ago=60 * 5) + timedelta(seconds=10))])
    client = signed_in(bob)
    assert rows(client.get("/usage/?period=hour").content.decode()) == {}
    assert rows(client.get("/usage/?period=day").content.decode())["llama-3-8b"]["requests"] == "1"


def test_htmx_gets_the_body_alone(bob: User, traffic: dict[str, Any]) -> None:
    response = signed_in(bob).get("/usage/?group=model", HTTP_HX_REQUEST="true")
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="usage-body"')
    assert "<html" not in body and "llama-3-8b" in body


def test_the_page_obeys_the_strict_policy(alice: User, traffic: dict[str, Any]) -> None:
    for url in ("/usage/", "/usage/?group=key&period=month"):
        response = signed_in(alice).get(url)
        check_body(response, check_strict(response, url), url)


def test_strangers_are_sent_to_sign_in(db: Any) -> None:
    response = Client().get("/usage/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert Client().post("/usage/").status_code == 302
