"""The GPU map's tooltip: each card's XIDs, uncorrected ECC errors and remapped rows, as its agent
sent them; "-" where the sample does not say, never 0."""

from __future__ import annotations

import html
import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client

from apps.accounts.models import User
from tests.builders import H100, make_node

pytestmark = pytest.mark.django_db


def card(index: int, **wear: Any) -> dict[str, Any]:
    return {
        "index": index,
        "gpu_class": H100,
        "utilization_gpu_pct": 10.0,
        "memory_used_mib": 8000,
        "memory_total_mib": 80000,
        "temperature_gpu_c": 50,
        **wear,
    }


def tooltips(user: User) -> dict[tuple[str, int], list[str]]:
    """{(node, index): the lines of the card's tooltip} from the cluster page."""
    client = Client()
    client.force_login(user)
    response = client.get("/cluster/")
    assert response.status_code == 200
    page = response.content.decode()
    found = {}
    for node, body in re.findall(r'data-map-node="([^"]+)">(.*?)</div>\s*</div>', page, re.DOTALL):
        for title, index in re.findall(r'<span class="gpu-cell [^"]+" title="([^"]*)" data-gpu="(\d+)"', body):
            found[(node, int(index))] = html.unescape(title).split("\n")
    return found


def test_a_card_shows_the_xids_ecc_errors_and_remapped_rows_its_agent_reports(alice: User) -> None:
    make_node(
        "worn",
        cards=[
            card(
                0,
                xids={"79": 2, "13": 1, "8": 4},
                ecc_uncorrected_volatile=0,
                ecc_uncorrected_aggregate=3,
                remapped_rows_uncorrectable=2,
                remapped_rows_pending=True,
                remapped_rows_failure=False,
            ),
            card(
                1,
                xids={},
                ecc_uncorrected_volatile=12,
                ecc_uncorrected_aggregate=40,
                remapped_rows_uncorrectable=0,
                remapped_rows_pending=False,
                remapped_rows_failure=True,
            ),
        ],
    )
    shown = tooltips(alice)
    first, *wear = shown[("worn", 0)]
    assert first.startswith("worn GPU 0, H100-80GB (NVIDIA) · 10% busy")  # the line it had, its vendor named
    assert wear == [
        "XIDs: 8×4, 13×1, 79×2",
        "uncorrected ECC errors: volatile 0, aggregate 3",
        "remapped rows: uncorrectable 2, pending yes, failed no",
    ]
    assert shown[("worn", 1)][1:] == [
        "XIDs: none",  # the agent read the kernel log and found none for this card
        "uncorrected ECC errors: volatile 12, aggregate 40",
        "remapped rows: uncorrectable 0, pending no, failed yes",
    ]


def test_figures_the_sample_lacks_are_dashes_never_zeros(alice: User) -> None:
    # A card whose agent sent none of them (no ECC on this card, no readable kernel log), figures
    # of the wrong kind, and a node whose last sample is too old to stand for now.
    make_node(
        "plain",
        cards=[
            card(0),
            card(
                1,
                xids="79",
                ecc_uncorrected_volatile="N/A",
                ecc_uncorrected_aggregate=True,
                remapped_rows_uncorrectable=None,
                remapped_rows_pending="No",
                remapped_rows_failure=0,
            ),
        ],
    )
    make_node(
        "stale",
        cards=[card(0, xids={"79": 1}, ecc_uncorrected_volatile=5, remapped_rows_pending=True)],
        sample_age=timedelta(minutes=10),
    )
    shown = tooltips(alice)
    unknown = [
        "XIDs: -",
        "uncorrected ECC errors: volatile -, aggregate -",
        "remapped rows: uncorrectable -, pending -, failed -",
    ]
    assert shown[("plain", 0)][1:] == unknown
    assert shown[("plain", 1)][1:] == unknown
    assert shown[("stale", 0)][1:] == unknown
    assert not any(" 0" in line or "0," in line for lines in shown.values() for line in lines[1:])
