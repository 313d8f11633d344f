"""The cluster page: the node table, the GPU map and its colours, held idle cards, fleet charts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client

from apps.accounts.choices import StaffRole
from apps.accounts.models import User
from apps.cluster import overview
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Replica, Shard
from tests.builders import H100, make_model, make_node, make_replica
from tests.conftest import forget_fleet_figures, make_user
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _empty_history() -> None:
    cache.clear()


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def card(
    index: int, util: float | None, *, mem: int | None = 8000, temp: float | None = 50, gpu_class: str = H100
) -> dict[str, Any]:
    return {
        "index": index,
        "gpu_class": gpu_class,
        "utilization_gpu_pct": util,
        "memory_used_mib": mem,
        "memory_total_mib": 80000,
        "temperature_gpu_c": temp,
    }


def hold(model_name: str, node: Node, indices: list[int], state: str = ReplicaState.READY) -> Replica:
    """A replica of its own GPU model holding these cards of the node."""
    model = make_model(model_name, gpus=len(indices), accelerator=H100, engine="vllm", profile="gpu")
    return make_replica(model, node, state=state, gpu_indices=tuple(indices))


@pytest.fixture
def fleet(db: Any) -> dict[str, Any]:
    """Two GPU nodes sharing the prefix "gpu-r1-", and a CPU node that does not report cards.

    gpu-r1-01: cards 0 and 1 held by "idle" and barely used.
    gpu-r1-02: card 0 held by "busy" at 45 %, card 1 held by "blind" with no utilisation figure,
               card 2 at 100 %, 95 % of its memory and 88 °C, held by nobody.
    """
    # Heartbeats kept in the history the fleet charts draw; no agent version, so that column stays empty.
    one = make_node("gpu-r1-01", cards=[card(0, 2.0), card(1, 3.0)], heartbeat=True, agent_version="")
    two = make_node(
        "gpu-r1-02",
        cards=[
            card(0, 45.0, mem=40000, temp=61),
            card(1, None, mem=None, temp=None),
            card(2, 100.0, mem=76000, temp=88),
        ],
        heartbeat=True,
        agent_version="",
    )
    return {
        "one": one,
        "two": two,
        "idle": hold("idle", one, [0, 1]),
        "busy": hold("busy", two, [0]),
        "blind": hold("blind", two, [1]),
        # A replica still starting is not "held and idle" even if its cards rest.
        "starting": hold("starting", one, [], state=ReplicaState.STARTING),
    }


def squares(page: str) -> dict[tuple[str, int], str]:
    """{(node, index): the square's classes} from the map."""
    found = {}
    for node, body in re.findall(r'data-map-node="([^"]+)">(.*?)</div>\s*</div>', page, re.DOTALL):
        for classes, index in re.findall(r'<span class="gpu-cell ([^"]+)" title="[^"]*" data-gpu="(\d+)"', body):
            found[(node, int(index))] = classes
    return found


def test_each_card_is_a_square_coloured_by_utilisation(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    assert squares(page) == {
        ("gpu-r1-01", 0): "gpu-0 gpu-held",
        ("gpu-r1-01", 1): "gpu-0 gpu-held",
        ("gpu-r1-02", 0): "gpu-4 gpu-held",
        ("gpu-r1-02", 1): "gpu-none gpu-held",
        ("gpu-r1-02", 2): "gpu-9",
    }
    assert "5 GPUs" in page
    assert "style=" not in page


def test_the_map_can_be_coloured_by_memory_or_temperature(alice: User, fleet: dict[str, Any]) -> None:
    client = signed_in(alice)
    memory = squares(client.get("/cluster/?colour=mem").content.decode())
    assert [memory[("gpu-r1-02", i)].split()[0] for i in range(3)] == ["gpu-5", "gpu-none", "gpu-9"]
    assert memory[("gpu-r1-01", 0)].split()[0] == "gpu-1"  # 8000 of 80000 MiB
    heat = squares(client.get("/cluster/?colour=temp").content.decode())
    assert [heat[("gpu-r1-02", i)].split()[0] for i in range(3)] == ["gpu-5", "gpu-none", "gpu-9"]
    assert heat[("gpu-r1-01", 0)].split()[0] == "gpu-3"  # 50 °C
    # An unknown choice colours by utilisation.
    assert squares(client.get("/cluster/?colour=rainbow").content.decode())[("gpu-r1-02", 0)].startswith("gpu-4")


def test_the_colour_is_chosen_with_links_that_htmx_follows(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/?colour=temp").content.decode()
    assert re.search(r'href="\?colour=mem" hx-get="\?colour=mem" hx-target="#cluster-live"', page)
    assert 'data-colour-link="temp" aria-current="true"' in page
    # The live part refreshes itself every 10 s with the same colour.
    assert 'hx-get="/cluster/?colour=temp" hx-trigger="every 10s"' in page


@pytest.mark.parametrize(
    ("value", "colour", "expected"),
    [
        (0.0, "util", 0),
        (9.99, "util", 0),
        (10.0, "util", 1),
        (45.0, "util", 4),
        (99.9, "util", 9),
        (100.0, "util", 9),
        (130.0, "mem", 9),
        (-3.0, "mem", 0),
        (None, "util", None),
        (float("nan"), "mem", None),
        (20.0, "temp", 0),
        (30.0, "temp", 0),
        (36.0, "temp", 1),
        (61.0, "temp", 5),
        (84.0, "temp", 9),
        (120.0, "temp", 9),
    ],
)
def test_figures_fall_into_ten_steps(value: float | None, colour: str, expected: int | None) -> None:
    assert overview.bucket(value, colour) == expected


def test_a_card_says_what_it_is_on_hover(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    title = re.search(r'<span class="gpu-cell gpu-4 gpu-held" title="([^"]*)" data-gpu="0"', page).group(1)
    assert "gpu-r1-02 GPU 0, H100-80GB" in title and "45% busy" in title and "61 °C" in title
    assert f"held by busy #{fleet['busy'].pk}" in title


def test_replicas_whose_every_card_rests_are_held_and_idle(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    idle = re.findall(r'<tr data-idle-replica="(\d+)">(.*?)</tr>', page, re.DOTALL)
    assert [int(pk) for pk, _row in idle] == [fleet["idle"].pk]
    row = idle[0][1]
    assert '<td class="clip" title="idle">idle</td>' in row
    assert '<span title="gpu-r1-01">01</span>' in row
    assert "<td>0, 1</td>" in row
    # "busy" works, "blind" cannot be told, "starting" is not ready.
    assert f'data-idle-replica="{fleet["busy"].pk}"' not in page
    assert f'data-idle-replica="{fleet["blind"].pk}"' not in page


def test_held_idle_cards_say_whose_they_are_how_long_they_rested_and_the_gpu_hours(
    alice: User, fleet: dict[str, Any]
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.accounts import services as accounts
    from apps.cluster.history import append_histories

    org = accounts.create_organization(name="Acme", actor=None)
    team = accounts.create_team(org, name="Search", actor=None)
    model = fleet["idle"].model
    model.team = team
    model.save()
    fleet["idle"].__class__.objects.filter(pk=fleet["idle"].pk).update(placed_at=timezone.now() - timedelta(hours=2))
    now = timezone.now()
    forget_fleet_figures()
    # gpu-r1-01's last 70 minutes, a sample every 2: its cards worked until 41 minutes ago, then rested.
    for minutes in range(70, -1, -2):
        util = 50.0 if minutes > 41 else 2.0
        sample = {"taken_at": (now - timedelta(minutes=minutes)).timestamp(), "gpus": [card(0, util), card(1, util)]}
        append_histories({fleet["one"].pk: sample})
    page = signed_in(alice).get("/cluster/").content.decode()
    row = re.search(rf'<tr data-idle-replica="{fleet["idle"].pk}">(.*?)</tr>', page, re.DOTALL).group(1)
    assert '<td class="clip" data-col="owner" title="Acme / Search">Acme / Search</td>' in row
    # Resting since the sample 40 minutes ago: 2 cards x 40 min = 1.33 GPU-hours.
    assert re.search(r'<td data-col="idle-for">4\d min</td>', row), row
    assert '<td data-col="gpu-hours">1.3' in row

    # The fleet's figures lost (as when llmgw is upgraded under a running fleet, or Redis restarts):
    # the next heartbeat finds the cards resting already, and the node's hour of history tells since when.
    forget_fleet_figures(history=False)
    append_histories({fleet["one"].pk: {"taken_at": now.timestamp(), "gpus": [card(0, 1.0), card(1, 1.0)]}})
    page = signed_in(alice).get("/cluster/").content.decode()
    row = re.search(rf'<tr data-idle-replica="{fleet["idle"].pk}">(.*?)</tr>', page, re.DOTALL).group(1)
    assert re.search(r'<td data-col="idle-for">4\d min</td>', row), row

    # Cards that rested in every sample the history holds rested the whole hour; a sample without
    # a figure for one of them breaks the run, as a busy one does.
    from apps.cluster.overview import _idle_since

    t0 = now.timestamp()
    rested = [{"t": t0 - m * 60, "gpus": {"0": [1.0], "1": [2.0]}} for m in (59, 40, 20, 0)]
    assert _idle_since(rested, [0, 1]) == (t0 - 59 * 60, True)
    blind = [*rested[:2], {"t": t0 - 30 * 60, "gpus": {"0": [1.0], "1": [None]}}, *rested[2:]]
    assert _idle_since(blind, [0, 1]) == (t0 - 20 * 60, False)
    assert _idle_since([], [0, 1]) == (None, False)


def test_no_idle_replica_is_said_plainly(alice: User) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    assert "No replica holds cards it leaves idle." in page
    assert "No node has reported a GPU." in page


def test_the_node_table_drops_the_shared_prefix_and_keeps_the_name_on_hover(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    table = page[page.index('id="cluster-node-table"') : page.index("</table>", page.index('id="cluster-node-table"'))]
    assert re.search(r'<td class="clip" title="gpu-r1-01"><a [^>]*href="/nodes/gpu-r1-01/">01</a></td>', table)
    assert re.search(r'<td class="clip" title="gpu-r1-02"><a [^>]*href="/nodes/gpu-r1-02/">02</a></td>', table)
    assert "gpu-r1-…" in page


def test_a_lone_node_or_names_without_a_shared_part_are_kept_whole() -> None:
    assert overview.node_prefix(["gpu-r1-01"]) == ""
    assert overview.node_prefix(["alpha", "beta"]) == ""
    assert overview.node_prefix(["gpu1", "gpu2"]) == ""  # no separator: "1" and "2" would say nothing
    assert overview.node_prefix(["dc1.rack2.n01", "dc1.rack2.n02", "dc1.rack3.n01"]) == "dc1."
    assert overview.short_name("gpu-r1-", "gpu-r1-") == "gpu-r1-"


def test_columns_empty_on_every_row_are_left_out(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    table = page[page.index('id="cluster-node-table"') :]
    header = table[: table.index("</thead>")]
    # every node of the fleet reports its engines
    assert re.findall(r'<th data-col="([\w-]+)"', header) == ["cpu", "memory", "gpus", "engines"]
    assert 'data-col="agent"' not in table and 'data-col="warnings"' not in table and 'data-col="disk"' not in table


def test_a_column_one_node_fills_is_shown(alice: User, fleet: dict[str, Any]) -> None:
    Node.objects.filter(name="gpu-r1-02").update(agent_version="0.9.1", labels={"rack": "r12"}, warnings=["fan 3 slow"])
    page = signed_in(alice).get("/cluster/").content.decode()
    header = page[page.index('id="cluster-node-table"') : page.index("</thead>")]
    assert re.findall(r'<th data-col="([\w-]+)"', header) == [
        "cpu",
        "memory",
        "gpus",
        "engines",
        "agent",
        "labels",
        "warnings",
    ]
    assert '<td data-col="labels" class="clip" title="rack=r12">rack=r12</td>' in page
    assert 'title="fan 3 slow"' in page


def test_headers_never_wrap_and_free_text_is_clipped(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    assert '<table class="data-table" id="cluster-node-table">' in page  # .data-table th: whitespace-nowrap
    css = (Path(__file__).parents[2] / "llmgw/theme/static_src/src/styles.css").read_text()
    assert re.search(r"\.data-table th \{[^}]*whitespace-nowrap", css)
    assert re.search(r"\.clip \{[^}]*text-ellipsis[^}]*whitespace-nowrap", css)
    for step in range(10):
        assert f".gpu-{step} {{" in css


def test_the_fleet_is_charted_by_gpu_class(alice: User, fleet: dict[str, Any]) -> None:
    make_node("cpu-only", cards=[], heartbeat=True, agent_version="")
    make_node("l4-01", cards=[card(0, 10.0, gpu_class="L4")], heartbeat=True, agent_version="")
    page = signed_in(alice).get("/cluster/").content.decode()
    charts = dict(re.findall(r'<figure class="card min-w-0" data-gpu-class="([^"]+)">(.*?)</figure>', page, re.DOTALL))
    assert set(charts) == {"H100-80GB", "L4"}
    assert "average of 5 cards" in charts["H100-80GB"] and "average of 1 cards" in charts["L4"]
    assert all("<svg" in chart and "no data" not in chart for chart in charts.values())


def test_htmx_refreshes_the_live_part_alone(alice: User, fleet: dict[str, Any]) -> None:
    response = signed_in(alice).get("/cluster/?colour=mem", HTTP_HX_REQUEST="true")
    body = response.content.decode()
    assert body.lstrip().startswith('<div id="cluster-live"')
    assert "<html" not in body and 'data-colour="mem"' in body
    assert 'data-map-node="gpu-r1-01"' in body and 'id="idle-table"' in body


def test_the_page_obeys_the_strict_policy(alice: User, fleet: dict[str, Any]) -> None:
    client = signed_in(alice)
    for url in ("/cluster/", "/cluster/?colour=temp"):
        for response in (client.get(url), client.get(url, HTTP_HX_REQUEST="true")):
            check_body(response, check_strict(response, url), url)


def test_staff_who_read_everything_may_look(fleet: dict[str, Any]) -> None:
    for role in (StaffRole.VIEWER, StaffRole.BILLING, StaffRole.OPERATOR):
        assert signed_in(make_user(f"{role}@example.com", role=role)).get("/cluster/").status_code == 200


def test_outsiders_are_refused(bob: User, fleet: dict[str, Any]) -> None:
    assert signed_in(bob).get("/cluster/").status_code == 403
    response = Client().get("/cluster/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert signed_in(bob).get("/").content.decode().count('href="/cluster/"') == 0


def test_the_page_reads_in_a_fixed_number_of_queries(
    alice: User, fleet: dict[str, Any], django_assert_max_num_queries: Any
) -> None:
    client = signed_in(alice)
    client.get("/cluster/")
    for index in range(3):
        make_node(f"gpu-r1-1{index}", cards=[card(0, 50.0)], heartbeat=True, agent_version="")
    with django_assert_max_num_queries(12):
        client.get("/cluster/", HTTP_HX_REQUEST="true")


def test_a_large_fleet_is_shown_a_page_of_nodes_at_a_time_and_the_rest_stays_whole(
    alice: User, fleet: dict[str, Any], django_assert_max_num_queries: Any
) -> None:
    from django.utils import timezone

    from apps.cluster.choices import NodeStatus
    from apps.cluster.models import Gpu
    from apps.cluster.selectors import NODES_PER_PAGE

    now = timezone.now()
    # gpu-r1-01 and gpu-r1-02 come first by name; then enough two-card nodes for a second page,
    # the last of which holds a replica that rests.
    extra = NODES_PER_PAGE + 3
    made = Node.objects.bulk_create(
        Node(
            name=f"gpu-r2-{i:03d}",
            status=NodeStatus.READY,
            last_seen_at=now,
            sampled_at=now,
            sample={"gpus": [card(0, 1.0), card(1, 1.0)]},
        )
        for i in range(extra)
    )
    Gpu.objects.bulk_create(Gpu(node=n, index=i, gpu_class=H100, name="H100") for n in made for i in range(2))
    resting = hold("resting", Node.objects.get(name=f"gpu-r2-{extra - 1:03d}"), [0, 1])
    client = signed_in(alice)
    client.get("/cluster/")
    # These nodes' rows were written without a heartbeat, so the fleet rollup has nothing of them:
    # their resting cards are read from their rows, in one query more whatever their number.
    with django_assert_max_num_queries(17):
        first = client.get("/cluster/").content.decode()
    table = first[
        first.index('id="cluster-node-table"') : first.index("</table>", first.index('id="cluster-node-table"'))
    ]
    assert table.count("<tr data-node=") == NODES_PER_PAGE
    assert len({node for node, _index in squares(first)}) == NODES_PER_PAGE
    total = 2 + extra
    assert f"Nodes 1–{NODES_PER_PAGE} of {total}, in the table and on the map" in first
    # The heading counts every card of the fleet, not only those on the map.
    assert f"{2 + 3 + 2 * extra} GPUs" in first
    # Held and idle is the whole fleet's: a replica on the second page is listed on the first.
    assert f'data-idle-replica="{resting.pk}"' in first and f'data-idle-replica="{fleet["idle"].pk}"' in first
    builds = first[first.index('id="engine-build-table"') :]
    assert builds.count("data-build-row=") == NODES_PER_PAGE and 'data-builds="paged"' in first

    page_two = client.get("/cluster/?colour=temp&page=2").content.decode()
    assert len({node for node, _index in squares(page_two)}) == total - NODES_PER_PAGE
    assert 'hx-get="/cluster/?colour=temp&amp;page=2"' in page_two  # htmx refreshes this page
    assert 'href="?colour=mem&amp;page=2"' in page_two  # another colour keeps the page
    assert 'rel="prev" href="?colour=temp&amp;page=1"' in page_two
    live = client.get("/cluster/?page=2", HTTP_HX_REQUEST="true").content.decode()
    assert f'data-map-node="gpu-r2-{extra - 1:03d}"' in live and 'data-map-node="gpu-r1-01"' not in live


def test_held_idle_replicas_past_the_first_fifty_are_counted_not_listed(alice: User, fleet: dict[str, Any]) -> None:
    from apps.cluster.overview import IDLE_ROWS

    node = make_node("gpu-r3-01", cards=[card(i, 0.0) for i in range(IDLE_ROWS + 2)])
    for i in range(IDLE_ROWS + 2):
        hold(f"rest-{i:02d}", node, [i])
    page = signed_in(alice).get("/cluster/").content.decode()
    # 53 replicas rest (these and fleet's "idle"): 50 listed, the costliest first, 3 counted.
    assert page.count("<tr data-idle-replica=") == IDLE_ROWS
    assert 'data-idle-rest="3"' in page and "And 3 more replicas holding idle cards" in page
    # With no history to say how long they rested, their GPU-hours are not known: not 0.
    assert "And 3 more replicas holding idle cards." in page and "0.00 GPU-hours" not in page


def grow(count: int, *, start: int = 0) -> None:
    """`count` more two-card nodes ("gpu-r4-000"...), each heartbeating, the second holding a replica."""
    for i in range(start, start + count):
        node = make_node(f"gpu-r4-{i:03d}", cards=[card(0, 1.0), card(1, 60.0)], heartbeat=True, agent_version="")
        if i % 2:
            hold(f"r4-{i:03d}", node, [0])


def queries_of(client: Client, path: str, *, htmx: bool = False) -> int:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        assert client.get(path, headers={"HX-Request": "true"} if htmx else None).status_code == 200
    return len(captured)


@pytest.mark.parametrize("kept", [True, False], ids=["worker's summary", "no worker"])
@pytest.mark.parametrize("per_page", [100, 4], ids=["one page", "paged"])
def test_the_page_reads_as_many_queries_for_fifty_nodes_as_for_ten(
    alice: User, kept: bool, per_page: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One page: the fleet on it whole (?page=2 is the last page, the first). Paged: a page of four,
    # the first and the second, of three pages or of thirteen.
    monkeypatch.setattr("apps.cluster.selectors.NODES_PER_PAGE", per_page)
    client = signed_in(alice)
    counts = []
    for nodes in (10, 50):
        grow(nodes - Node.objects.count(), start=Node.objects.count())
        if kept:
            overview.summarise_idle(keep=True)  # what the worker keeps every IDLE_SUMMARY_SECONDS
        client.get("/cluster/")  # the session's first look writes what it writes
        counts.append(
            [
                queries_of(client, "/cluster/"),
                queries_of(client, "/cluster/", htmx=True),
                queries_of(client, "/cluster/?page=2"),
            ]
        )
    assert counts[0] == counts[1], counts


def test_the_pager_counts_the_fleet_as_the_worker_did_and_the_last_page_as_it_is(
    alice: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("apps.cluster.selectors.NODES_PER_PAGE", 4)
    grow(10)
    overview.summarise_idle(keep=True)
    client = signed_in(alice)
    assert "Nodes 1–4 of 10, in the table and on the map" in client.get("/cluster/").content.decode()
    # Two nodes join after the worker counted: the first page keeps its count until the next pass,
    # and the last page, read to its end, shows them and the total as it is.
    grow(2, start=10)
    assert "Nodes 1–4 of 10," in client.get("/cluster/").content.decode()
    last = client.get("/cluster/?page=3").content.decode()
    assert "Nodes 9–12 of 12," in last and 'rel="next"' not in last
    assert {node for node, _index in squares(last)} == {f"gpu-r4-{i:03d}" for i in range(8, 12)}
    # Nodes leave: a page past the end is the last one, as the nodes page does it.
    Shard.objects.filter(node__name__gte="gpu-r4-006").delete()
    Node.objects.filter(name__gte="gpu-r4-006").delete()
    past = client.get("/cluster/?page=3").content.decode()
    assert "Nodes 5–6 of 6," in past and 'rel="next"' not in past
    assert {node for node, _index in squares(past)} == {"gpu-r4-004", "gpu-r4-005"}
    # Anything but a page number is the first page; a page past any count, the last.
    assert "Nodes 1–4 of " in client.get("/cluster/?page=x").content.decode()
    assert "Nodes 5–6 of 6," in client.get("/cluster/?page=99").content.decode()


def test_a_node_is_found_from_the_page_on_the_nodes_page(alice: User, fleet: dict[str, Any]) -> None:
    page = signed_in(alice).get("/cluster/").content.decode()
    form = re.search(r'<form method="get" action="([^"]+)"[^>]*data-form="node-find">(.*?)</form>', page, re.DOTALL)
    assert form is not None and form.group(1) == "/nodes/" and 'name="find"' in form.group(2)
    # Outside the part htmx refreshes, so a name being typed is not wiped out.
    live = signed_in(alice).get("/cluster/", headers={"HX-Request": "true"}).content.decode()
    assert 'data-form="node-find"' not in live
    found = signed_in(alice).get("/nodes/?find=r1-02").content.decode()
    assert 'data-node="gpu-r1-02"' in found and 'data-node="gpu-r1-01"' not in found
