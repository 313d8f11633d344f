"""The fabric page in Debian's Chromium: the 206-switch SuperPOD capture drawn, live, findable.

Two agents stand for two of the capture's hosts (their ports carry those hosts' port GUIDs),
and their ibnetdiscover prints the capture: the control plane maps the fabric through one of
them, and the page draws every switch and adapter, marks the two nodes' ports live, opens a
switch's detail on a click, finds a node by name, and runs under the Content Security Policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from apps.fabrics import topology
from tests.browser import test_console as console
from tests.browser.test_console import DESKTOP, sync_api
from tests.e2e.test_fabrics import FAST, MASTER, agent_settings
from tests.fleet import FIXTURES, HOSTS, ControlPlane, fixtures_available

pytestmark = pytest.mark.e2e

chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

CAPTURE = FIXTURES / "ibnetdiscover" / "hdr-qm8790-3tier-fattree-206sw-1336ca-superpod-crlf-bom-prompt.txt"
UP = ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_7", "mlx5_9")
FABRIC = f"ib:{MASTER}"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not fixtures_available() or not CAPTURE.is_file():
        pytest.skip("the shared fixtures are not here")
    if not console.CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {console.CHROMIUM} (apt-get install chromium)")
    text = CAPTURE.read_text(encoding="utf-8", errors="replace")
    parsed = topology.parse(text)
    tmp = tmp_path_factory.mktemp("fabric-drawing")
    with ControlPlane(tmp, extra_env={**FAST, "LLMGW_FABRIC_MAP_INTERVAL": "5"}, local_agent=False) as running:
        for name, host in (("spd001", "pg-spd001"), ("spd002", "pg-spd002")):
            agent = running.add_agent(name, HOSTS["h100-ib"], settings=agent_settings(tmp), start=False)
            for device, port in zip(UP, parsed.host_ports(host), strict=False):
                agent.set_port_guid(device, port.port_guid)
            agent.set_topology(text)
            agent.start()
        running.wait_for(
            lambda: running.api("GET", f"fabrics/{FABRIC}/topology").get("map"), timeout=120, what="the map"
        )
        yield running


def test_the_superpod_capture_is_drawn_with_the_cluster_live_on_it(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/fabrics/{FABRIC}/")
    canvas = page.locator("#fabric-canvas")
    # 206 switches and the 1,130 compute adapters' ports (aggregation nodes are not drawn).
    sync_api.expect(canvas).to_have_attribute("data-drawn", str(206 + 1130), timeout=30_000)
    summary = page.locator("[data-section=fabric-map]").inner_text()
    assert "206 switches (56 leaves, 80 spines, 70 core)" in summary
    assert "2 adapters break their rails." in summary  # pg-spd071's crossed cables
    assert page.locator("[data-table=subnet-managers]").inner_text().count("0x") == 2

    # A click on a leaf opens its detail; the panel says what it is, in the page's words.
    box = canvas.bounding_box()
    assert box is not None
    found = None
    for dx in range(5, int(box["width"]), 7):
        page.mouse.click(box["x"] + dx, box["y"] + 340)
        text = page.locator("#fabric-panel").inner_text()
        if text.startswith("leaf:"):
            found = text
            break
    assert found is not None and "GUID" in found

    # Find a node: the two agents' adapters are found by the node's name and zoomed to.
    page.fill("#fabric-find", "spd002")
    page.press("#fabric-find", "Enter")
    sync_api.expect(canvas).to_have_attribute("data-found", "8")
    assert "pg-spd002" in page.locator("#fabric-panel").inner_text()
    page.fill("#fabric-find", "no-such-host")
    page.press("#fabric-find", "Enter")
    sync_api.expect(canvas).to_have_attribute("data-found", "0")
    page.check("#fabric-by-rail")
    assert canvas.get_attribute("data-error") is None
    assert csp_violations == []


def test_the_fabrics_page_lists_the_fabric_with_its_managers(page: Any, plane: ControlPlane) -> None:
    page.goto(f"{plane.url}/fabrics/")
    section = page.locator(f"[data-fabric='{FABRIC}']")
    sync_api.expect(section).to_contain_text("Declared as ib-a; 2 nodes, 12 ports up.")
    sync_api.expect(section.locator("[data-table=subnet-managers]")).to_contain_text("standby")
    assert Path(page.url).name == "" or page.url.endswith("/fabrics/")
