from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.core.cache import cache
from django.test import Client
from django.utils import timezone

from apps.accounts.models import AuditEvent
from apps.cluster import history
from apps.cluster.choices import NodeStatus
from apps.cluster.enrolment import _hash
from apps.cluster.models import EnrollmentToken, Gpu, Node
from tests.builders import GB, H100, make_model, make_node

pytestmark = pytest.mark.django_db

TIB = 1024**4


@pytest.fixture(autouse=True)
def _empty_history() -> None:
    cache.clear()


def gpu_sample(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "gpu_class": H100,
        "name": "NVIDIA H100 80GB HBM3",
        "utilization_gpu_pct": 40 + index,
        "memory_used_mib": 20000,
        "memory_total_mib": 81559,
        "temperature_gpu_c": 61 + index,
        "temperature_memory_c": 70 + index,
        "power_draw_w": 300 + index,
        "power_limit_w": 700,
        "sm_clock_mhz": 1980,
        "throttle_reasons": [],
        "ecc_uncorrected_volatile": 0,
        "xids": {"79": 2} if index == 3 else {},
        "remapped_rows_uncorrectable": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "pcie_replay_count": 0,
        "nvlink_errors": {},
        "foreign_processes": 0,
    }


def make_sample(gpus: int = 0) -> dict[str, Any]:
    return {
        "taken_at": timezone.now().timestamp(),
        "cpu_utilization_pct": 37.5,
        "cpus": 64,
        "load": [3.1, 2.9, 2.5],
        "memory_total_bytes": 512 * GB,
        "memory_used_bytes": 100 * GB,
        "cpu_package_temp_c": 55,
        "inlet_temp_c": 22,
        "cpu_package_power_w": 210,
        "gpus": [gpu_sample(i) for i in range(gpus)],
        "storage": [
            {
                "mount_point": "/models",
                "fstype": "xfs",
                "shared": False,
                "total_bytes": 4 * TIB,
                "free_bytes": 3 * TIB,
                "directories": ["/models"],
                "weights": ["qwen3-32b"],
            },
            {
                "mount_point": "/mnt/filer",
                "fstype": "nfs4",
                "shared": True,
                "total_bytes": 20 * TIB,
                "free_bytes": 10 * TIB,
                "directories": ["/mnt/filer/models"],
                "weights": [],
            },
        ],
        "warnings": ["inlet sensor missing"],
    }


# What this file's agent says at registration: the figures a node's page shows.
HARDWARE = {
    "cpu_model": "Intel Xeon Platinum 8480+",
    "cpus": 64,
    "sockets": 2,
    "os": "Ubuntu 22.04.4 LTS",
    "kernel": "5.15.0-105-generic",
    "arch": "x86_64",
    "memory_total_bytes": 512 * GB,
    "driver_version": "535.161.08",
    "cuda_version": "12.2",
    "has_avx2": True,
}


def hardware(gpus: int = 0) -> dict[str, Any]:
    return {**HARDWARE, "gpu_count": gpus}


def cell(content: bytes, node: str, column: str) -> str:
    row = re.search(rb'<tr data-node="' + node.encode() + rb'">(.*?)</tr>', content, re.S)
    assert row is not None, f"no row for {node}"
    found = re.search(rb'<td data-col="' + column.encode() + rb'">(.*?)</td>', row.group(1), re.S)
    assert found is not None, f"no {column} cell"
    return re.sub(r"<[^>]+>", "", found.group(1).decode()).strip()


def signed_in(client: Client, user: Any) -> Client:
    client.force_login(user)
    return client


# Who may see and do what -------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", "/nodes/"),
        ("get", "/nodes/gpu1/"),
        ("get", "/nodes/add/"),
        ("post", "/nodes/add/"),
        ("post", "/nodes/gpu1/cordon"),
        ("post", "/nodes/gpu1/uncordon"),
    ],
)
def test_an_outsider_is_refused_every_node_page(client: Client, bob, method: str, path: str) -> None:
    make_node()
    response = getattr(signed_in(client, bob), method)(path, {"name": "x", "reason": "x"} if method == "post" else {})
    assert response.status_code == 403
    assert not Node.objects.filter(cordoned=True).exists()
    assert not EnrollmentToken.objects.exists()


def test_an_outsider_is_refused_even_for_a_node_that_does_not_exist(client: Client, bob) -> None:
    assert signed_in(client, bob).get("/nodes/nope/").status_code == 403


def test_strangers_are_asked_to_sign_in(client: Client) -> None:
    response = client.get("/nodes/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_a_viewer_sees_the_nodes_but_may_not_change_them(client: Client, viola) -> None:
    make_node()
    signed_in(client, viola)
    listing = client.get("/nodes/")
    assert listing.status_code == 200
    assert b'href="/nodes/gpu1/"' in listing.content
    assert b"/nodes/add/" not in listing.content
    page = client.get("/nodes/gpu1/")
    assert page.status_code == 200
    assert b'data-action="cordon"' not in page.content
    assert client.post("/nodes/gpu1/cordon", {"reason": "fan"}).status_code == 403
    assert client.post("/nodes/gpu1/uncordon").status_code == 403
    assert client.get("/nodes/add/").status_code == 403
    assert client.post("/nodes/add/", {"name": "gpu9", "expires_hours": 1}).status_code == 403
    assert not Node.objects.get().cordoned
    assert not EnrollmentToken.objects.exists()


def test_the_nav_links_to_nodes_for_readers_only(client: Client, bob, viola) -> None:
    assert b'href="/nodes/"' not in signed_in(client, bob).get("/").content
    assert b'href="/nodes/"' in signed_in(client, viola).get("/").content


def test_an_unknown_node_is_not_found(client: Client, viola) -> None:
    assert signed_in(client, viola).get("/nodes/nope/").status_code == 404


# The nodes page ------------------------------------------------------------------------------


def test_the_nodes_page_shows_each_nodes_figures(client: Client, alice) -> None:
    make_node(
        gpus=8, sample=make_sample(gpus=8), hardware=hardware(gpus=8), cordoned=True, cordon_reason="replacing a fan"
    )
    response = signed_in(client, alice).get("/nodes/")
    assert response.status_code == 200
    content = response.content
    assert b'href="/nodes/add/"' in content
    assert cell(content, "gpu1", "gpus") == "8× H100-80GB"
    assert cell(content, "gpu1", "cpu").startswith("38%")
    assert "64 CPUs" in cell(content, "gpu1", "cpu")
    assert cell(content, "gpu1", "memory") == "100.0 GiB of 512.0 GiB"
    disk = cell(content, "gpu1", "disk")
    assert "3.0 TiB free of 4.0 TiB" in disk and "+ shared 10.0 TiB free" in disk
    assert cell(content, "gpu1", "warnings") == "1"
    assert b'title="inlet sensor missing"' in content
    assert b'title="replacing a fan"' in content
    assert b'hx-trigger="every 5s"' in content


def test_a_node_without_a_sample_shows_dashes_not_zeros(client: Client, alice) -> None:
    make_node("quiet", sample=False, status=NodeStatus.PENDING)
    content = signed_in(client, alice).get("/nodes/").content
    assert cell(content, "quiet", "cpu").startswith("-")
    assert cell(content, "quiet", "memory") == "-"
    assert cell(content, "quiet", "disk") == "-"
    assert b"0%" not in content
    assert "waiting for its agent" in content.decode()


def test_a_stale_sample_shows_dashes(client: Client, alice) -> None:
    make_node("old", sample=make_sample(), sample_age=timedelta(minutes=5), status=NodeStatus.UNREACHABLE)
    content = signed_in(client, alice).get("/nodes/").content
    assert cell(content, "old", "cpu").startswith("-")
    assert cell(content, "old", "memory") == "-"
    assert cell(content, "old", "disk") == "-"
    assert b"0%" not in content and b"38%" not in content


def test_an_htmx_refresh_gets_only_the_table(client: Client, viola) -> None:
    make_node()
    response = signed_in(client, viola).get("/nodes/", headers={"HX-Request": "true"})
    assert response.status_code == 200
    body = response.content.decode().strip()
    assert body.startswith('<div id="node-table"')
    assert "<html" not in body and "<nav" not in body
    assert 'data-node="gpu1"' in body
    boosted = client.get("/nodes/", headers={"HX-Request": "true", "HX-Boosted": "true"})
    assert b"<html" in boosted.content


def test_the_nodes_list_does_not_query_per_node(client: Client, alice, django_assert_max_num_queries) -> None:
    for i in range(20):
        make_node(f"gpu{i:02d}", gpus=2, sample=make_sample(gpus=2), hardware=hardware(gpus=2))
    signed_in(client, alice)
    with django_assert_max_num_queries(6):
        response = client.get("/nodes/")
    assert response.content.count(b"<tr data-node=") == 20


def test_a_large_fleet_is_listed_a_page_at_a_time_and_a_name_finds_a_node(
    client: Client, alice, django_assert_num_queries
) -> None:
    from apps.cluster.selectors import NODES_PER_PAGE

    now = timezone.now()
    total = 2 * NODES_PER_PAGE + 5
    Node.objects.bulk_create(
        Node(name=f"n{i:04d}", status=NodeStatus.READY, last_seen_at=now, sampled_at=now, sample=make_sample())
        for i in range(total)
    )
    signed_in(client, alice)
    client.get("/nodes/")  # the session and the user are read once, as on any first page
    with django_assert_num_queries(_nodes_page_queries(client, "/nodes/")):
        first = client.get("/nodes/").content.decode()
    assert first.count("<tr data-node=") == NODES_PER_PAGE
    assert 'data-node="n0000"' in first and f'data-node="n{NODES_PER_PAGE:04d}"' not in first
    assert f"Page 1 of 3 ({total} nodes)" in first and 'rel="next" href="?page=2"' in first
    last = client.get("/nodes/?page=3").content.decode()
    assert last.count("<tr data-node=") == 5 and 'rel="prev" href="?page=2"' in last
    # htmx refreshes the page being looked at, not the first one.
    fragment = client.get("/nodes/?page=3", headers={"HX-Request": "true"}).content.decode()
    assert 'hx-get="/nodes/?page=3"' in fragment and f'data-node="n{total - 1:04d}"' in fragment
    # A page past the end shows the last; junk shows the first.
    assert client.get("/nodes/?page=99").content.decode().count("<tr data-node=") == 5
    assert 'data-node="n0000"' in client.get("/nodes/?page=x").content.decode()

    found = client.get("/nodes/?find=n012").content.decode()
    assert found.count("<tr data-node=") == 10 and "Page 1 of" not in found
    assert 'value="n012"' in found and 'hx-get="/nodes/?find=n012&amp;page=1"' in found
    missing = client.get("/nodes/?find=zz%3Cb%3E").content.decode()
    assert "No node's name contains “zz&lt;b&gt;”." in missing


def _nodes_page_queries(client: Client, path: str) -> int:
    """The queries one more page costs: the same for a fleet of 205 as for one of 3."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        client.get(path)
    return len(captured)


def test_the_nodes_page_queries_do_not_grow_with_the_fleet(client: Client, alice) -> None:
    now = timezone.now()

    def fleet(size: int) -> None:
        Node.objects.bulk_create(
            Node(name=f"f{i:04d}", status=NodeStatus.READY, last_seen_at=now, sampled_at=now, sample=make_sample())
            for i in range(Node.objects.count(), size)
        )

    signed_in(client, alice)
    fleet(3)
    client.get("/nodes/")
    small = _nodes_page_queries(client, "/nodes/")
    fleet(250)
    assert _nodes_page_queries(client, "/nodes/") == small
    assert _nodes_page_queries(client, "/nodes/?page=2") == small


# One node --------------------------------------------------------------------------------------


def test_the_node_page_shows_eight_gpus_with_temperatures_and_power(client: Client, viola) -> None:
    node = make_node(gpus=8, sample=make_sample(gpus=8), hardware=hardware(gpus=8))
    Gpu.objects.filter(node=node, index=5).update(ecc_fault=True)
    content = signed_in(client, viola).get("/nodes/gpu1/").content.decode()
    assert content.count("data-gpu=") == 8
    for index in range(8):
        assert f"{61 + index} °C" in content and f"{70 + index} °C" in content
        assert f"{300 + index} / 700 W" in content
    assert "79×2" in content
    assert "not usable" in content and "healthy" in content
    assert re.search(r'data-figure="cpu">.*?38%', content, re.S)
    assert "3.10 / 2.90 / 2.50" in content
    assert "Intel Xeon Platinum 8480+" in content and "535.161.08" in content
    assert "qwen3-32b" in content and "/mnt/filer" in content
    assert "inlet sensor missing" in content
    assert "55 °C" in content and "22 °C" in content and "210 W" in content


def test_the_node_page_without_a_sample_shows_dashes(client: Client, alice) -> None:
    make_node("quiet", gpus=2, sample=False)
    content = signed_in(client, alice).get("/nodes/quiet/").content.decode()
    assert "0%" not in content
    assert re.search(r'data-field="temperature">-<', content)
    assert "no data" in content


def test_the_node_page_draws_the_last_hour(client: Client, alice) -> None:
    node = make_node(gpus=1, sample=make_sample(gpus=1))
    start = timezone.now().timestamp() - 300
    for step in range(5):
        sample = make_sample(gpus=1)
        sample["taken_at"] = start + step * 10
        sample["cpu_utilization_pct"] = None if step == 2 else 10.0 * step
        history.append_histories({node.pk: sample})
    content = signed_in(client, alice).get("/nodes/gpu1/").content.decode()
    assert content.count("<svg") == 5  # CPU, memory, load, GPU 0 utilisation and temperature
    cpu_chart = content[content.index("<svg") : content.index("</svg>")]
    assert re.search(r' d="M[^"]*M', cpu_chart), "the unknown CPU figure should break the line"


def test_an_htmx_refresh_of_the_node_page_gets_only_the_live_part(client: Client, viola) -> None:
    make_node(gpus=1, sample=make_sample(gpus=1))
    body = signed_in(client, viola).get("/nodes/gpu1/", headers={"HX-Request": "true"}).content.decode().strip()
    assert body.startswith('<div id="node-live"')
    assert "<html" not in body and 'data-section="charts"' not in body


# Cordons ---------------------------------------------------------------------------------------


def test_an_admin_cordons_with_a_reason_and_uncordons(client: Client, alice) -> None:
    node = make_node()
    signed_in(client, alice)
    assert b'data-action="cordon"' in client.get("/nodes/gpu1/").content
    response = client.post("/nodes/gpu1/cordon", {"reason": "replacing a fan"})
    assert response.status_code == 302 and response["Location"] == "/nodes/gpu1/"
    node.refresh_from_db()
    assert node.cordoned and node.cordon_reason == "replacing a fan"
    event = AuditEvent.objects.get(action="node.cordon")
    assert event.actor == alice and event.target_id == str(node.pk)
    assert b'data-action="uncordon"' in client.get("/nodes/gpu1/").content
    client.post("/nodes/gpu1/uncordon")
    node.refresh_from_db()
    assert not node.cordoned and node.cordon_reason == ""
    assert AuditEvent.objects.filter(action="node.uncordon", actor=alice).exists()


def test_a_cordon_needs_a_reason(client: Client, alice) -> None:
    make_node()
    response = signed_in(client, alice).post("/nodes/gpu1/cordon", {"reason": "  "}, follow=True)
    assert "Say why the node is cordoned" in response.content.decode()
    assert not Node.objects.get().cordoned
    assert not AuditEvent.objects.filter(action="node.cordon").exists()


def test_an_htmx_cordon_answers_with_the_cordon_fragment(client: Client, alice) -> None:
    make_node()
    response = signed_in(client, alice).post("/nodes/gpu1/cordon", {"reason": "fan"}, headers={"HX-Request": "true"})
    assert response.status_code == 200
    body = response.content.decode().strip()
    assert body.startswith('<div id="node-cordon"')
    assert 'data-action="uncordon"' in body and "cordoned" in body
    assert Node.objects.get().cordoned


def test_cordoning_a_missing_node_is_not_found(client: Client, alice) -> None:
    assert signed_in(client, alice).post("/nodes/nope/cordon", {"reason": "x"}).status_code == 404


# Adding a node -----------------------------------------------------------------------------------


def test_an_operator_adds_a_node_and_sees_its_token_once(client: Client, alice, settings) -> None:
    settings.PUBLIC_URL = "https://llm.example.com/"
    signed_in(client, alice)
    form = client.get("/nodes/add/")
    assert form.status_code == 200 and b'value="1"' in form.content
    response = client.post(
        "/nodes/add/", {"name": "gpu-r12-03", "labels": "rack=r12\n\nzone = a\n", "expires_hours": "2"}
    )
    assert response.status_code == 200
    content = response.content.decode()
    secret = re.search(r"token: (llmgwe_\S+)", content).group(1)
    token = EnrollmentToken.objects.get()
    assert token.token_hash == _hash(secret) and secret not in token.token_hash
    assert token.node_name == "gpu-r12-03" and token.labels == {"rack": "r12", "zone": "a"}
    assert timedelta(minutes=119) < token.expires_at - timezone.now() <= timedelta(hours=2)
    assert "server: https://llm.example.com\n" in content
    assert "state_dir: /var/lib/llmgw-agent" in content and "model_dirs: []" in content
    assert "llmgw agent --config /etc/llmgw/agent.yaml" in content
    assert response["Cache-Control"].startswith("max-age=0") or "no-store" in response["Cache-Control"]
    assert secret not in client.get("/nodes/add/").content.decode()
    assert secret not in client.get("/nodes/").content.decode()


def test_without_a_public_url_the_agent_is_pointed_at_this_host(client: Client, alice, settings) -> None:
    settings.PUBLIC_URL = ""
    content = signed_in(client, alice).post("/nodes/add/", {"name": "gpu1", "expires_hours": "1"}).content.decode()
    assert "server: http://testserver\n" in content


def test_a_bad_node_name_is_shown_and_nothing_is_made(client: Client, alice) -> None:
    response = signed_in(client, alice).post("/nodes/add/", {"name": "GPU 1!", "expires_hours": "1"})
    assert response.status_code == 200
    error = re.search(r'data-error="name">(.*?)<', response.content.decode()).group(1)
    assert "node name" in error
    assert "token:" not in response.content.decode()
    assert not EnrollmentToken.objects.exists()
    assert not AuditEvent.objects.filter(action="node.enrollment_create").exists()


def test_a_malformed_label_is_shown_and_nothing_is_made(client: Client, alice) -> None:
    response = signed_in(client, alice).post(
        "/nodes/add/", {"name": "gpu1", "labels": "rack r12", "expires_hours": "1"}
    )
    assert "Line 1" in response.content.decode()
    assert not EnrollmentToken.objects.exists()


def test_a_ready_node_whose_heartbeats_stopped_reads_unreachable_though_nothing_marked_it(
    client: Client, viola
) -> None:
    """The scheduler that marks nodes unreachable may be down (a worker lost with Redis): the pages,
    the metrics and placement still see that its heartbeats are stale."""
    from apps.cluster.inventory import build_inventory

    stale = make_node("stale", last_seen_at=timezone.now() - timedelta(minutes=5))
    make_node("live", last_seen_at=timezone.now())
    assert Node.objects.get(name="stale").status == NodeStatus.READY  # nothing marked it
    page = signed_in(client, viola).get("/nodes/").content
    assert cell(page, "stale", "status").lower().startswith("unreachable")
    assert cell(page, "live", "status").lower().startswith("ready")
    text = client.get("/metrics").content.decode().splitlines()
    assert 'llmgw_node_up{node="stale"} 0.0' in text
    assert 'llmgw_node_up{node="live"} 1.0' in text
    inventory = build_inventory()
    assert not inventory.nodes[stale.pk].ready


def test_an_operator_drains_a_node_from_its_page_and_sees_what_is_left(client: Client) -> None:
    from apps.accounts.choices import StaffRole
    from apps.cluster.reconciler import reconcile
    from tests.conftest import make_user

    operator = make_user("olga@example.com", role=StaffRole.OPERATOR)
    make_node("gpu1", gpus=1)
    make_model("m", gpus=1)
    reconcile()
    page = signed_in(client, operator).post("/nodes/gpu1/drain", {"grace": "20"}, HTTP_HX_REQUEST="true")
    assert page.status_code == 200
    text = page.content.decode()
    assert "Draining: 1 replica left on this node." in text and "m#" in text
    node = Node.objects.get(name="gpu1")
    assert node.cordoned and node.drain_grace == 20
    assert AuditEvent.objects.filter(action="node.drain").exists()
    refused = signed_in(client, operator).post("/nodes/gpu1/drain", {"grace": "lots"}, HTTP_HX_REQUEST="true")
    assert "whole number of seconds" in refused.content.decode()
