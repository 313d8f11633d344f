"""The wait for a slot of a busy model: kept in each usage record (null when unknown, 0 for a free
slot), summed into the rollups' sketches, and shown as p50 and p99 per organisation, team, project,
key and model on the usage page, the People page, the usage API and `llmgw ctl usage`."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.models import User
from apps.quotas.choices import UsageGroup
from apps.quotas.models import UsageRecord, UsageRollup
from apps.quotas.selectors import usage_summary
from apps.quotas.usage import write_records_sync
from tests.quotas.conftest import Tree, make_key, record

pytestmark = pytest.mark.django_db


@pytest.fixture
def waits(bob: User, charlie: User, tree: Tree) -> dict[str, Any]:
    """Bob's key in Search waited 0, 0, 1.2 s and 3 s (and a refusal that never asked for a slot);
    Charlie's in Dictation has only requests whose wait is unknown."""
    bobs = make_key(bob, tree.project, name="bob-ci")
    charlies = make_key(charlie, tree.other_project, name="charlie-ci")
    write_records_sync(
        [
            record(bobs, request_id="req_free_1", queue_ms=0.0),
            record(bobs, queue_ms=0.0),
            record(bobs, queue_ms=1200.0),
            record(bobs, request_id="req_waited", queue_ms=3000.0),
            record(bobs, request_id="req_refused", status=429, queue_ms=None, first_token_ms=None, total_ms=None),
            record(charlies, model="qwen", queue_ms=None),
            record(charlies, model="qwen"),  # a gateway from before waits were recorded
        ]
    )
    return {"bob": bobs, "charlie": charlies}


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_each_record_keeps_its_wait_and_unknown_stays_null(waits: dict[str, Any]) -> None:
    stored = dict(UsageRecord.objects.values_list("request_id", "queue_ms"))
    assert stored["req_free_1"] == 0.0  # a free slot: known, and nothing
    assert stored["req_waited"] == 3000.0
    assert stored["req_refused"] is None
    # Nonsense from a gateway is unknown, not a batch that fails.
    write_records_sync([record(waits["bob"], request_id="req_odd", queue_ms=float("nan"))])
    write_records_sync([record(waits["bob"], request_id="req_neg", queue_ms=-5)])
    assert UsageRecord.objects.get(request_id="req_odd").queue_ms is None
    assert UsageRecord.objects.get(request_id="req_neg").queue_ms is None


@pytest.mark.parametrize("group", [UsageGroup.ORGANIZATION, UsageGroup.TEAM, UsageGroup.PROJECT, UsageGroup.KEY])
def test_the_percentiles_of_each_branch_count_known_waits_only(
    alice: User, waits: dict[str, Any], tree: Tree, group: str
) -> None:
    until = timezone.now()
    rows = {
        row.label: row for row in usage_summary(alice, group_by=group, since=until - timedelta(hours=1), until=until)
    }
    mine = {
        UsageGroup.ORGANIZATION: "Acme",
        UsageGroup.TEAM: "Acme / Vision",
        UsageGroup.PROJECT: "Acme / Vision / Search",
        UsageGroup.KEY: f"bob-ci ({waits['bob'].prefix}…)",
    }[group]
    assert rows[mine].queue_ms_p50 == 0.0  # two of four took a free slot
    assert rows[mine].queue_ms_p99 == pytest.approx(3000.0, rel=0.01)
    if group != UsageGroup.ORGANIZATION:  # Charlie's branch: no wait known, so none shown
        other = next(row for label, row in rows.items() if label != mine)
        assert (other.queue_ms_p50, other.queue_ms_p99) == (None, None)


def test_a_rollup_from_before_waits_were_kept_adds_nothing_and_takes_new_ones(waits: dict[str, Any]) -> None:
    row = UsageRollup.objects.filter(period="minute", api_key_id=waits["bob"].pk).get()
    UsageRollup.objects.filter(pk=row.pk).update(queue_hist={})  # as the migration leaves old rows
    write_records_sync([record(waits["bob"], queue_ms=500.0)])
    row.refresh_from_db()
    from apps.quotas import histograms

    assert histograms.count(row.queue_hist) == 1


def cells(page: str, column: str) -> dict[str, str]:
    """{group label: the text of `column`} from the usage page's table."""
    table = page[page.index('id="usage-table"') :]
    found = {}
    for body in re.findall(r"<tr data-group=[^>]*>(.*?)</tr>", table, re.DOTALL):
        label = re.search(r'<td class="clip" title="([^"]*)"', body).group(1)  # type: ignore[union-attr]
        found[label] = re.search(rf'<td data-col="{column}">(.*?)</td>', body, re.DOTALL).group(1).strip()  # type: ignore[union-attr]
    return found


def test_the_usage_page_shows_queue_wait_p50_and_p99_and_a_dash_when_unknown(
    alice: User, waits: dict[str, Any]
) -> None:
    page = signed_in(alice).get("/usage/?period=hour&group=project").content.decode()
    shown = cells(page, "queue")
    assert shown["Acme / Vision / Search"].split(" / ")[0] == "0.00 ms"
    assert shown["Acme / Vision / Search"].split(" / ")[1].endswith(" s")
    assert shown["Acme / Speech / Dictation"] == "- / -"
    assert "Queue wait, p99" in page  # its chart


def test_the_people_page_shows_them_per_team(alice: User, waits: dict[str, Any], tree: Tree) -> None:
    page = signed_in(alice).get(f"/people/usage/?branch=org:{tree.org.pk}&period=hour").content.decode()
    vision = re.search(r'data-row="Vision".*?</tr>', page, re.DOTALL)
    speech = re.search(r'data-row="Speech".*?</tr>', page, re.DOTALL)
    assert vision and speech
    assert re.search(r'data-col="queue_p50">0 ms<', vision.group(0))
    assert re.search(r'data-col="queue_p99">-<', speech.group(0))


def test_the_usage_api_and_a_single_request_give_them(bob: User, waits: dict[str, Any]) -> None:
    client = signed_in(bob)
    [row] = client.get("/api/v1/usage?group_by=key").json()["results"]
    assert row["queue_ms_p50"] == 0.0 and row["queue_ms_p99"] == pytest.approx(3000.0, rel=0.01)
    assert client.get("/api/v1/requests/req_waited").json()["queue_ms"] == 3000.0
    assert client.get("/api/v1/requests/req_refused").json()["queue_ms"] is None


@pytest.mark.django_db(transaction=True)
def test_ctl_usage_prints_queue_waits_and_a_dash_for_unknown(
    live_server: Any, alice: User, waits: dict[str, Any], key_for: Any, capsys: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(alice, name="cli")
    assert main(["ctl", "--server", live_server.url, "--key", secret, "usage", "--by", "model", "--since", "1h"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    p50, p99 = header.index("P50_QUEUE_MS"), header.index("P99_QUEUE_MS")
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["llama-3-8b"][p50] == "0"
    assert float(rows["llama-3-8b"][p99]) == pytest.approx(3000.0, rel=0.01)
    assert (rows["qwen"][p50], rows["qwen"][p99]) == ("-", "-")
