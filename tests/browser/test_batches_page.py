"""The Batches page in Debian's Chromium, against the test server: the progress bar and the counts
move while a batch runs, without the page being reloaded, and stop being fetched once it has ended;
cancel works from the page; nothing is refused under the Content Security Policy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import Client

from tests.browser.test_console import CHROMIUM, CHROMIUM_ARGS, sync_api

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    # Playwright's sync API keeps an event loop in this thread, idle while the test's own database
    # calls run between its steps; Django takes any running loop for async code without this.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def test_the_progress_bar_moves_without_a_reload_and_cancel_works(live_server: Any, browser: Any) -> None:
    from apps.batches.models import Batch
    from tests.batches.harness import make_batch, make_tenant

    tenant = make_tenant("ada")
    make_batch(tenant, "batch_live", succeeded=1, failed=0)
    session = Client()
    session.force_login(tenant.user)
    cookie = session.cookies[settings.SESSION_COOKIE_NAME].value
    context = browser.new_context(viewport={"width": 390, "height": 844}, locale="en-US")
    context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": cookie, "url": live_server.url}])
    context.set_default_timeout(15_000)
    page = context.new_page()
    refused: list[str] = []
    page.on(
        "console",
        lambda m: refused.append(m.text) if m.type == "error" and "Content Security Policy" in m.text else None,
    )
    loads: list[str] = []
    page.on("load", lambda: loads.append(page.url))

    page.goto(live_server.url + "/batches/")
    row = page.locator('tr[data-batch="batch_live"]')
    sync_api.expect(row.locator("meter")).to_have_attribute("value", "10")
    Batch.objects.filter(pk="batch_live").update(succeeded=6, failed=1)
    sync_api.expect(row.locator("meter")).to_have_attribute("value", "70")  # redrawn by htmx
    sync_api.expect(row.locator('[data-col="succeeded"]')).to_have_text("6")

    row.locator('[data-action="cancel"]').click()
    sync_api.expect(row).to_have_attribute("data-status", "cancelling")
    assert Batch.objects.get(pk="batch_live").status == "cancelling"

    page.goto(live_server.url + "/batches/batch_live/")
    card = page.locator("#batch-card")
    sync_api.expect(card).to_have_attribute("data-live", "true")
    Batch.objects.filter(pk="batch_live").update(status="cancelled", succeeded=7, failed=3, canceled=2)
    sync_api.expect(card).to_have_attribute("data-live", "false")  # ended: it stops asking
    sync_api.expect(card.locator('[data-field="progress"]')).to_have_text("10 of 10 answered (100%)")
    assert card.get_attribute("hx-trigger") is None
    assert loads == [live_server.url + "/batches/", live_server.url + "/batches/batch_live/"]  # no reloads
    assert refused == []
    context.close()
