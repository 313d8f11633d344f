"""What a new person sees in Debian's Chromium, against `llmgw up`, at a desktop's width (1440px)
and a phone's (390px), in English and Turkish: no action button cut off inside a box that
scrolls (the mirror's Held tab, with a held model whose description is long), chart labels of
10px or more, explain's refusals readable without scrolling on a phone, the Django admin's app
headings in Turkish, and the chat page's limit on an answer's tokens.

The control plane, the browser and the signed-in context are test_console's fixtures (this
module gets its own of each)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import pytest

from tests.browser import test_console as console
from tests.browser.test_console import HEIGHT, PHONE, local_node, route_exists, screenshot, sync_api
from tests.e2e.helpers import REPO
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

# test_console's fixtures, bound here so that pytest finds them for this module.
plane = console.plane
chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

WIDE = 1440
MIN_LABEL_PX = 10

# Every action (a button, a link drawn as one) in the page's main part that is not wholly inside
# the boxes it sits in, as the page first shows it: one that a box scrolls out of sight, or that
# is cut at the window's edge.
CLIPPED_ACTIONS = """() => {
  const clipped = [];
  const actions = "main :is(button, input[type=submit], a.btn, a.btn-quiet, a.btn-primary, a.btn-danger)";
  for (const element of document.querySelectorAll(actions)) {
    const box = element.getBoundingClientRect();
    if (!box.width || !element.getClientRects().length) continue;
    let left = 0, right = window.innerWidth;
    for (let parent = element.parentElement; parent && parent !== document.body; parent = parent.parentElement) {
      if (/(auto|scroll|hidden|clip)/.test(getComputedStyle(parent).overflowX)) {
        const outer = parent.getBoundingClientRect();
        left = Math.max(left, outer.left + parent.clientLeft);
        right = Math.min(right, outer.left + parent.clientLeft + parent.clientWidth);
      }
    }
    if (box.left < left - 0.5 || box.right > right + 0.5) {
      const text = (element.textContent || element.value || "").trim().replace(/\\s+/g, " ").slice(0, 30);
      const at = `${Math.round(box.left)}-${Math.round(box.right)}px`;
      clipped.push(`${text} at ${at}, seen ${Math.round(left)}-${Math.round(right)}px`);
    }
  }
  return clipped;
}"""

# The size each chart label is drawn at on the screen (its font size times the chart's scale),
# for the labels shown (a chart carries a drawing for wide boxes and one for narrow ones).
SMALL_LABELS = """(least) => {
  const small = [];
  for (const text of document.querySelectorAll("main figure svg text")) {
    if (!text.getClientRects().length) continue;
    const ctm = text.getScreenCTM();
    if (!ctm) continue;
    const size = parseFloat(getComputedStyle(text).fontSize) * Math.hypot(ctm.a, ctm.b);
    if (size < least) small.push(`${size.toFixed(1)}px: ${text.textContent}`);
  }
  return small;
}"""
COUNT_LABELS = (
    "() => [...document.querySelectorAll('main figure svg text')].filter(t => t.getClientRects().length).length"
)


def _manage_shell(plane: ControlPlane, code: str) -> None:
    assert plane.running is not None
    argv = [sys.executable, "-m", "llmgw", "manage", "shell", "-c", code]
    done = subprocess.run(argv, cwd=REPO, env=plane.running.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


HELD = """
from apps.mirror.models import MirrorFile, MirrorVersion
from tests.mirror.ggufbytes import header
repo = "acme-research-laboratories/Qwen2.5-Coder-32B-Instruct-Distilled-GGUF"
version, _ = MirrorVersion.objects.get_or_create(
    repo=repo, commit="0123456789abcdef0123456789abcdef01234567", name="model-Q4_K_M.gguf", defaults={"kind": "gguf"}
)
meta = {"general.architecture": "llama", "llama.block_count": 2, "llama.embedding_length": 64,
        "llama.attention.head_count": 4, "llama.context_length": 4096}
data = header(meta) + bytes(4096)
file, _ = MirrorFile.objects.get_or_create(version=version, path="model-Q4_K_M.gguf",
                                           defaults={"size": len(data), "bytes_done": len(data), "state": "held"})
file.local_path.parent.mkdir(parents=True, exist_ok=True)
file.local_path.write_bytes(data)
"""


@pytest.fixture(scope="module")
def held(plane: ControlPlane) -> str:
    """The mirror holds a GGUF model with a long name, so that its Held row has a long description."""
    _manage_shell(plane, HELD)
    return "/mirror/"


@pytest.fixture(scope="module")
def used(plane: ControlPlane) -> None:
    """A request through the gateway, so that the usage page draws its charts."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    request = urllib.request.Request(
        plane.url + "/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def _in_turkish(page: Any, plane: ControlPlane) -> None:
    page.goto(plane.url + "/")
    page.locator("footer a[lang=tr]").click()
    sync_api.expect(page.locator("html")).to_have_attribute("lang", "tr")


def _pages(plane: ControlPlane, held: str) -> list[str]:
    pages = [path for _name, path in console.console_pages(plane)]
    if route_exists("mirror:held"):
        pages.append(held)
    return pages


@pytest.mark.parametrize("language", ["en", "tr"])
@pytest.mark.parametrize("width", [WIDE, PHONE])
def test_no_action_button_is_cut_off_inside_a_scrolling_box(
    page: Any, plane: ControlPlane, held: str, width: int, language: str, csp_violations: list[str]
) -> None:
    if language == "tr":
        _in_turkish(page, plane)
    page.set_viewport_size({"width": width, "height": HEIGHT})
    found = []
    for path in _pages(plane, held):
        page.goto(plane.url + path)
        found += [f"{path}: {line}" for line in page.evaluate(CLIPPED_ACTIONS)]
    if route_exists("mirror:held"):
        page.goto(plane.url + held)
        sync_api.expect(page.locator("[data-action=mirror-remove]")).to_be_visible()
        screenshot(page, f"mirror-held-{language}", width)
    assert not found, "\n".join(found)
    assert not csp_violations, csp_violations


@pytest.mark.parametrize("language", ["en", "tr"])
@pytest.mark.parametrize("width", [WIDE, PHONE])
def test_chart_labels_are_at_least_10px(page: Any, plane: ControlPlane, used: None, width: int, language: str) -> None:
    if language == "tr":
        _in_turkish(page, plane)
    page.set_viewport_size({"width": width, "height": HEIGHT})
    pages = ["/usage/", f"/nodes/{local_node(plane)}/", "/models/tiny/"]
    if route_exists("cluster"):
        pages.append("/cluster/")
    small, labels = [], 0
    for path in pages:
        page.goto(plane.url + path)
        labels += page.evaluate(COUNT_LABELS)
        small += [f"{path}: {line}" for line in page.evaluate(SMALL_LABELS, MIN_LABEL_PX)]
    assert labels > 0, "no chart was drawn"
    assert not small, "\n".join(small[:20])
    if width == PHONE:
        page.goto(plane.url + "/usage/")
        screenshot(page, f"usage-charts-{language}", width)


def test_explains_refusals_are_read_without_scrolling_on_a_phone(page: Any, plane: ControlPlane, tmp_path: Any) -> None:
    """A model no node can hold: its explain page lists every node's reasons, each of which fits the
    phone's width (a reason on one line ran past the table's box, out of sight)."""
    spec = tmp_path / "roomy.yaml"
    profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "4096GB", "cpu_cores": 512}
    model = {"name": "roomy", "source": "/models/roomy.gguf", "replicas": 1, "profiles": [profile]}
    spec.write_text(json.dumps({"models": [model]}))
    assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
    page.set_viewport_size({"width": PHONE, "height": HEIGHT})
    page.goto(plane.url + "/models/roomy/explain")
    reasons = page.locator("main td[data-col=reasons] li")
    sync_api.expect(reasons.first).to_be_visible()
    hidden = page.evaluate(
        """() => [...document.querySelectorAll("main td[data-col=reasons] li, main td.wrap")].filter(cell => {
          const box = cell.getBoundingClientRect();
          const scroller = cell.closest(".table-box").getBoundingClientRect();
          return box.width && (box.right > scroller.right + 0.5 || box.left < scroller.left - 0.5);
        }).map(cell => cell.textContent.trim().slice(0, 60))"""
    )
    assert hidden == []
    screenshot(page, "model-explain-refused", PHONE)


def test_the_admins_app_headings_are_in_turkish(page: Any, plane: ControlPlane) -> None:
    page.set_viewport_size({"width": WIDE, "height": HEIGHT})
    page.goto(plane.url + "/django-admin/")
    read = """() => Object.fromEntries([...document.querySelectorAll("caption a")]
      .map(link => [link.getAttribute("href"), link.textContent.trim()]))"""
    english = page.evaluate(read)
    assert english, "no app on the admin's index"
    _in_turkish(page, plane)
    page.goto(plane.url + "/django-admin/")
    turkish = page.evaluate(read)
    assert set(turkish) == set(english)
    untranslated = sorted(f"{href}: {english[href]}" for href in english if turkish[href] == english[href])
    assert untranslated == []
    screenshot(page, "admin-tr", WIDE)


def test_the_chat_page_limits_an_answers_tokens(page: Any, plane: ControlPlane, csp_violations: list[str]) -> None:
    if not route_exists("chat"):
        pytest.skip("there is no chat page")
    asked: list[dict[str, Any]] = []
    page.on(
        "request",
        lambda request: (
            asked.append(json.loads(request.post_data or "{}"))
            if request.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.goto(plane.url + "/chat/")
    texts: dict[str, str] = page.locator("#chat").evaluate("chat => Object.assign({}, chat.dataset)")
    page.select_option("#chat-model", "tiny")  # not the model no node can hold (explain's test)
    sync_api.expect(page.locator("#chat-send")).to_be_enabled()
    page.locator("#chat-settings summary").click()
    field = page.locator("#chat-max-tokens")
    sync_api.expect(field).to_have_value("1024")  # a base model is stopped by default
    field.fill("3")
    field.dispatch_event("change")
    page.fill("#chat-prompt", "Count to a hundred")
    page.locator("#chat-send").click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    sync_api.expect(reply.locator(".chat-meta")).to_have_attribute("data-hardware", "cpu", timeout=60_000)
    assert asked and asked[-1]["max_tokens"] == 3
    usage = json.loads(page.evaluate("localStorage.getItem('llmgw.chat.v1')"))["turns"][-1]["meta"]
    assert usage["tokens"] is not None and usage["tokens"] <= 3
    if usage["tokens"] == 3:  # the tiny model may end sooner, by chance: then there was no limit to reach
        sync_api.expect(reply.locator(".chat-note")).to_have_text(texts["tAtLimit"].replace("%(tokens)s", "3"))
    page.reload()
    page.locator("#chat-settings summary").click()
    sync_api.expect(page.locator("#chat-max-tokens")).to_have_value("3")  # kept, like the temperature
    assert not csp_violations, csp_violations
