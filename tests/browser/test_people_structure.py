"""The People page's tree in a real browser: a team created, renamed and removed through the page.

As in test_console.py: Debian's Chromium at /usr/bin/chromium, driven by Playwright, against
`llmgw up` (here without a local agent or a model: the tree needs neither). Without Chromium
the module is skipped; no test ever downloads a browser.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet import ControlPlane

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PHONE, DESKTOP, HEIGHT = 390, 1280, 844


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium); these tests never download a browser")
    with ControlPlane(tmp_path_factory.mktemp("people"), local_agent=False) as running:
        running.api("POST", "organizations", {"name": "Acme"})
        yield running


@pytest.fixture(scope="module")
def chromium(plane: ControlPlane) -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(chromium: Any, plane: ControlPlane) -> Iterator[Any]:
    """Signed in through the real form, at a desktop's width."""
    context = chromium.new_context(viewport={"width": DESKTOP, "height": HEIGHT}, locale="en-US")
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto(plane.url + "/login/")
    page.fill("#id_username", plane.email)
    page.fill("#id_password", plane.password)
    page.click("form button[type=submit]")
    page.wait_for_url(plane.url + "/")
    yield page
    context.close()


@pytest.fixture
def csp_refusals(page: Any) -> list[str]:
    """What the browser refused under the Content Security Policy while the test ran: nothing, always."""
    refused: list[str] = []
    page.on(
        "console",
        lambda message: (
            refused.append(message.text)
            if message.type == "error" and "Content Security Policy" in message.text
            else None
        ),
    )
    return refused


def test_a_team_is_created_renamed_and_removed_through_the_page(
    page: Any, plane: ControlPlane, csp_refusals: list[str]
) -> None:
    expect = sync_api.expect
    org = next(o for o in plane.api("GET", "organizations")["results"] if o["name"] == "Acme")
    page.goto(f"{plane.url}/people/members/?branch=org:{org['id']}")
    tree, panel = page.locator("nav[data-tree]"), page.locator("#panel")
    add_team = tree.locator("form[data-form=add-team]")

    # Create: the folded "+ team" box under Acme.
    tree.locator("details:has(form[data-form=add-team]) > summary").click()
    add_team.locator("input[name=name]").fill("Vision")
    add_team.get_by_role("button", name="Add").click()
    page.wait_for_url(re.compile(r"/people/members/\?branch=team%3A\d+$"))
    expect(panel.locator("h2")).to_have_text("Acme / Vision")
    expect(page.locator("main")).to_contain_text("Acme / Vision created.")
    expect(tree.get_by_role("link", name="Vision", exact=True)).to_be_visible()
    team = next(t for t in plane.api("GET", "teams")["results"] if t["name"] == "Vision")

    # The same name again is refused in the box itself, which keeps what was typed.
    tree.locator("details:has(form[data-form=add-team]) > summary").click()
    add_team.locator("input[name=name]").fill("vision")
    add_team.get_by_role("button", name="Add").click()
    expect(add_team.locator("[data-error=name]")).to_have_text("Acme already has a team named vision.")
    expect(add_team.locator("input[name=name]")).to_have_value("vision")

    # Rename, from the menu beside the team's name: the same team, under its old slug.
    menu = panel.locator("details[data-branch-menu]")
    menu.locator("summary").click()
    rename = panel.locator("form[data-form=rename-branch]")
    rename.locator("input[name=name]").fill("Computer Vision")
    rename.get_by_role("button", name="Save name").click()
    expect(panel.locator("h2")).to_have_text("Acme / Computer Vision")
    expect(page.locator("main")).to_contain_text("Acme / Vision renamed to Acme / Computer Vision.")
    assert page.url.endswith(f"?branch=team%3A{team['id']}")
    assert plane.api("GET", f"teams/{team['id']}")["slug"] == "vision"

    # Remove: the browser asks first. Dismissed, nothing happens; accepted, the team goes.
    asked: list[str] = []

    def answer(dialog: Any, accept: bool) -> None:
        asked.append(dialog.message)
        dialog.accept() if accept else dialog.dismiss()

    remove = panel.locator("form[data-form=remove-branch]").get_by_role("button", name="Remove team")
    page.once("dialog", lambda dialog: answer(dialog, False))
    menu.locator("summary").click()
    remove.click()
    expect(panel.locator("h2")).to_have_text("Acme / Computer Vision")
    page.once("dialog", lambda dialog: answer(dialog, True))
    remove.click()
    page.wait_for_url(f"{plane.url}/people/members/?branch=org%3A{org['id']}")
    expect(page.locator("main")).to_contain_text("Acme / Computer Vision removed.")
    expect(tree).not_to_contain_text("Computer Vision")
    assert (
        asked
        == [
            "Remove the team Computer Vision? Its limits and capacity quota go with it; its usage "
            "history stays. This cannot be undone."
        ]
        * 2
    )
    assert all(t["id"] != team["id"] for t in plane.api("GET", "teams")["results"])
    assert not csp_refusals, csp_refusals


def test_the_open_menu_and_a_refused_name_fit_a_phone(page: Any, plane: ControlPlane, csp_refusals: list[str]) -> None:
    org = next(o for o in plane.api("GET", "organizations")["results"] if o["name"] == "Acme")
    page.set_viewport_size({"width": PHONE, "height": HEIGHT})
    page.goto(f"{plane.url}/people/members/?branch=org:{org['id']}")
    page.locator("#panel details[data-branch-menu] summary").click()
    rename = page.locator("form[data-form=rename-branch]")
    rename.locator("input[name=name]").fill("")
    rename.get_by_role("button", name="Save name").click()
    sync_api.expect(rename.locator("[data-error=name]")).to_have_text("Give the organisation a name.")
    widths = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], widths
    assert not csp_refusals, csp_refusals
