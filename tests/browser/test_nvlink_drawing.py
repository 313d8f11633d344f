"""The NVLink page in Debian's Chromium: a domain drawn as a rack from two real agents' reports.

Three GB200 trays: one whole, one with a card whose fabric is In Progress, one on degraded
bandwidth. The page draws the NVLink Switch band, the light running down the backplane, chips
that glow (joined), pulse red (not) or turn amber (degraded), says what keeps the tray out, and
runs under the Content Security Policy; the node page shows the tray's NVLink matrix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import test_console as console
from tests.browser.test_console import DESKTOP, sync_api
from tests.e2e.test_fabrics import FAST
from tests.fleet import GB200_CLUSTER, HOSTS, ControlPlane, fabric_block, fixtures_available

pytestmark = pytest.mark.e2e

chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

DOMAIN = f"{GB200_CLUSTER}.7"
TRAY = (GB200_CLUSTER, 7, 4)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not fixtures_available():
        pytest.skip("the shared fixtures are not here")
    if not console.CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {console.CHROMIUM} (apt-get install chromium)")
    tmp: Path = tmp_path_factory.mktemp("nvlink-drawing")
    with ControlPlane(tmp, extra_env=FAST, local_agent=False) as running:
        settings = {"gpu_check_interval": 1}
        for name in ("tray1", "tray2", "tray3"):
            agent = running.add_agent(name, HOSTS["gb200"], settings=settings, start=False)
            if name == "tray2":
                agent.set_fabrics(TRAY, {1: fabric_block(None, None, state="In Progress")})
            if name == "tray3":
                agent.set_fabrics(TRAY, {3: fabric_block(GB200_CLUSTER, 7, bandwidth="Degraded")})
            agent.start()

        def drawn() -> Any:
            domains = running.api("GET", "nvlink")["domains"]
            return domains and len(domains[0]["nodes"]) == 3 and domains[0]["imex_up"] == 3

        running.wait_for(drawn, timeout=90, what="three trays with IMEX")
        yield running


def animation(page: Any, selector: str) -> str:
    return str(page.locator(selector).first.evaluate("e => getComputedStyle(e).animationName"))


def test_the_domain_is_drawn_as_a_rack_of_trays(page: Any, plane: ControlPlane, csp_violations: list[str]) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/fabrics/nvlink/")
    rack = page.locator(f'[data-domain="{DOMAIN}"]')
    sync_api.expect(rack.locator(".nvl-tray")).to_have_count(3)
    assert rack.locator(".nvl-switch").inner_text().strip() == "NVLink Switch"
    assert animation(page, ".nvl-light") == "nvl-flow"
    # tray1 whole, tray2 out with card 1 pulsing red, tray3 in with card 3 amber.
    assert rack.locator('[data-node="tray1"]').get_attribute("data-ready") == "1"
    assert rack.locator('.nvl-tray[data-node="tray2"]').get_attribute("data-ready") == "0"
    assert animation(page, '[data-node="tray1"] .gpu-chip[data-gpu="0"]') == "nvl-glow"
    assert animation(page, '[data-node="tray2"] .gpu-chip[data-gpu="1"]') == "nvl-pulse"
    degraded = page.locator('[data-node="tray3"] .gpu-chip[data-gpu="3"]')
    assert "nvl-degraded" in (degraded.get_attribute("class") or "")
    assert degraded.evaluate("e => getComputedStyle(e).backgroundColor") == "oklch(0.828 0.189 84.429)"  # amber-400
    assert "bandwidth Degraded" in (degraded.get_attribute("title") or "")
    problems = rack.locator("[data-section=tray-problems]").inner_text()
    assert "tray2: GPU 1: fabric In Progress" in problems and "tray3" not in problems
    assert "3b4f1a2c…/7" in rack.locator("h2").inner_text()
    page.screenshot(path=str(Path(plane.tmp) / "nvlink.png"), full_page=True)
    # Less motion asked for: nothing moves.
    page.emulate_media(reduced_motion="reduce")
    assert animation(page, ".nvl-light") == "none"
    assert animation(page, '[data-node="tray2"] .gpu-chip[data-gpu="1"]') == "none"
    assert csp_violations == []


def test_the_node_page_shows_the_tray_matrix_domain_and_imex(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/nodes/tray2/")
    section = page.locator("[data-section=nvlink]")
    sync_api.expect(section).to_be_visible()
    matrix = section.locator("[data-field=nvlink-matrix]")
    assert matrix.locator("tbody tr").count() == 4
    row = matrix.locator('tr[data-gpu="2"]').inner_text()
    assert row.split()[:5] == ["GPU2", "NV18", "NV18", "X", "NV18"]
    assert "mlx5_2" in row and "PIX" in row
    assert matrix.locator("td.nvl-link").count() == 12
    domain = section.locator("[data-field=nvlink-domain]").inner_text()
    assert "3b4f1a2c…/7" in domain and "GPU 1: fabric In Progress" in domain
    assert "READY" in section.locator("[data-field=imex]").inner_text()
    assert csp_violations == []
