"""The road the mirror advertises, walked as a newcomer walks it in Debian's Chromium: a fresh
`llmgw up` with its defaults (no LLMGW_MIRROR_NODE_DIR, its own agent on this machine), a Hub of
ours holding the tiny generated GGUF; find it under Explore, fetch it, press Serve with the form's
defaults, and chat with it on the chat page.

Before, the served model's source lay under /var/lib/llmgw/models/mirror, outside the local
agent's model directory: the agent refused the fetch, placement placed the replica all the same
and the engine crash-looped ("engine exited with code 1"); with the directory set inside, the
weights probe did not look below the top of the model directory and the model stayed pending.
The test's fixtures (Chromium, the signed-in browser context) are test_console's, bound here.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.browser import test_console as console
from tests.browser.test_console import CHROMIUM, PHONE, measure, route_exists, screenshot, sync_api
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

chromium = console.chromium
signed_in = console.signed_in
page = console.page
csp_violations = console.csp_violations

REPO = "acme/tiny-GGUF"
FILE = "tiny-F32.gguf"


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if not (CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium); these tests never download a browser")
    from tests.enginebin import llama_server_path, missing_reason
    from tests.ggufgen import make_tiny_gguf
    from tests.mirror.hubserver import HubServer, Repo

    llama = llama_server_path()
    if llama is None:
        pytest.skip(missing_reason())
    tmp = tmp_path_factory.mktemp("mirror-road")
    weights = make_tiny_gguf(tmp / FILE).read_bytes()
    repos = [Repo(REPO, {FILE: weights, "README.md": b"# tiny\n"}, downloads=12), Repo("acme/other", {"x.md": b"x"})]
    with HubServer(repos) as hub:
        env = {"LLMGW_HF_ENDPOINT": hub.url, "LLMGW_MIRROR_RESERVE_GB": "0", "LLMGW_LLAMA_SERVER": str(llama)}
        env["LLMGW_GATEWAY_COLD_START_TIMEOUT"] = "120"
        with ControlPlane(tmp, extra_env=env) as running:
            yield running
            pids = [s["pid"] for m in running.api("GET", "models")["results"] for s in _shards(running, m["name"])]
    for pid in pids:
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def _shards(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    return [s for r in plane.api("GET", f"models/{name}")["replicas"] for s in r["shards"]]


def test_explore_fetch_serve_with_the_forms_defaults_and_chat(
    page: Any, plane: ControlPlane, csp_violations: list[str]
) -> None:
    if not route_exists("chat"):
        pytest.skip("there is no chat page")
    # Explore: search the Hub, open the repository, fetch its GGUF.
    page.goto(plane.url + "/mirror/explore")
    page.fill("#mirror-q", "tiny")
    page.get_by_role("button", name="Search").click()
    page.locator(f'#mirror-results tr[data-repo="{REPO}"] a').click()
    group = page.locator('#mirror-groups tr[data-group="gguf:F32"]')
    sync_api.expect(group).to_contain_text("GGUF")
    group.locator('[data-action="mirror-fetch"]').click()
    page.wait_for_url(plane.url + "/mirror/")

    # Held: the list follows the download by itself; once held, Serve.
    held = page.locator(f'#mirror-files tr[data-file="{FILE}"]')
    sync_api.expect(held).to_have_attribute("data-state", "held", timeout=90_000)
    page.locator('[data-action="mirror-serve"]').click()

    # The form's defaults come from this machine's one node: the CPU (no GPU here), as many cores as
    # it has free (up to 4), and no "use the CPU anyway" where no GPU exists.
    sync_api.expect(page.locator("#serve-placement")).to_have_value("cpu")
    cores = int(page.locator("#serve-cores").input_value())
    assert 1 <= cores <= min(4, os.cpu_count() or 1), cores
    sync_api.expect(page.locator('input[name="allow_cpu"]')).to_have_count(0)
    sync_api.expect(page.locator('[data-verdict="fits"]')).to_be_visible()
    name = page.locator("#serve-name").input_value()
    source = page.locator("[data-runs-as]").inner_text()
    data_dir = plane.running.env["LLMGW_DATA_DIR"] if plane.running else ""
    assert f"{os.path.realpath(data_dir)}/models/mirror/" in source, source  # inside the local agent's model_dirs
    screenshot(page, "mirror-serve", PHONE)
    page.locator('[data-action="serve"]').click()
    page.wait_for_url(re.compile(rf".*/models/{re.escape(name)}/$"))

    # The card follows the replica until it is ready: the node fetched the file from the mirror,
    # verified it, reported it held, and the engine started on it.
    state = page.locator('#model-replicas tr[data-replica] td[data-col="state"]').first
    sync_api.expect(state).to_contain_text("ready", timeout=180_000)
    sync_api.expect(page.locator("#model-replicas")).not_to_contain_text("failed")

    # The node's page says it holds the version; the mirror's says which node holds it.
    node = console.local_node(plane)
    page.goto(f"{plane.url}/nodes/{node}/")
    sync_api.expect(page.locator('[data-section="mirror-fetches"] td[data-state="held"]')).to_have_count(1)
    page.goto(plane.url + "/mirror/")
    sync_api.expect(page.locator(f'[data-nodes] li[data-node="{node}"]')).to_have_attribute("data-state", "held")

    # Chat with it.
    page.goto(plane.url + "/chat/")
    page.locator("#chat-model").select_option(name)
    send = page.locator("#chat-send")
    sync_api.expect(send).to_be_enabled()
    page.fill("#chat-prompt", "Hello, tiny model from the mirror")
    send.click()
    reply = page.locator("#chat-log article[data-role=assistant]").last
    sync_api.expect(reply.locator(".chat-meta")).to_have_attribute("data-hardware", "cpu", timeout=120_000)
    sync_api.expect(send).to_have_attribute("data-state", "send")
    sync_api.expect(reply.locator(".chat-text")).not_to_be_empty()
    found = measure(page)
    assert found["scrollWidth"] <= found["innerWidth"], found
    assert not csp_violations, csp_violations


def test_explain_of_the_served_model_says_where_it_runs_without_contradicting_itself(
    page: Any, plane: ControlPlane
) -> None:
    """Run after the road above: the model runs, and explain says where and why before what one
    more replica would find; the replica that runs is never said to fit nowhere."""
    served = [m["name"] for m in plane.api("GET", "models")["results"] if m["status"]["ready"]]
    if not served:
        pytest.skip("the road above did not serve a model")
    page.goto(f"{plane.url}/models/{served[0]}/explain")
    sync_api.expect(page.locator("h1")).to_contain_text("runs where it does")
    placed = page.locator('[data-section="placed"] tr[data-placed]')
    sync_api.expect(placed).to_have_count(1)
    sync_api.expect(placed.locator('td[data-col="verdict"]')).to_contain_text("fits")
