"""The console in a real browser: Debian's Chromium, driven by Playwright, against `llmgw up`.

One control plane serves the tiny llama.cpp model (as in tests/gateway/test_sdk.py) and one
Chromium serves the whole module; each test opens its own browser context, signed in with the
cookies of one sign-in through the real form.

- Chromium is Debian's, at /usr/bin/chromium (`apt-get install chromium`; .ci/run installs it
  where it is missing). No test ever downloads a browser (`playwright install` is never run);
  without /usr/bin/chromium the module is skipped.
- Every console page is measured at a phone's width (390px) and a desktop's (1280px): none may
  be wider than the window. A table may be wider than the screen inside its own scrolling box
  (.table-box), which does not widen the page.
- Screenshots of the main pages land in test-artifacts/screenshots/<name>-<width>.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.helpers import REPO
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
SCREENSHOTS = REPO / "test-artifacts" / "screenshots"
PHONE, DESKTOP = 390, 1280
HEIGHT = 844
# A full-page screenshot is cut at this height: the manual's longest pages run to ~9000px.
SHOT_MAX_HEIGHT = 4000

# The pages other work adds to the console: measured when their route exists.
OPTIONAL_PAGES = {
    "chat": "chat",
    "usage": "usage",
    "cluster": "cluster",
    "sim": "sim",
    "fabrics:fabrics": "fabrics",
    "fabrics:nvlink": "nvlink",
    "facility:facility": "facility",
    "guardrails": "guardrails",
    "people": "people",
    "docs": "docs",
    "about": "about",
}

# How wide the page is, which elements stick out past the right edge of the window (for the
# message of a failed measurement), and which boxes on the page have content spilling out of
# them sideways (a figure too wide for its card). What lies inside a box that scrolls or clips
# (a table in .table-box, a .clip cell) is left out of both.
MEASURE = """() => {
  const width = window.innerWidth;
  const scrolls = element => /(auto|scroll|hidden|clip)/.test(getComputedStyle(element).overflowX);
  const inScrollingBox = element => {
    for (let parent = element.parentElement; parent && parent !== document.body; parent = parent.parentElement) {
      if (scrolls(parent)) return true;
    }
    return false;
  };
  const describe = element => {
    const classes = typeof element.className === "string" ? element.className : "";
    const text = (element.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 40);
    return `<${element.tagName.toLowerCase()}${element.id ? "#" + element.id : ""} class="${classes}">: ${text}`;
  };
  const sticking = [], spilling = [];
  for (const element of document.querySelectorAll("body *")) {
    const box = element.getBoundingClientRect();
    if (box.width === 0 || inScrollingBox(element)) continue;
    if (box.right > width + 0.5) sticking.push(`to ${Math.round(box.right)}px ${describe(element)}`);
    if (element.closest("main") && !scrolls(element) && element.clientWidth
        && getComputedStyle(element).display !== "inline" && element.scrollWidth > element.clientWidth + 1) {
      spilling.push(`${element.scrollWidth}px in ${element.clientWidth}px ${describe(element)}`);
    }
  }
  return {scrollWidth: document.documentElement.scrollWidth, innerWidth: width,
          sticking: sticking.slice(0, 8), spilling: spilling.slice(0, 8)};
}"""


def _llama() -> str | None:
    from tests.enginebin import llama_server_path

    path = llama_server_path()
    return str(path) if path else None


def _models_ready(plane: ControlPlane) -> bool:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(plane.url + "/v1/models", headers={"Authorization": f"Bearer {plane.key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            data = json.load(response)["data"]
    except urllib.error.HTTPError:
        return False  # the new key has not reached the gateway's table yet
    return any(m["id"] == "tiny" and m["llmgw"]["ready_replicas"] for m in data)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium); these tests never download a browser")
    if _llama() is None:
        from tests.enginebin import missing_reason

        pytest.skip(missing_reason())
    from tests.ggufgen import make_tiny_gguf

    tmp = tmp_path_factory.mktemp("browser")
    weights = make_tiny_gguf(tmp / "tiny.gguf")
    spec = tmp / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "tiny",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 2,
                                "context_size": 512,
                            }
                        ],
                    },
                ]
            }
        )
    )
    with ControlPlane(
        tmp, extra_env={"LLMGW_LLAMA_SERVER": _llama() or "", "LLMGW_GATEWAY_COLD_START_TIMEOUT": "120"}
    ) as running:
        assert running.ctl("model", "apply", "-f", str(spec))[0] == 0
        running.wait_for(lambda: _models_ready(running), timeout=90, what="tiny served by the gateway")
        # Long names, as real ones are, so the People page and the pickers have something to fit.
        org = running.api("POST", "organizations", {"name": "Acme Research and Development Laboratories"})
        team = running.api("POST", "teams", {"name": "Speech and Language Infrastructure", "organization": org["id"]})
        running.api("POST", "projects", {"name": "multilingual-evaluation-harness", "team": team["id"]})
        yield running
        engine = running.api("GET", "models/tiny")["replicas"][0]["shards"][0]["pid"]
    if engine:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine, signal.SIGKILL)


@pytest.fixture(scope="module")
def chromium(plane: ControlPlane) -> Iterator[Any]:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def signed_in(plane: ControlPlane, chromium: Any) -> dict[str, Any]:
    """Sign in through the real form once; the cookies it leaves serve every test's context."""
    context = chromium.new_context(viewport={"width": PHONE, "height": HEIGHT})
    page = context.new_page()
    page.goto(plane.url + "/")
    assert "/login/" in page.url  # a stranger is sent to sign in
    page.fill("#id_username", plane.email)
    page.fill("#id_password", "not the password")
    page.click("form button[type=submit]")
    sync_api.expect(page.locator("[role=alert]")).to_be_visible()
    page.fill("#id_username", plane.email)
    page.fill("#id_password", plane.password)
    page.click("form button[type=submit]")
    page.wait_for_url(plane.url + "/")
    sync_api.expect(page.locator("header")).to_contain_text(plane.email)
    state: dict[str, Any] = context.storage_state()
    context.close()
    return state


@pytest.fixture
def page(chromium: Any, signed_in: dict[str, Any]) -> Iterator[Any]:
    """A fresh context (its own cookies and localStorage), signed in, at a phone's width."""
    context = chromium.new_context(storage_state=signed_in, viewport={"width": PHONE, "height": HEIGHT}, locale="en-US")
    context.set_default_timeout(15_000)
    yield context.new_page()
    context.close()


@pytest.fixture
def csp_violations(page: Any) -> list[str]:
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


def local_node(plane: ControlPlane) -> str:
    nodes = plane.api("GET", "nodes")["results"]
    return next(n["name"] for n in nodes if n["labels"].get("llmgw.io/local") == "true")


def route_exists(name: str) -> bool:
    from django.urls import NoReverseMatch, reverse

    try:
        reverse(name)
    except NoReverseMatch:
        return False
    return True


def console_pages(plane: ControlPlane) -> list[tuple[str, str]]:
    """(screenshot name, path) of every console page there is."""
    pages = [
        ("overview", "/"),
        ("account", "/account/"),
        ("api-keys", "/account/keys/"),
        ("nodes", "/nodes/"),
        ("node", f"/nodes/{local_node(plane)}/"),
        ("models", "/models/"),
        ("model", "/models/tiny/"),
        ("model-explain", "/models/tiny/explain"),
        ("audit", "/audit/"),
    ]
    from django.urls import reverse

    pages += [(shot, reverse(name)) for name, shot in OPTIONAL_PAGES.items() if route_exists(name)]
    return pages


def measure(page: Any) -> dict[str, Any]:
    return page.evaluate(MEASURE)  # type: ignore[no-any-return]


def screenshot(page: Any, name: str, width: int) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}-{width}.png"
    height = min(page.evaluate("document.documentElement.scrollHeight"), SHOT_MAX_HEIGHT)
    page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": width, "height": height})
    return path


def check_widths(
    page: Any, plane: ControlPlane, pages: list[tuple[str, str]], width: int, *, shots: bool = True
) -> list[str]:
    """Load each page at `width`; the pages wider than the window, with what sticks out."""
    page.set_viewport_size({"width": width, "height": HEIGHT})
    too_wide = []
    for name, path in pages:
        response = page.goto(plane.url + path)
        assert response is not None and response.status == 200, f"{path}: {response and response.status}"
        assert "/login/" not in page.url, path
        found = measure(page)
        if found["scrollWidth"] > found["innerWidth"]:
            too_wide.append(
                f"{path} at {width}px is {found['scrollWidth']}px wide:\n    " + "\n    ".join(found["sticking"])
            )
        if found["spilling"]:
            too_wide.append(f"{path} at {width}px spills out of its boxes:\n    " + "\n    ".join(found["spilling"]))
        if shots:
            screenshot(page, name, width)
    return too_wide


# Signing in and the language ------------------------------------------------------------------


def test_signed_in_through_the_form_and_the_overview_shows_who(page: Any, plane: ControlPlane) -> None:
    page.goto(plane.url + "/")
    sync_api.expect(page.locator("header")).to_contain_text(plane.email)
    sync_api.expect(page.locator("header nav")).to_contain_text("Overview")


def test_the_footer_switches_the_console_to_turkish(page: Any, plane: ControlPlane) -> None:
    page.goto(plane.url + "/nodes/")
    page.locator("footer a[lang=tr]").click()
    page.wait_for_url(plane.url + "/nodes/")  # back where the switch was pressed
    sync_api.expect(page.locator("html")).to_have_attribute("lang", "tr")
    sync_api.expect(page.locator("header nav")).to_contain_text("Genel bakış")
    sync_api.expect(page.locator("h1")).to_have_text("Düğümler")
    # Turkish words run longer: the phone still gets the whole page.
    found = measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    screenshot(page, "nodes-tr", PHONE)
    page.locator("footer a[lang=en]").click()
    sync_api.expect(page.locator("header nav")).to_contain_text("Overview")


# The nodes and the cluster ----------------------------------------------------------------------


def test_the_nodes_page_lists_the_local_node(page: Any, plane: ControlPlane) -> None:
    name = local_node(plane)
    page.goto(plane.url + "/nodes/")
    row = page.locator(f"tr[data-node='{name}']")
    sync_api.expect(row).to_be_visible()
    sync_api.expect(row).to_contain_text("ready")
    row.get_by_role("link", name=name).click()
    page.wait_for_url(f"{plane.url}/nodes/{name}/")
    sync_api.expect(page.locator("h1")).to_contain_text(name)


def test_the_cluster_page_draws_its_gpu_map_empty_on_a_node_without_gpus(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    if not route_exists("cluster"):
        pytest.skip("there is no cluster page")
    page.goto(plane.url + "/cluster/")
    sync_api.expect(page.locator(f"tr[data-node='{local_node(plane)}']")).to_be_visible()
    section = page.locator("section[aria-labelledby=cluster-gpus]")
    sync_api.expect(section.locator("#cluster-gpus")).to_have_text(re.compile(r"^\s*0 GPUs\s*$"))
    sync_api.expect(section.locator(".gpu-cell")).to_have_count(0)
    sync_api.expect(section).to_contain_text("No node has reported a GPU.")
    assert not csp_violations, csp_violations


def map_states_html() -> str:
    """One node's squares as the cluster page writes them: a split card, three of its slices (one
    held), a plain card and one that cannot be trusted."""
    from agent.probes.mig import slice_index
    from apps.cluster.overview import GpuSquare, NodeGpus

    def square(index: int, gpu_class: str = "H100-80GB", **state: Any) -> GpuSquare:
        return GpuSquare(
            node="gpu-01",
            index=index,
            gpu_class=gpu_class,
            utilization=40,
            memory_pct=None,
            memory_used_mib=None,
            memory_total_mib=None,
            temperature=None,
            held_by=state.pop("held_by", ""),
            colour="util",
            **state,
        )

    slices = [
        square(
            slice_index(0, n) or 0,
            "H100-80GB-1g.10gb",
            slice=f"GPU 0 MIG {n} (1g.10gb)",
            held_by="small #4" if n == 1 else "",
        )
        for n in range(3)
    ]
    squares = [square(0, split=True), *slices, square(1), square(2, fault="nvidia-smi -L lists 3 MIG devices")]
    cells = NodeGpus(name="gpu-01", short="gpu-01", squares=squares).cells
    return f'<div class="flex flex-wrap gap-1" id="map-states">{cells}</div>'


STATE_STYLES = """() => Object.fromEntries([...document.querySelectorAll('#map-states .gpu-cell')].map(cell => {
  const style = getComputedStyle(cell);
  return [cell.dataset.gpu, {
    classes: cell.className,
    label: cell.getAttribute('aria-label'),
    height: cell.getBoundingClientRect().height,
    border: style.borderTopStyle,
    outline: style.outlineStyle,
    background: style.backgroundImage,
    margin: parseFloat(style.marginInlineStart),
  }];
}))"""


def test_the_gpu_map_draws_split_cards_slices_and_untrusted_devices_apart(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    """The stylesheet gives each state its own look, and the words are in each square's label: the
    live page's own stylesheet, on squares written by the code that writes the map (the plane's
    node has no GPU to draw)."""
    if not route_exists("cluster"):
        pytest.skip("there is no cluster page")
    page.goto(plane.url + "/cluster/")
    page.locator("section[aria-labelledby=cluster-gpus]").evaluate(
        "(section, markup) => section.insertAdjacentHTML('beforeend', markup)", map_states_html()
    )
    cells = page.evaluate(STATE_STYLES)
    card, plain, untrusted = cells["0"], cells["1"], cells["2"]
    slices = [cells[index] for index in sorted(cells) if int(index) >= 1000]
    assert len(slices) == 3
    # A plain card: solid border, no pattern, no label beyond its number.
    assert (plain["border"], plain["background"], plain["label"]) == ("solid", "none", None)
    # A split card: segmented by stripes, and says so.
    assert "gpu-split" in card["classes"] and "repeating-linear-gradient" in card["background"]
    assert card["label"].startswith("0: split into slices")
    # Its slices: smaller than a card, drawn against it (no gap), each named.
    for one in slices:
        assert "gpu-slice" in one["classes"] and one["height"] < card["height"] and one["margin"] < 0
    assert [one["label"] for one in slices] == [f"0.{n}: GPU 0 MIG {n} (1g.10gb)" for n in range(3)]
    assert "gpu-held" in slices[1]["classes"]
    # A device that cannot be trusted: dashed outline and border, hatched, and why in words.
    assert "gpu-untrusted" in untrusted["classes"]
    assert (untrusted["border"], untrusted["outline"]) == ("dashed", "dashed")
    assert "repeating-linear-gradient" in untrusted["background"]
    assert untrusted["label"] == "2: cannot be trusted now: nvidia-smi -L lists 3 MIG devices"
    assert not csp_violations, csp_violations


# Every page fits the screen -------------------------------------------------------------------


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_no_console_page_is_wider_than_the_screen(
    page: Any, plane: ControlPlane, csp_violations: list[str], width: int
) -> None:
    pages = console_pages(plane)
    too_wide = check_widths(page, plane, pages, width)
    assert not too_wide, "\n".join(too_wide)
    assert not csp_violations, csp_violations


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_no_console_page_is_wider_than_the_screen_in_turkish(
    page: Any, plane: ControlPlane, csp_violations: list[str], width: int
) -> None:
    """Turkish words run longer than English ones: every page again, in Turkish."""
    page.goto(plane.url + "/")
    page.locator("footer a[lang=tr]").click()
    sync_api.expect(page.locator("html")).to_have_attribute("lang", "tr")
    too_wide = check_widths(page, plane, console_pages(plane), width, shots=False)
    assert not too_wide, "\n".join(too_wide)
    assert not csp_violations, csp_violations


def test_what_a_new_key_shows_fits_a_phone(page: Any, plane: ControlPlane, csp_violations: list[str]) -> None:
    """The secret, the commands and the files shown once after making a key scroll or fold on a phone."""
    page.goto(plane.url + "/account/keys/")
    page.fill("#key-name", "a-rather-long-key-name-for-the-laptop-at-home")
    page.locator("form:has(#key-name) button[type=submit]").click()
    sync_api.expect(page.locator("#new-key")).to_contain_text("llmgw_")
    found = measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    screenshot(page, "api-keys-new", PHONE)
    page.goto(plane.url + "/account/")
    tools = page.locator("section[data-tool]").evaluate_all("sections => sections.map(s => s.dataset.tool)")
    assert tools
    for tool in tools:
        page.goto(plane.url + "/account/")
        page.locator(f"section[data-tool='{tool}'] form button[type=submit]").click()
        sync_api.expect(page.locator(f"[data-connection='{tool}']")).to_be_visible()
        found = measure(page)
        assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], (tool, found)
        screenshot(page, f"account-{tool}", PHONE)
    assert not csp_violations, csp_violations


def test_no_page_of_the_manual_is_wider_than_a_phone(page: Any, plane: ControlPlane) -> None:
    """The manual's code (URLs, paths, commands) folds or scrolls in its own box."""
    if not route_exists("docs"):
        pytest.skip("there is no manual")
    page.goto(plane.url + "/docs/")
    links = page.locator("main a[href^='/docs/']").evaluate_all(
        "links => [...new Set(links.map(a => new URL(a.href).pathname))]"
    )
    documents = [(path.rsplit("/", 1)[-1], path) for path in links if re.fullmatch(r"/docs/[a-z0-9-]+", path)]
    assert documents
    too_wide = check_widths(page, plane, documents, PHONE, shots=False)
    assert not too_wide, "\n".join(too_wide)


# The chat page ---------------------------------------------------------------------------------


def _longer_replies(page: Any, max_tokens: int) -> None:
    """Ask the gateway for `max_tokens` tokens exactly: the page has no such setting, and the tiny
    model would otherwise stop at a random end-of-text token within a few dozen."""

    def route(route: Any) -> None:
        body = json.loads(route.request.post_data or "{}")
        body.update(max_tokens=max_tokens, ignore_eos=True)
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", route)


def _throttle(page: Any, bytes_per_second: int) -> Any:
    """Slow what reaches the page (the engine answers in milliseconds), so a reply is seen arriving."""
    session = page.context.new_cdp_session(page)
    session.send("Network.enable")
    session.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": bytes_per_second, "uploadThroughput": -1},
    )
    return session


def _unthrottle(session: Any) -> None:
    session.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
    )


# Every text the reply shows while it streams, recorded in the page as it changes.
RECORD_STREAM = """() => {
  window.seenWhileStreaming = [];
  new MutationObserver(() => {
    const replies = document.querySelectorAll("#chat-log article[data-role=assistant] .chat-text");
    const send = document.getElementById("chat-send");
    if (replies.length && send.dataset.state === "stop") {
      const text = replies[replies.length - 1].textContent;
      const seen = window.seenWhileStreaming;
      if (text && seen[seen.length - 1] !== text) seen.push(text);
    }
  }).observe(document.getElementById("chat-log"), {subtree: true, childList: true, characterData: true});
}"""


def _open_chat(page: Any, plane: ControlPlane) -> tuple[Any, dict[str, str]]:
    if not route_exists("chat"):
        pytest.skip("there is no chat page")
    page.goto(plane.url + "/chat/")
    texts: dict[str, str] = page.locator("#chat").evaluate("chat => Object.assign({}, chat.dataset)")
    sync_api.expect(page.locator("#chat-model")).to_have_value("tiny")
    sync_api.expect(page.locator("#chat-send")).to_be_enabled()
    return page.locator("#chat-send"), texts


def test_chat_reply_streams_in_with_the_hardware_under_it(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    send, texts = _open_chat(page, plane)
    _longer_replies(page, 48)
    page.evaluate(RECORD_STREAM)
    throttle = _throttle(page, 4_000)  # 48 tokens are ~8 KB of events: about two seconds
    page.fill("#chat-prompt", "Hello, tiny model")
    send.click()
    sync_api.expect(send).to_have_attribute("data-state", "stop")
    sync_api.expect(send).to_have_text(texts["tStop"])
    reply = page.locator("#chat-log article[data-role=assistant]").last
    meta = reply.locator(".chat-meta")
    sync_api.expect(meta).to_have_attribute("data-hardware", "cpu", timeout=60_000)
    sync_api.expect(send).to_have_attribute("data-state", "send")
    _unthrottle(throttle)

    seen = page.evaluate("window.seenWhileStreaming")
    assert len(seen) >= 2, f"the reply did not arrive in pieces: {seen!r}"
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:], strict=False)), seen
    user = page.locator("#chat-log article[data-role=user]").last
    sync_api.expect(user).to_contain_text("Hello, tiny model")
    sync_api.expect(reply.locator(".chat-text")).not_to_be_empty()
    # Under the reply: 48 tokens, and where they were made.
    sync_api.expect(meta).to_contain_text("48 tokens")
    sync_api.expect(meta).to_contain_text(texts["tServed"].replace("%(hardware)s", texts["tCpu"]))
    sync_api.expect(reply.locator(".chat-note")).to_be_hidden()
    screenshot(page, "chat-reply", PHONE)
    found = measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    assert not csp_violations, csp_violations


def test_chat_stop_keeps_the_partial_reply_and_a_reload_restores_it(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    send, texts = _open_chat(page, plane)
    _longer_replies(page, 400)  # ~65 KB of events: half a minute at this pace
    throttle = _throttle(page, 2_000)
    page.fill("#chat-prompt", "Tell me a long story")
    send.click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    shown = reply.locator(".chat-text")
    sync_api.expect(shown).not_to_be_empty(timeout=30_000)
    sync_api.expect(send).to_have_attribute("data-state", "stop")
    send.click()  # Stop
    sync_api.expect(send).to_have_attribute("data-state", "send")
    sync_api.expect(send).to_have_text(texts["tSend"])
    _unthrottle(throttle)

    note = reply.locator(".chat-note")
    sync_api.expect(note).to_have_text(texts["tStopped"])
    kept = page.evaluate("JSON.parse(localStorage.getItem('llmgw.chat.v1')).turns")
    assert [turn["role"] for turn in kept] == ["user", "assistant"]
    partial = kept[1]["content"]
    assert partial, "nothing of the reply was kept"
    assert kept[1]["meta"]["tokens"] is None  # the stream was cut before its usage came
    assert kept[1]["meta"]["hardware"] == "cpu"
    sync_api.expect(reply.locator(".chat-meta")).to_have_attribute("data-hardware", "cpu")

    page.reload()
    sync_api.expect(page.locator("#chat-log article")).to_have_count(2)
    sync_api.expect(page.locator("#chat-log article[data-role=user]")).to_contain_text("Tell me a long story")
    restored = page.locator("#chat-log article[data-role=assistant]")
    sync_api.expect(restored.locator(".chat-text")).not_to_be_empty()
    sync_api.expect(restored.locator(".chat-note")).to_have_text(texts["tStopped"])
    sync_api.expect(restored.locator(".chat-meta")).to_have_attribute("data-hardware", "cpu")
    again = page.evaluate("JSON.parse(localStorage.getItem('llmgw.chat.v1')).turns")
    assert again[1]["content"] == partial
    screenshot(page, "chat-stopped", PHONE)
    assert not csp_violations, csp_violations


# Forms in Turkish -----------------------------------------------------------------------------------


def test_in_turkish_every_form_of_the_model_card_submits_as_it_was_filled(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    """A Turkish page writes one and a half as 1,5; the browser's number fields must still read 1.5."""
    before = plane.api("GET", "models/tiny")
    page.goto(plane.url + "/models/tiny/")
    page.locator("footer a[lang=tr]").click()
    sync_api.expect(page.locator("html")).to_have_attribute("lang", "tr")
    for name in ("target", "class", "owner", "resources"):
        form = page.locator(f"#model-card form[data-form='{name}']").first
        numbers = form.locator("input[type=number]")
        for index in range(numbers.count()):
            field = numbers.nth(index)
            written = field.get_attribute("value")
            assert written and field.input_value() == written, (
                f"{name}: the browser reads {written!r} as {field.input_value()!r}"
            )
        form.locator("button[type=submit]").click()
        sync_api.expect(page.locator("#model-card [data-notice]")).to_be_visible()
        sync_api.expect(page.locator("#model-card [role=alert]")).to_have_count(0)
    after = plane.api("GET", "models/tiny")
    assert after["profiles"] == before["profiles"]  # submitted as shown: nothing changed
    page.goto(plane.url + "/nodes/add/")
    page.fill("input[name=name]", "tr-form-node")
    page.locator("main form button[type=submit]").click()
    sync_api.expect(page.locator("main [role=alert]")).to_have_count(0)
    page.locator("footer a[lang=en]").click()
    assert not csp_violations, csp_violations
