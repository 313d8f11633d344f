"""The fleet rollup the cluster page reads: fed by the heartbeats as the agents' connections write
them, read back as the "Held and idle" table and the GPU-class charts."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from agent import protocol
from apps.accounts.models import User
from apps.cluster import history, reports, rollup
from apps.cluster.models import Node
from tests.builders import H100, make_model, make_node, make_replica
from tests.cluster.test_consumer import connect, database_sync, enrolled, register

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _empty_rollup() -> None:
    cache.clear()


def card(index: int, util: float | None) -> dict[str, Any]:
    return {"index": index, "gpu_class": H100, "utilization_gpu_pct": util, "memory_total_mib": 80000}


def beat(node: Node, minutes_ago: float, utils: list[float | None]) -> None:
    """One heartbeat as the connection's writer stores it, taken `minutes_ago`."""
    taken = time.time() - minutes_ago * 60
    sample = {"taken_at": taken, "gpus": [card(i, u) for i, u in enumerate(utils)]}
    reports.record_heartbeats({node.pk: (sample, timezone.now())})


def idle_row(user: User, replica_id: int) -> str | None:
    client = Client()
    client.force_login(user)
    page = client.get("/cluster/").content.decode()
    found = re.search(rf'<tr data-idle-replica="{replica_id}">(.*?)</tr>', page, re.DOTALL)
    return found.group(1) if found else None


def idle_for(row: str | None) -> str:
    found = re.search(r'<td data-col="idle-for">(.*?)</td>', row or "")
    return found.group(1) if found else "not listed"


def held(node: Node, cards: list[int], name: str = "m") -> Any:
    """A replica holding these cards, placed two hours ago."""
    from apps.cluster.models import Replica

    model = make_model(name, gpus=len(cards), accelerator=H100, engine="vllm", profile="gpu")
    replica = make_replica(model, node, gpu_indices=tuple(cards))
    Replica.objects.filter(pk=replica.pk).update(placed_at=timezone.now() - timezone.timedelta(hours=2))
    return replica


def beats(node: Node, start: float, end: float, utils: list[float | None]) -> None:
    """Heartbeats every two minutes from `start` minutes ago down to `end` (excluded)."""
    minutes = start
    while minutes > end:
        beat(node, minutes, utils)
        minutes -= 2


def test_a_run_of_rest_begins_at_its_first_resting_sample_and_a_busy_one_ends_it(alice: User) -> None:
    node = make_node("gpu-01", cards=[card(0, None), card(1, None)])
    replica = held(node, [0, 1])
    beats(node, 50, 40, [60.0, 70.0])  # working
    beats(node, 40, 30, [1.0, 60.0])  # card 1 still works
    beats(node, 30, 0, [1.0, 2.0])  # both rest from here
    beat(node, 0, [0.0, 4.9])
    row = idle_row(alice, replica.pk)
    assert row is not None and re.fullmatch(r"(29|30|31) min", idle_for(row)), row
    # 2 cards x 30 minutes = 1.0 GPU-hour; the busiest card is the one at 4.9 %.
    assert '<td data-col="gpu-hours">1.0' in row and "<td>5%</td>" in row

    beat(node, -0.1, [0.0, 35.0])  # one card works again: no longer held idle
    assert idle_row(alice, replica.pk) is None
    beat(node, -0.2, [0.0, 1.0])  # and the next run begins now
    assert idle_for(idle_row(alice, replica.pk)) == "0 min"


def test_a_card_without_a_figure_or_a_gap_in_the_samples_breaks_the_run(alice: User) -> None:
    node = make_node("gpu-01", cards=[card(0, None)])
    replica = held(node, [0])
    beats(node, 40, 30, [1.0])
    beat(node, 30, [None])  # unknown is not resting
    beats(node, 25, 16, [1.0])
    assert re.fullmatch(r"2[456] min", idle_for(idle_row(alice, replica.pk)))
    # Six minutes without a sample: what the card did meanwhile is unknown.
    beats(node, 10, -1, [1.0])
    assert re.fullmatch(r"(9|10|11) min", idle_for(idle_row(alice, replica.pk)))


def test_cards_resting_when_their_node_is_first_seen_rested_at_least_that_long(alice: User) -> None:
    node = make_node("gpu-01", cards=[card(0, None)])
    replica = held(node, [0])
    cache.clear()  # nothing kept of the node: as after its first heartbeat here
    beats(node, 20, -1, [0.0])
    assert re.fullmatch(r"at least (19|20|21) min", idle_for(idle_row(alice, replica.pk)))
    # A replica placed after the run began has rested since it was placed, and that is known.
    from apps.cluster.models import Replica

    Replica.objects.filter(pk=replica.pk).update(placed_at=timezone.now() - timezone.timedelta(minutes=5))
    assert re.fullmatch(r"(4|5|6) min", idle_for(idle_row(alice, replica.pk)))


def test_a_late_sample_changes_nothing(alice: User) -> None:
    node = make_node("gpu-01", cards=[card(0, None)])
    replica = held(node, [0])
    beats(node, 30, 10, [70.0])
    beats(node, 10, -1, [1.0])
    beat(node, 5, [90.0])  # an older sample written late
    assert re.fullmatch(r"(9|10|11) min", idle_for(idle_row(alice, replica.pk)))


def test_a_node_whose_figures_stopped_coming_is_not_called_idle(alice: User) -> None:
    node = make_node("gpu-01", cards=[card(0, None)])
    replica = held(node, [0])
    beat(node, 5, [1.0])
    assert idle_row(alice, replica.pk) is not None
    states = rollup.resting([node.pk], history.client(), now=time.time() + rollup.FRESH_SECONDS + 1)
    assert states == {}
    # The node's row is not fresh either (no heartbeat for two minutes): unknown, not idle.
    Node.objects.filter(pk=node.pk).update(sampled_at=timezone.now() - timezone.timedelta(minutes=2))
    assert rollup.resting([node.pk], history.client(), now=time.time() + 120) == {}


def test_the_class_charts_average_every_card_of_the_class_per_slot(alice: User) -> None:
    one = make_node("gpu-01", cards=[card(0, None), card(1, None)])
    two = make_node("gpu-02", cards=[card(0, None)])
    slot = rollup.CHART_BUCKET_SECONDS
    start = (time.time() // slot - 10) * slot + 1
    for node, utils in ((one, [10.0, 20.0]), (two, [60.0])):
        sample = {"taken_at": start, "gpus": [card(i, u) for i, u in enumerate(utils)]}
        reports.record_heartbeats({node.pk: (sample, timezone.now())})
    series = rollup.class_series(history.client())
    assert series[H100] == [(start - 1, 30.0)]  # (10 + 20 + 60) / 3 cards


async def test_heartbeats_through_the_agent_connection_feed_the_page(alice: User) -> None:
    """An agent connects, registers and heartbeats its two resting cards; the page lists the replica
    that holds them, after the connection's writer flushed."""
    from apps.cluster.heartbeats import writer

    node, credential = await database_sync(enrolled)
    ws = await connect(credential)
    await register(ws)
    replica = await database_sync(lambda: held(Node.objects.get(pk=node.pk), [0, 1]))
    for _ in range(2):
        sample = {"taken_at": time.time(), "gpus": [card(0, 0.0), card(1, 2.0)]}
        await ws.send_to(text_data=protocol.encode("heartbeat", {"sample": sample}))
        await asyncio.sleep(0.05)
        await writer.flush()
    row = await database_sync(lambda: idle_row(alice, replica.pk))
    assert row is not None and idle_for(row).startswith("at least")
    await ws.disconnect()


def test_the_rollup_of_a_large_fleet_is_kept_whole() -> None:
    """Every node's state is kept, whichever cache holds it: the local cache's default cap of 300
    keys would have dropped most of a fleet of 2,000."""
    now = time.time()
    samples = {node_id: {"taken_at": now, "gpus": [card(0, 1.0)]} for node_id in range(1, 2001)}
    for start in range(1, 2001, 500):
        rollup.record({i: samples[i] for i in range(start, start + 500)}, history.client())
    states = rollup.resting(samples, history.client())
    assert len(states) == 2000 and all(state.span(1) for state in states.values())


def test_the_page_reads_the_workers_summary_while_it_is_fresh_and_works_it_out_when_stale(alice: User) -> None:
    """The worker works the held idle replicas out every IDLE_SUMMARY_SECONDS; a look at the page
    reads that, checks the listed replicas' cards against their nodes' fresh samples, and works the
    list out itself when the summary is stale (a worker that stopped)."""
    from dataclasses import replace

    from apps.cluster import overview, tasks

    one = make_node("gpu-01", cards=[card(0, None)])
    first = held(one, [0], name="first")
    beats(one, 10, -1, [1.0])
    tasks.summarise_idle_cards.apply()
    kept = cache.get(overview.IDLE_SUMMARY_KEY)
    assert [r.replica_id for r in kept.shown] == [first.pk]

    # A replica that began to rest after the summary was made shows at the worker's next pass.
    two = make_node("gpu-02", cards=[card(0, None)])
    second = held(two, [0], name="second")
    beats(two, 10, -1, [1.0])
    assert idle_row(alice, first.pk) is not None and idle_row(alice, second.pk) is None

    # A listed replica whose card is busy again is not shown as idle, summary or not.
    beat(one, -0.1, [60.0])
    assert idle_row(alice, first.pk) is None

    # A stale summary is not used: the page works the list out from the rollup.
    cache.set(overview.IDLE_SUMMARY_KEY, replace(kept, at=kept.at - overview.IDLE_SUMMARY_STALE_SECONDS - 1))
    assert idle_row(alice, second.pk) is not None and idle_row(alice, first.pk) is None
    tasks.summarise_idle_cards.apply()
    assert [r.replica_id for r in cache.get(overview.IDLE_SUMMARY_KEY).shown] == [second.pk]


def test_the_replicas_past_the_listed_ones_are_counted_with_the_gpu_hours_they_hold_idle_now(alice: User) -> None:
    from apps.cluster import overview

    node = make_node("gpu-01", cards=[card(i, None) for i in range(overview.IDLE_ROWS + 2)])
    replicas = [held(node, [i], name=f"m{i:02d}") for i in range(overview.IDLE_ROWS + 2)]
    beats(node, 30, -1, [1.0] * (overview.IDLE_ROWS + 2))
    summary = overview.summarise_idle(keep=True)
    assert summary.more == 2 and summary.timed_cards == 2
    assert {r.replica_id for r in summary.shown} | {r.pk for r in replicas[-2:]} >= {r.pk for r in replicas}
    # Two cards resting some 30 minutes: about one GPU-hour, and more as time goes on.
    assert 0.9 < summary.more_hours(summary.at) < 1.1
    assert summary.more_hours(summary.at + 1800) == pytest.approx(summary.more_hours(summary.at) + 1.0)
    page = Client()
    page.force_login(alice)
    assert re.search(
        r'data-idle-rest="2">.*And 2 more replicas holding idle cards, 1\.\d\d GPU-hours',
        page.get("/cluster/").content.decode(),
    )


def test_the_beat_works_the_summary_out_as_often_as_the_page_expects() -> None:
    from django.conf import settings
    from django.utils.module_loading import import_string

    from apps.cluster import overview

    entry = settings.CELERY_BEAT_SCHEDULE["summarise-idle-cards"]
    assert entry["schedule"] == overview.IDLE_SUMMARY_SECONDS
    assert 2 * entry["schedule"] < overview.IDLE_SUMMARY_STALE_SECONDS  # a late pass is not a stale page
    import_string(entry["task"]).apply()
    assert isinstance(cache.get(overview.IDLE_SUMMARY_KEY), overview.IdleSummary)
