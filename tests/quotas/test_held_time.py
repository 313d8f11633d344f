"""GPU time per owner: the cards (or cores) each placed replica holds, counted second by second for
its model's owner by GPU class, and shown per owner and model on the usage page and in the API next
to the tokens served. The figures are worked out by hand from the replicas' placement times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import time_machine
from django.conf import settings
from django.test import Client

from apps.accounts import services as accounts
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import Membership
from apps.cluster.choices import ReplicaState
from apps.cluster.held import accrue_held_time
from apps.cluster.models import Replica
from apps.quotas.models import HeldTime
from apps.quotas.selectors import usage_summary
from apps.quotas.usage import write_records_sync
from tests.builders import make_model, make_node, make_replica
from tests.conftest import make_user
from tests.quotas.conftest import make_key, record

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 2, 10, 30, tzinfo=UTC)


def _fleet() -> dict[str, Any]:
    """At 10:30 a team's 70B model is placed on four H100s; at 10:45 its organisation's CPU model on
    8 cores of a CPU node."""
    org = accounts.create_organization(name="Acme", actor=None)
    team = accounts.create_team(org, name="Search", actor=None)
    gpu_node = make_node("gpu1", gpus=8)
    cpu_node = make_node("cpu1")
    big = make_model("llama-70b", gpus=4)
    big.team = team
    big.save()
    small = make_model("qwen-cpu", cores=8, memory_gb=8)
    small.organization = org
    small.save()
    with time_machine.travel(T0, tick=False):
        gpu_replica = make_replica(big, gpu_node, gpu_indices=(0, 1, 2, 3))
    with time_machine.travel(T0 + timedelta(minutes=15), tick=False):
        cpu_replica = make_replica(small, cpu_node)
    cpu_replica.shards.update(cpu_cores=8)
    return {"org": org, "team": team, "gpu": gpu_replica, "cpu": cpu_replica}


def _held() -> dict[tuple[str, str, str], tuple[float, float]]:
    return {
        (f"{h.bucket_start:%H}", h.model, h.gpu_class): (h.gpu_seconds, h.core_seconds)
        for h in HeldTime.objects.order_by("bucket_start", "model")
    }


def test_held_time_is_counted_each_minute_split_by_hour_and_closed_when_a_replica_goes() -> None:
    fleet = _fleet()
    accrue_held_time(T0 + timedelta(minutes=45))  # 11:15
    accrue_held_time(T0 + timedelta(minutes=45))  # the same moment again: nothing twice
    assert _held() == {
        ("10", "llama-70b", "H100-80GB"): (4 * 1800, 0),
        ("10", "qwen-cpu", ""): (0, 8 * 900),
        ("11", "llama-70b", "H100-80GB"): (4 * 900, 0),
        ("11", "qwen-cpu", ""): (0, 8 * 900),
    }
    # At 12:00 the GPU replica is released: its last stretch is counted as it goes.
    with time_machine.travel(T0 + timedelta(minutes=90), tick=False):
        fleet["gpu"].delete()
    accrue_held_time(T0 + timedelta(minutes=120))  # 12:30: only the CPU model still holds
    held = _held()
    assert held[("11", "llama-70b", "H100-80GB")] == (4 * 3600, 0)
    assert ("12", "llama-70b", "H100-80GB") not in held
    assert held[("12", "qwen-cpu", "")] == (0, 8 * 1800)
    row = HeldTime.objects.filter(model="llama-70b").first()
    assert row is not None and (row.organization_id, row.team_id, row.project_id) == (
        fleet["org"].pk,
        fleet["team"].pk,
        0,
    )


def test_a_failed_replica_holds_until_its_claims_are_given_back() -> None:
    fleet = _fleet()
    Replica.objects.filter(pk=fleet["gpu"].pk).update(state=ReplicaState.FAILED)
    accrue_held_time(T0 + timedelta(minutes=30))  # failed, still holding its cards
    with time_machine.travel(T0 + timedelta(minutes=40), tick=False):
        fleet["gpu"].shards.all().delete()  # back to pending: the claims go
        Replica.objects.filter(pk=fleet["gpu"].pk).update(state=ReplicaState.PENDING)
    accrue_held_time(T0 + timedelta(minutes=60))
    total = sum(h.gpu_seconds for h in HeldTime.objects.filter(model="llama-70b"))
    assert total == 4 * 40 * 60


def test_usage_shows_gpu_hours_per_owner_and_model_next_to_tokens(client: Client, api: Any) -> None:
    fleet = _fleet()
    accrue_held_time(T0 + timedelta(minutes=150))  # 13:00: 2.5 h on four cards, 2.25 h on 8 cores
    alice = make_user("alice@example.com")
    key = make_key(alice)
    write_records_sync([record(key, model="llama-70b", created_at=T0 + timedelta(minutes=5))])
    since, until = T0 - timedelta(minutes=30), T0 + timedelta(minutes=150)
    staff = make_user("vic@example.com", role=StaffRole.VIEWER)
    by_model = {row.group: row for row in usage_summary(staff, group_by="model", since=since, until=until)}
    assert by_model["llama-70b"].gpu_hours == {"H100-80GB": 10.0} and by_model["llama-70b"].requests == 1
    assert by_model["qwen-cpu"].gpu_hours == {} and by_model["qwen-cpu"].core_hours == 18.0
    by_org = {row.label: row for row in usage_summary(staff, group_by="organization", since=since, until=until)}
    assert by_org["Acme"].gpu_hours == {"H100-80GB": 10.0} and by_org["Acme"].core_hours == 18.0
    by_team = {row.label: row for row in usage_summary(staff, group_by="team", since=since, until=until)}
    assert by_team["Acme / Search"].gpu_hours == {"H100-80GB": 10.0}
    assert by_team["(none)"].core_hours == 18.0  # the organisation's own model, on no team
    # Held time belongs to owners: the team's manager sees the team's, a plain member none.
    manager = make_user("mona@example.com")
    Membership.objects.create(user=manager, organization=fleet["org"], team=fleet["team"], role=MembershipRole.MANAGER)
    mine = {row.group: row for row in usage_summary(manager, group_by="model", since=since, until=until)}
    assert mine["llama-70b"].gpu_hours == {"H100-80GB": 10.0} and "qwen-cpu" not in mine
    theirs = usage_summary(alice, group_by="model", since=since, until=until)
    assert [(row.group, row.gpu_hours) for row in theirs] == [("llama-70b", None)]  # her request, no held time
    # The API and the page say the same.
    api.force_authenticate(staff)
    answer = api.get(
        "/api/v1/usage", {"group_by": "model", "since": since.isoformat(), "until": until.isoformat()}
    ).json()
    rows = {row["group"]: row for row in answer["results"]}
    assert rows["llama-70b"]["gpu_hours"] == {"H100-80GB": 10.0} and rows["qwen-cpu"]["core_hours"] == 18.0
    client.force_login(staff)
    with time_machine.travel(T0 + timedelta(minutes=160), tick=False):
        page = client.get("/usage/?period=day&group=model").content.decode()
    assert 'data-col="gpu-hours" title="H100-80GB 10.0">10.0</td>' in page


def test_the_beat_counts_held_time_every_minute() -> None:
    from apps.cluster.tasks import accrue_held_time as task

    entry = settings.CELERY_BEAT_SCHEDULE["accrue-held-time"]
    assert entry["task"] == "apps.cluster.tasks.accrue_held_time" and entry["schedule"] == 60.0
    _fleet()
    with time_machine.travel(T0 + timedelta(minutes=60), tick=False):
        assert task() == 2
    assert HeldTime.objects.count() == 4  # each model in the 10:00 and the 11:00 hour


@pytest.mark.django_db(transaction=True)
def test_ctl_usage_shows_gpu_and_core_hours(live_server, key_for, capsys, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    _fleet()
    now = T0 + timedelta(minutes=150)
    accrue_held_time(now)
    secret = key_for(make_user("vic@example.com", role=StaffRole.VIEWER))
    with time_machine.travel(now, tick=False):
        assert main(["ctl", "--server", live_server.url, "--key", secret, "usage", "--since", "6h"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    at = header.index("GPU_HOURS")
    assert rows["llama-70b"][at : at + 3] == ["10.0", "(H100-80GB)", "0.0"]
    assert rows["qwen-cpu"][at : at + 2] == ["0.0", "18.0"]


def test_tokens_per_gpu_hour_and_per_watt_hour_from_the_cards_measured_power() -> None:
    cards = [{"index": i, "gpu_class": "H100-80GB", "power_draw_w": 350.0} for i in range(4)]
    with time_machine.travel(T0, tick=False):
        node = make_node("gpu1", cards=[*cards, {"index": 4, "gpu_class": "H100-80GB"}])  # card 4: no reading
        measured = make_replica(make_model("measured", gpus=4), node, gpu_indices=(0, 1, 2, 3))
        partly = make_replica(make_model("partly", gpus=2), node, gpu_indices=(3, 4), port=9100)
    accrue_held_time(T0 + timedelta(seconds=60))
    held = HeldTime.objects.get(model="measured")
    counted = (held.gpu_seconds, held.energy_joules, held.measured_seconds)  # card-seconds, joules, card-seconds
    assert counted == (240, 4 * 350 * 60, 240)
    key = make_key(make_user("alice@example.com"))
    at = T0 + timedelta(seconds=30)
    write_records_sync(
        [
            record(key, model=name, prompt_tokens=1000, completion_tokens=400, created_at=at)
            for name in ("measured", "partly")
        ]
    )
    staff = make_user("vic@example.com", role=StaffRole.VIEWER)
    rows = {row.group: row for row in usage_summary(staff, group_by="model", since=T0, until=T0 + timedelta(minutes=1))}
    assert rows["measured"].watt_hours == pytest.approx(4 * 350 / 60)  # four cards, a minute
    assert rows["measured"].tokens_per_gpu_hour == pytest.approx(1400 / (240 / 3600))
    assert rows["measured"].tokens_per_watt_hour == pytest.approx(1400 / (4 * 350 / 60))
    # One of its two cards reports no power: its energy is unknown, not half.
    assert rows["partly"].tokens_per_gpu_hour == pytest.approx(1400 / (120 / 3600))
    assert rows["partly"].watt_hours is None and rows["partly"].tokens_per_watt_hour is None
    assert measured.pk != partly.pk
