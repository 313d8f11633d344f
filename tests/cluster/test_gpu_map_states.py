"""The GPU map's slices, split cards and devices that cannot be trusted are drawn apart (the
stylesheet's .gpu-slice, .gpu-split and .gpu-untrusted, checked in a browser by
tests/browser/test_console.py) and say so in words too: each such square's label names its state,
and the legend names the three, in English and in Turkish."""

from __future__ import annotations

import html
import re

import pytest
from django.test import Client

from apps.accounts.models import User
from tests.cluster.test_slices import mig_devices, register

pytestmark = pytest.mark.django_db


def labels(content: str) -> dict[str, tuple[str, str]]:
    """data-gpu -> (classes, aria-label) of each square of the map that has a label."""
    return {
        index: (classes, html.unescape(label))
        for classes, index, label in re.findall(
            r'<span class="gpu-cell ([^"]*)" title="[^"]*" data-gpu="(\d+)"[^>]* role="img" aria-label="([^"]*)">',
            content,
        )
    }


def cluster_page(client: Client, user: User, language: str = "en") -> str:
    client.force_login(user)
    response = client.get("/cluster/", headers={"accept-language": language})
    assert response.status_code == 200
    return response.content.decode()


def test_split_cards_and_slices_say_what_they_are_not_by_colour_alone(client: Client, alice: User) -> None:
    register("h100-mig", mig_devices())
    content = cluster_page(client, alice)
    found = labels(content)
    assert found["0"] == ("gpu-none gpu-split", "0: split into slices: they are given out, not the whole card")
    assert found["1002"] == ("gpu-none gpu-slice", "0.2: GPU 0 MIG 2 (1g.10gb)")
    # The colour classes stay the only colour: no border utility rides along any more.
    assert not re.search(r'class="gpu-cell [^"]*border-', content)
    legend = re.search(r'aria-label="Legend">(.*?)</div>', content, re.S)
    assert legend is not None
    entries = legend.group(1).split('data-legend="')[1:]
    words = {
        entry.split('"', 1)[0]: " ".join(re.sub(r"<[^>]*(?:>|$)", " ", entry.split(">", 1)[1]).split())
        for entry in entries
    }
    assert words == {
        "split": "split into slices",
        "slice": "slices of the card before them",
        "untrusted": "cannot be trusted",
    }


def test_a_device_that_cannot_be_trusted_says_why_in_its_label(client: Client, alice: User) -> None:
    why = "nvidia-smi -L lists 3 MIG device(s) on GPU 0, -q describes 4"
    devices = mig_devices()
    for device in devices:
        device["fault"] = why
    register("h100-mig", devices)
    found = labels(cluster_page(client, alice))
    classes, label = found["0"]
    assert "gpu-untrusted" in classes and label == f"0: cannot be trusted now: {why}"
    assert found["1002"][1] == f"0.2: cannot be trusted now: {why}"


def test_the_labels_and_the_legend_are_turkish_in_turkish(client: Client, alice: User) -> None:
    register("h100-mig", mig_devices())
    content = cluster_page(client, alice, "tr")
    assert labels(content)["0"][1] == "0: dilimlere bölünmüş: kartın tamamı değil, dilimleri verilir"
    legend = re.search(r'aria-label="Açıklama">(.*?)</div>', content, re.S)
    assert legend is not None and "dilimlere bölünmüş" in legend.group(1) and "güvenilemez" in legend.group(1)
