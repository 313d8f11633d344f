"""The facility page in Debian's Chromium, against `llmgw up` with five real agents on CPU hosts.

Two sites: in dc1 row1 rack r1 (two nodes, one cordoned) and rack r2 (held for a PDU swap), in dc2
rack r9 with no row; and a node naming nothing. Each rack is drawn as an elevation with a slot per
node coloured by what it is, the held rack striped with its banner; the page fits a phone, runs
under the Content Security Policy, holds and releases through its forms, and refreshes itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import test_console as console
from tests.browser.test_console import DESKTOP, PHONE, sync_api
from tests.e2e.test_fabrics import FAST
from tests.fleet import HOSTS, ControlPlane, fixtures_available

pytestmark = pytest.mark.e2e

chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

PLACES = {
    "a1": {"site": "dc1", "room": "hall1", "row": "row1", "rack": "r1", "pdu": "p1"},
    "a2": {"site": "dc1", "room": "hall1", "row": "row1", "rack": "r1", "pdu": "p1"},
    "b1": {"site": "dc1", "room": "hall1", "row": "row1", "rack": "r2", "pdu": "p2"},
    "c1": {"site": "dc2", "room": "hall9", "rack": "r9"},
    "loose": {},
}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not fixtures_available():
        pytest.skip("the shared fixtures are not here")
    if not console.CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {console.CHROMIUM} (apt-get install chromium)")
    tmp: Path = tmp_path_factory.mktemp("facility-page")
    with ControlPlane(tmp, extra_env=FAST, local_agent=False) as running:
        for name, place in PLACES.items():
            labels = {f"llmgw.io/{level}": value for level, value in place.items()}
            running.add_agent(name, HOSTS["cpu"], labels=labels)

        def all_ready() -> bool:
            nodes = running.api("GET", "nodes")["results"]
            return sorted(n["name"] for n in nodes if n["status"] == "ready") == sorted(PLACES)

        running.wait_for(all_ready, timeout=90, what="five ready nodes")
        running.api("POST", "nodes/a2/cordon", {"reason": "fan"})
        running.api("POST", "facility/holds", {"domain": "rack=r2", "reason": "PDU swap"})
        yield running


def rack(page: Any, name: str) -> Any:
    return page.locator(f'article[data-rack="{name}"]')


def slots(page: Any, name: str) -> list[tuple[str, str]]:
    """(node, class) of each slot of the rack's elevation, top down."""
    items = rack(page, name).locator(".rack-elevation .rack-slot")
    return [
        (str(items.nth(i).get_attribute("data-node")), str(items.nth(i).get_attribute("class")))
        for i in range(items.count())
    ]


def test_each_rack_is_drawn_with_a_slot_per_node(page: Any, plane: ControlPlane, csp_violations: list[str]) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/facility/")
    sync_api.expect(page.locator("article[data-rack]")).to_have_count(3)
    assert [page.locator("[data-site]").nth(i).get_attribute("data-site") for i in range(2)] == ["dc1", "dc2"]
    assert rack(page, "r9").get_attribute("data-path") == "dc2/hall9/-/r9"
    assert slots(page, "r1") == [("a1", "rack-slot rack-slot-ready"), ("a2", "rack-slot rack-slot-cordoned")]
    assert slots(page, "r2") == [("b1", "rack-slot rack-slot-held")]
    assert slots(page, "r9") == [("c1", "rack-slot rack-slot-ready")]
    # Each state its own colour; the held rack's box striped, with its banner.
    colours = {
        cls: rack(page, name).locator(f".{cls}").first.evaluate("e => getComputedStyle(e).borderInlineStartColor")
        for name, cls in (("r1", "rack-slot-ready"), ("r1", "rack-slot-cordoned"), ("r2", "rack-slot-held"))
    }
    assert len(set(colours.values())) == 3, colours
    held = rack(page, "r2")
    assert held.get_attribute("data-held") == "1" and rack(page, "r1").get_attribute("data-held") == "0"
    sync_api.expect(held.locator(".rack-banner")).to_have_text("held")
    stripes = held.locator(".rack-elevation").evaluate("e => getComputedStyle(e).backgroundImage")
    assert stripes.startswith("repeating-linear-gradient"), stripes
    assert rack(page, "r1").locator(".rack-elevation").evaluate("e => getComputedStyle(e).backgroundImage") == "none"
    # The elevation is a tall box: taller than its two slots.
    box = rack(page, "r1").locator(".rack-elevation").bounding_box()
    assert box is not None and box["height"] >= 200, box
    sync_api.expect(held.locator("[data-hold='rack=r2']")).to_contain_text("PDU swap")
    sync_api.expect(page.locator("tr[data-hold='rack=r2'] [data-col=reason]")).to_have_text("PDU swap")
    sync_api.expect(page.locator("[data-section=without-rack] [data-node]")).to_have_count(1)
    sync_api.expect(page.locator("[data-section=pdus] tr[data-pdu]")).to_have_count(2)
    page.screenshot(path=str(Path(plane.tmp) / "facility.png"), full_page=True)
    # A slot's name opens its node.
    rack(page, "r1").locator(".rack-slot[data-node=a1] a").click()
    page.wait_for_url(f"{plane.url}/nodes/a1/")
    assert csp_violations == []


def test_the_page_fits_a_phone(page: Any, plane: ControlPlane, csp_violations: list[str]) -> None:
    page.set_viewport_size({"width": PHONE, "height": console.HEIGHT})
    page.goto(f"{plane.url}/facility/")
    sync_api.expect(page.locator("article[data-rack]")).to_have_count(3)
    found = console.measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    for name in ("r1", "r2", "r9"):
        box = rack(page, name).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE, (name, box)
    console.screenshot(page, "facility-racks", PHONE)
    assert csp_violations == []


def test_hold_and_release_through_the_page_and_it_refreshes_itself(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/facility/")
    form = page.locator("[data-section=hold-form] form")
    form.locator("select[name=level]").select_option("row")
    form.locator("input[name=name]").fill("row1")
    form.locator("input[name=reason]").fill("cooling work")
    form.locator("[data-action=hold]").click()
    page.wait_for_url(f"{plane.url}/facility/")
    sync_api.expect(page.locator("main")).to_contain_text("row=row1 is held")
    # Both racks of row1 held through their row; r1's slots say so, its cordoned node stays cordoned.
    sync_api.expect(rack(page, "r1")).to_have_attribute("data-held", "1")
    assert slots(page, "r1") == [("a1", "rack-slot rack-slot-held"), ("a2", "rack-slot rack-slot-cordoned")]
    sync_api.expect(rack(page, "r1").locator("[data-held-by='row=row1']")).to_have_text("held with row=row1")
    assert rack(page, "r9").get_attribute("data-held") == "0"
    held = {h["domain"]: h for h in plane.api("GET", "facility/holds")["results"]}
    assert held["row=row1"]["reason"] == "cooling work" and held["row=row1"]["held_by"] == plane.email

    page.locator("tr[data-hold='row=row1'] [data-action=release]").click()
    page.wait_for_url(f"{plane.url}/facility/")
    sync_api.expect(page.locator("main")).to_contain_text("row=row1 is released")
    sync_api.expect(rack(page, "r1")).to_have_attribute("data-held", "0")
    assert "row=row1" not in {h["domain"] for h in plane.api("GET", "facility/holds")["results"]}

    # A hold made elsewhere shows within one refresh, without reloading the page.
    plane.api("POST", "facility/holds", {"domain": "site=dc2", "reason": "power test"})
    sync_api.expect(rack(page, "r9")).to_have_attribute("data-held", "1", timeout=15_000)
    assert slots(page, "r9") == [("c1", "rack-slot rack-slot-held")]
    plane.api("POST", "facility/release", {"domain": "site=dc2"})
    assert csp_violations == []


def test_a_power_cap_set_through_the_page_is_drawn_as_a_bar_on_its_rack(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.goto(f"{plane.url}/facility/")
    form = page.locator("[data-section=budget-form] form")
    form.locator("select[name=level]").select_option("rack")
    form.locator("input[name=name]").fill("r1")
    form.locator("input[name=feed_a]").fill("12000")
    form.locator("input[name=feed_b]").fill("12000")
    form.locator("input[name=redundant]").check()
    form.locator("[data-action=budget]").click()
    page.wait_for_url(f"{plane.url}/facility/")
    sync_api.expect(page.locator("main")).to_contain_text("rack=r1 may draw 12.0 kW.")  # one feed of the two
    row = page.locator("tr[data-budget='rack=r1']")
    sync_api.expect(row.locator("[data-col=draw]")).to_contain_text("of 12.0 kW")
    sync_api.expect(row.locator("[data-col=feeds]")).to_contain_text("A/B fed")
    power = rack(page, "r1").locator("[data-section=rack-power]")
    sync_api.expect(power).to_contain_text("of 12.0 kW")
    [budget] = plane.api("GET", "facility/budgets")["results"]
    assert (budget["domain"], budget["cap_watts"], budget["source"]) == ("rack=r1", 12000, "console")
    # The bar fits a phone with the rest of the page.
    page.set_viewport_size({"width": PHONE, "height": console.HEIGHT})
    page.reload()
    found = console.measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    console.screenshot(page, "facility-power", PHONE)
    page.set_viewport_size({"width": DESKTOP, "height": 900})
    page.locator("tr[data-budget='rack=r1'] [data-action=remove-budget]").click()
    page.wait_for_url(f"{plane.url}/facility/")
    sync_api.expect(page.locator("main")).to_contain_text("rack=r1 has no power cap any more.")
    assert plane.api("GET", "facility/budgets")["results"] == []
    assert csp_violations == []
