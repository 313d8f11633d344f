"""Math in the chat page's replies, typeset by KaTeX in Debian's Chromium, against `llmgw up`.

The control plane, the browser and the signed-in context are test_console's fixtures (this
module gets its own of each). The tiny random model writes no math of its own, so it is made
to: the page's request is given, on its way, a llama.cpp grammar that allows one reply only,
as test_console gives it max_tokens. That reply streams through the gateway like any other;
when it ends the page has the server render it and typesets its formulas.

The longer case (code blocks, a malformed formula, prices, formulas whose KaTeX output carries
style attributes) is a conversation put in the page's storage and drawn on reload, as a kept
conversation is: the server renders it and the page typesets it, through the same code.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.browser import test_console as console
from tests.browser.test_console import PHONE, measure, route_exists, screenshot, sync_api
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

# test_console's fixtures, bound here so that pytest finds them for this module.
plane = console.plane
chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

STORE = "llmgw.chat.v1"
SHORT_REPLY = r"Area $\pi r^2$, and $$\sum_{k=1}^{n} k$$"
LONG_REPLY = "\n".join(
    [
        r"Inline $a^2 + b^2 = c^2$ and \(\vec{v} \cdot \vec{w}\), bold \(\pmb{x}\); $5 and $10 stay prices.",
        "",
        r"$$\int_0^1 x\,dx = \frac{1}{2}$$",
        "",
        r"\[\left(\begin{matrix} a \\ b \\ c \end{matrix}\right)\]",
        "",
        r"A broken one: $\frac{1}{$ and inline code `$y^2$`.",
        "",
        "```python",
        r'area = "$\pi r^2$"  # \(not math\)',
        "```",
    ]
)
BROKEN = r"$\frac{1}{$"


def _gbnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _answer_with(page: Any, reply: str) -> None:
    """Have the tiny model answer exactly `reply`: a grammar that allows nothing else."""

    def route(route: Any) -> None:
        body = json.loads(route.request.post_data or "{}")
        body.update(grammar="root ::= " + _gbnf_literal(reply), max_tokens=200, temperature=0)
        route.continue_(post_data=json.dumps(body))

    page.route("**/v1/chat/completions", route)


def _open_chat(page: Any, plane: ControlPlane) -> dict[str, str]:
    if not route_exists("chat"):
        pytest.skip("there is no chat page")
    page.goto(plane.url + "/chat/")
    texts: dict[str, str] = page.locator("#chat").evaluate("chat => Object.assign({}, chat.dataset)")
    sync_api.expect(page.locator("#chat-model")).to_have_value("tiny")
    return texts


def _katex_is_served_hashed(page: Any) -> None:
    script = page.locator("script[src*='/katex/']").get_attribute("src")
    sheet = page.locator("link[href*='/katex/']").get_attribute("href")
    assert re.fullmatch(r"/static/console/katex/katex\.min\.[0-9a-f]{12}\.js", script or ""), script
    assert re.fullmatch(r"/static/console/katex/katex\.min\.[0-9a-f]{12}\.css", sheet or ""), sheet


def test_a_streamed_reply_has_its_math_typeset_when_it_ends(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    _open_chat(page, plane)
    _katex_is_served_hashed(page)
    sync_api.expect(page.locator("#chat-send")).to_be_enabled()
    _answer_with(page, SHORT_REPLY)
    page.fill("#chat-prompt", "What is the area of a circle?")
    page.locator("#chat-send").click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    sync_api.expect(reply.locator(".chat-meta")).to_have_attribute("data-hardware", "cpu", timeout=60_000)
    sync_api.expect(page.locator("#chat-send")).to_have_attribute("data-state", "send")
    kept = page.evaluate(f"JSON.parse(localStorage.getItem('{STORE}')).turns")
    assert kept[-1]["content"] == SHORT_REPLY  # the model wrote it, token by token

    body = reply.locator(".chat-text")
    sync_api.expect(body.locator(".math-typeset")).to_have_count(2)
    sync_api.expect(body.locator(".katex")).to_have_count(2)
    sync_api.expect(body.locator(".katex-display")).to_have_count(1)
    sync_api.expect(body.locator(".math-error")).to_have_count(0)
    # KaTeX keeps the source for screen readers and copying, in its MathML.
    annotations = body.locator("annotation[encoding='application/x-tex']").all_text_contents()
    assert annotations == [r"\pi r^2", r"\sum_{k=1}^{n} k"], annotations
    sync_api.expect(body).to_contain_text("Area")
    assert not csp_violations, csp_violations


def test_a_kept_conversation_is_typeset_on_reload_leaving_code_and_broken_formulas_as_written(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    texts = _open_chat(page, plane)
    conversation = {
        "turns": [
            {"role": "user", "content": "Some math, please"},
            {"role": "assistant", "content": LONG_REPLY, "model": "tiny"},
        ],
        "system": "",
        "temperature": "",
        "model": "tiny",
    }
    page.evaluate("([key, value]) => localStorage.setItem(key, value)", [STORE, json.dumps(conversation)])
    page.reload()
    _katex_is_served_hashed(page)
    body = page.locator("#chat-log article[data-role=assistant] .chat-text")
    sync_api.expect(body.locator("p")).not_to_have_count(0)  # rendered by the server

    # Five formulas typeset: three inline, two displayed.
    sync_api.expect(body.locator(".math-typeset")).to_have_count(5)
    sync_api.expect(body.locator(".math-typeset > .katex")).to_have_count(3)
    sync_api.expect(body.locator(".math-typeset > .katex-display")).to_have_count(2)
    # The malformed one stays its source text, marked, with the page's own words on hover.
    broken = body.locator(".math-error")
    sync_api.expect(broken).to_have_count(1)
    sync_api.expect(broken).to_have_text(BROKEN)
    sync_api.expect(broken).to_have_attribute("title", texts["tMathError"])
    sync_api.expect(broken.locator(".katex")).to_have_count(0)
    # Code is code: the fenced block and the inline code keep their dollars, untouched.
    sync_api.expect(body.locator("pre code")).to_have_text(re.compile(re.escape(r'area = "$\pi r^2$"  # \(not math\)')))
    sync_api.expect(body.locator("pre .katex, code .katex, pre .math, code .math")).to_have_count(0)
    sync_api.expect(body.locator(":not(pre) > code")).to_have_text("$y^2$")
    sync_api.expect(body).to_contain_text("$5 and $10 stay prices.")

    # \vec and \pmb are built with style attributes, which the page sets through CSSOM: applied,
    # and nothing refused. Every SVG of KaTeX's is drawn (none squeezed to nothing by the page's CSS).
    svgs = body.locator(".katex-html svg").evaluate_all(
        "svgs => svgs.map(svg => [svg.style.width, svg.getBoundingClientRect().width])"
    )
    assert len([width for width, _drawn in svgs if width]) == 2, svgs  # the arrows of \vec{v} and \vec{w}
    assert all(drawn > 0 for _width, drawn in svgs), svgs
    # The fonts come from the hashed files the stylesheet names.
    loaded = page.evaluate("""async () => {
      await document.fonts.ready;
      return Array.from(document.fonts).filter(f => f.family.startsWith("KaTeX") && f.status === "loaded")
        .map(f => f.family);
    }""")
    assert "KaTeX_Main" in loaded and "KaTeX_Math" in loaded, loaded
    fonts = page.evaluate("""() => performance.getEntriesByType("resource").map(e => new URL(e.name).pathname)
                               .filter(p => p.endsWith(".woff2") && p.includes("/katex/"))""")
    assert fonts and all(
        re.fullmatch(r"/static/console/katex/fonts/KaTeX_[\w-]+\.[0-9a-f]{12}\.woff2", f) for f in fonts
    ), fonts
    found = measure(page)
    assert found["scrollWidth"] <= found["innerWidth"] and not found["spilling"], found
    screenshot(page, "chat-math", PHONE)
    assert not csp_violations, csp_violations


SECRET = "sk-ant-" + "a1b2c3d4e5" * 3
POLICY = """name: secrets
rules:
  - {name: keys, kind: detector, detector: api_key, action: stop, applies_to: output}
  - {name: codename, kind: terms, terms: [Project Falcon], action: refuse}
"""


def test_the_chat_page_names_the_policy_that_refused_a_prompt_or_stopped_an_answer(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    import urllib.error
    import urllib.request

    # An administrator sets the policy on the Guardrails page.
    page.goto(plane.url + "/guardrails/")
    page.fill("#policy-text", POLICY)
    page.locator("[data-action=set-policy]").click()
    sync_api.expect(page.locator("main")).to_contain_text("Policy “secrets” is set, with 2 rules.")
    sync_api.expect(page.locator("tr[data-policy=secrets] [data-rule=codename]")).to_be_visible()

    def refused() -> bool:  # the gateway has reloaded its tables with the policy
        request = urllib.request.Request(
            plane.url + "/v1/chat/completions",
            data=json.dumps(
                {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "project falcon"}]}
            ).encode(),
            headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30):
                return False
        except urllib.error.HTTPError as exc:
            return exc.code == 400 and "guardrail_refused" in exc.read().decode()

    plane.wait_for(refused, timeout=30, what="the policy in force")
    _open_chat(page, plane)
    sync_api.expect(page.locator("#chat-send")).to_be_enabled()
    page.fill("#chat-prompt", "What is the status of Project Falcon?")
    page.locator("#chat-send").click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    sync_api.expect(reply.locator(".chat-note")).to_contain_text(
        "Refused by guardrail policy “secrets”, rule “codename”: a blocked term in the prompt.", timeout=30_000
    )
    sync_api.expect(page.locator("#chat-send")).to_have_attribute("data-state", "send")

    # The real model, made to write a key, is stopped where the key begins.
    _answer_with(page, f"Here is the key: {SECRET} and more words after it.")
    page.fill("#chat-prompt", "Give me a key.")
    page.locator("#chat-send").click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    sync_api.expect(reply.locator(".chat-note")).to_contain_text(
        "The answer was stopped by guardrail policy “secrets”, rule “keys”.", timeout=60_000
    )
    sync_api.expect(reply.locator(".chat-text")).to_have_text("Here is the key: ")
    assert "sk-ant" not in page.content()

    # The Guardrails page counts what the policy did, once the usage records are written.
    def counted() -> bool:
        page.goto(plane.url + "/guardrails/")
        counts = page.locator("tr[data-policy=secrets] [data-col=counts]").inner_text()
        return "stopped 1" in counts and "refused 0" not in counts

    plane.wait_for(counted, timeout=60, what="the policy's refusals and stop counted")
    sync_api.expect(page.locator("[data-section=recent] tr[data-request] [data-col=action]").first).to_be_visible()
    assert not csp_violations, csp_violations
