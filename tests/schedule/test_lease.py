"""One scheduler acts: the lease is renewed by its holder, taken by another only once it expired,
given up on a clean stop; and a periodic task is sent at most once per interval whichever
scheduler sends it (apps/schedule/lease.py), on the database's own clock."""

from __future__ import annotations

from datetime import timedelta

import pytest
from celery.beat import ScheduleEntry
from celery.schedules import schedule
from django.db.models.functions import Now

from apps.schedule import lease
from apps.schedule.models import PeriodicRun, SchedulerLease
from apps.schedule.scheduler import LeasedScheduler
from llmgw.celery import app

pytestmark = pytest.mark.django_db


def expire() -> None:
    SchedulerLease.objects.update(expires_at=Now() - timedelta(seconds=1))


def test_the_holder_renews_and_another_takes_over_only_once_it_expired() -> None:
    assert lease.hold("a:1:x")
    assert not lease.hold("b:2:y")
    assert lease.hold("a:1:x")  # renewed
    acting = lease.acting()
    assert acting is not None and (acting.host, acting.pid) == ("a", "1")
    expire()
    assert lease.acting() is None  # nobody acts until someone asks
    assert lease.hold("b:2:y")
    assert not lease.hold("a:1:x")  # the old holder, back, stands by
    assert lease.acting().holder == "b:2:y"  # type: ignore[union-attr]
    lease.release("b:2:y")
    assert lease.acting() is None and lease.hold("a:1:x")


def test_a_task_is_sent_at_most_once_per_interval_by_any_scheduler() -> None:
    assert lease.claim_run("reconcile", 5.0, "a:1:x")
    assert not lease.claim_run("reconcile", 5.0, "b:2:y")  # the other one, a moment later
    assert not lease.claim_run("reconcile", 5.0, "a:1:x")
    PeriodicRun.objects.update(sent_at=Now() - timedelta(seconds=4.6))  # within the slack (0.5 s)
    assert lease.claim_run("reconcile", 5.0, "b:2:y")
    assert PeriodicRun.objects.get().sent_by == "b:2:y"
    assert lease.claim_run("once-a-day", None, "a:1:x") and lease.claim_run("once-a-day", None, "a:1:x")


def entry(name: str, seconds: float) -> ScheduleEntry:
    return ScheduleEntry(name=name, task="apps.cluster.tasks.reconcile", schedule=schedule(seconds), app=app)


def test_a_standing_by_scheduler_sends_nothing_and_acts_once_the_lease_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []
    monkeypatch.setattr(
        "celery.beat.Scheduler.apply_async", lambda self, e, producer=None, advance=True, **kw: sent.append(e.name)
    )
    first, second = LeasedScheduler(app, lazy=True), LeasedScheduler(app, lazy=True)
    first.tick()
    second.tick()
    assert first.acting and not second.acting
    for scheduler in (first, second):
        scheduler.apply_entry(entry("reconcile", 5.0))
    assert sent == ["reconcile"]
    first.close()  # a clean stop gives the lease up
    second._next_ask = 0.0
    second.tick()
    assert second.acting
    second.apply_entry(entry("reconcile", 5.0))
    assert sent == ["reconcile"]  # sent by the first within its interval: not again
    second.apply_entry(entry("push", 60.0))
    assert sent == ["reconcile", "push"]
