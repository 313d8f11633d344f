"""MIG slices and AMD cards on the cluster page and the node page, from nodes registered with the
devices their agents make of real captures (tests.cluster.test_slices): a slice is a square of its
own after its card, named by its card and number; a split card says it is given out in slices; a
device that cannot be trusted says why; the vendor is named; the fleet's card count leaves slices out."""

from __future__ import annotations

import html
import re
from typing import Any

import pytest
from django.test import Client

from apps.accounts.models import User
from apps.cluster.models import Node, Replica
from apps.cluster.reconciler import reconcile
from tests.builders import make_model
from tests.cluster.test_slices import UUID_2, mi300x_devices, mig_devices, register

pytestmark = pytest.mark.django_db


def page(client: Client, user: User, path: str) -> str:
    client.force_login(user)
    response = client.get(path)
    assert response.status_code == 200
    return response.content.decode()


def squares(content: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(node, data-gpu) -> (classes, title, text) of each square of the GPU map."""
    found = {}
    for node, body in re.findall(r'data-map-node="([^"]+)">(.*?)</div>\s*</div>', content, re.S):
        for classes, title, index, text in re.findall(
            r'<span class="gpu-cell ([^"]*)" title="([^"]*)" data-gpu="(\d+)"[^>]*>([^<]*)</span>', body
        ):
            found[(node, index)] = (classes, html.unescape(title), text)
    return found


def test_the_map_shows_each_slice_after_its_card_and_counts_cards_not_slices(client: Client, alice: User) -> None:
    register("h100-mig", mig_devices())
    register("mi300x", mi300x_devices(), engine_builds={"vllm": "rocm700"})
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1)
    reconcile()
    replica = Replica.objects.get(model__name="small")
    content = page(client, alice, "/cluster/")
    shown = squares(content)
    mig = [index for node, index in shown if node == "h100-mig"]
    assert mig == ["0", "1000", "1001", "1002", "1003"]  # the card, then its slices
    classes, title, text = shown[("h100-mig", "0")]
    assert "gpu-split" in classes and text == "0"
    assert title.startswith("h100-mig GPU 0, H100-80GB (NVIDIA)")
    assert "split into slices: they are given out, not the whole card" in title
    classes, title, text = shown[("h100-mig", "1002")]
    assert "gpu-slice" in classes and "gpu-held" in classes and text == "0.2"
    assert title.startswith("h100-mig GPU 0 MIG 2 (1g.10gb), H100-80GB-1g.10gb (NVIDIA)")
    assert f"held by small #{replica.pk}" in title
    classes, title, text = shown[("mi300x", "3")]
    assert title.startswith("mi300x GPU 3, MI300X-192GB (AMD)") and text == "3"
    assert 'data-gpu="3" data-vendor="amd"' in content
    # One H100 and eight MI300X: nine cards, the H100's four slices not counted again.
    assert re.search(r'id="cluster-gpus"[^>]*>\s*9 GPUs\s*<', content)


def test_a_device_its_agent_cannot_trust_says_why_on_the_map(client: Client, alice: User) -> None:
    why = "nvidia-smi -L lists 3 MIG device(s) on GPU 0, -q describes 4"
    devices = mig_devices()
    for device in devices:
        device["fault"] = why
    register("h100-mig", devices)
    shown = squares(page(client, alice, "/cluster/"))
    for index in ("0", "1002"):
        classes, title, _ = shown[("h100-mig", index)]
        assert "gpu-untrusted" in classes and f"cannot be trusted now: {why}" in title


def fields(content: str, index: str) -> dict[str, str]:
    """A device's card on the node page: its data-field values as text."""
    found = re.search(rf'<div class="card[^"]*" data-gpu="{index}"[^>]*>(.*?)</dl>', content, re.S)
    assert found is not None, f"no device {index} on the page"
    return {
        name: " ".join(re.sub(r"<[^>]+>", " ", html.unescape(value)).split())
        for name, value in re.findall(r'data-field="([^"]+)"[^>]*>(.*?)</(?:span|dd|p)>', found.group(1), re.S)
    }


def test_the_node_page_names_each_slice_its_share_and_the_engine_on_it(client: Client, viola: User) -> None:
    register("h100-mig", mig_devices())
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1)
    reconcile()
    replica = Replica.objects.get(model__name="small")
    content = page(client, viola, "/nodes/h100-mig/")
    card = fields(content, "0")
    assert (card["device"], card["vendor"], card["split"]) == ("GPU 0", "NVIDIA", "split into slices")
    assert card["mig"] == "Enabled"
    one = fields(content, "1002")
    assert (one["device"], one["share"], one["device-id"]) == ("GPU 0 MIG 2 (1g.10gb)", "1/7", UUID_2)
    assert 'data-gpu="1002" data-vendor="nvidia" data-kind="mig" data-card="0"' in content
    shard = re.search(rf'<tr data-shard="r{replica.pk}s0">.*?<td data-col="gpus">([^<]*)</td>', content, re.S)
    assert shard is not None and shard.group(1) == "GPU 0 MIG 2 (1g.10gb)"


def test_the_node_page_shows_an_amd_cards_readings_with_its_vendor(client: Client, viola: User) -> None:
    devices = mi300x_devices()
    register("mi300x", devices)
    card = fields(page(client, viola, "/nodes/mi300x/"), "0")
    assert card["vendor"] == "AMD" and card["device"] == "GPU 0"
    assert card["temperature"] == "32 °C" and card["temperature-memory"] == "33 °C"
    assert card["power"].startswith("171 /")
    assert card["ecc-corrected"] == "-"  # not read: unknown, not zero


def test_the_nodes_list_and_api_count_cards_and_name_the_slice_classes(client: Client, api: Any, viola: User) -> None:
    register("h100-mig", mig_devices())
    register("mi300x", mi300x_devices())
    assert Node.objects.get(name="h100-mig").hardware["gpu_count"] == 1
    content = page(client, viola, "/nodes/")
    shown = re.search(r'<tr[^>]*data-node="h100-mig".*?<td data-col="gpus">(.*?)</td>', content, re.S)
    assert shown is not None
    assert " ".join(shown.group(1).split()) == (
        "2× H100-80GB-1g.10gb, 1× H100-80GB, 1× H100-80GB-2g.20gb, 1× H100-80GB-3g.40gb"
    )
    api.force_authenticate(viola)
    nodes = {n["name"]: n["summary"] for n in api.get("/api/v1/nodes").json()["results"]}
    assert (nodes["h100-mig"]["gpu_count"], nodes["h100-mig"]["gpus_healthy"]) == (1, 1)
    assert nodes["h100-mig"]["gpu_classes"] == [
        "H100-80GB",
        "H100-80GB-1g.10gb",
        "H100-80GB-2g.20gb",
        "H100-80GB-3g.40gb",
    ]
    assert (nodes["mi300x"]["gpu_count"], nodes["mi300x"]["gpu_classes"]) == (8, ["MI300X-192GB"])
