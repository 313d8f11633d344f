"""Every console page is served under the strict Content-Security-Policy and obeys it.

The pages are found from the URL resolver, so a new page is checked as soon as it is
routed; one that takes arguments or answers only POST must be named below.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from apps.accounts.models import User
from apps.catalog.models import Model, Profile
from apps.cluster.choices import NodeStatus
from apps.cluster.models import Gpu, Node

pytestmark = pytest.mark.django_db

# Not console pages: the API and the Django admin (checked on their own below), machine
# endpoints, downloads, and views that only redirect.
SKIPPED_PREFIXES = ("api/", "django-admin/")
NOT_PAGES = {
    "batches:batch-file",  # a download, not a page
    "logout",
    "set-language",
    "metrics",
    "healthz",
    "readyz",
    "connect-script",
    "install-script",
    "install-bundle",
    "favicon",
    "oidc_authentication_init",
    "oidc_authentication_callback",
    "oidc_logout",
    # /people/ redirects to its Members tab; /org/ sends an administrator to /people/ (checked
    # as a manager in tests/accounts/test_people.py).
    "people",
    "org",
    "org-limits",
    "org-usage",
}
# Views that take POST only: their answers are the fragments of pages checked here.
POST_ONLY = {
    "cluster:node-cordon",
    "cluster:node-uncordon",
    "cluster:node-drain",
    "cluster:node-location",
    "cluster:node-doctor-run",
    "facility:hold",
    "facility:release",
    "facility:budget",
    "facility:budget-remove",
    "guardrails-set",
    "guardrails-remove",
    "cluster-engine-set",
    "cluster-engine-remove",
    "cluster-engine-build",
    "mirror:remove",
    "mirror:adapter-attach",
    "mirror:adapter-detach",
    "catalog:model-delete",
    "catalog:model-owner",
    "catalog:model-target",
    "catalog:model-class",
    "catalog:model-resources",
    "people-member-add",
    "people-member-remove",
    "people-user-suspend",
    "people-user-reactivate",
    "people-team-add",
    "people-project-add",
    "people-rate-limit",
    "people-capacity-quota",
    "people-share",
    "chat-session-key",
    "chat-render",
    "people-organization-add",
    "people-branch-rename",
    "people-branch-remove",
    "sim-runs",
    "sim-what-if",
    "batches:batch-cancel",
}
# Pages with arguments, opened on the objects the `fleet` fixture makes.
ARGUMENTS: dict[str, list[dict[str, str]]] = {
    "cluster:node": [{"name": "gpu1"}, {"name": "bare"}],
    "cluster:node-doctor": [{"name": "gpu1"}],
    "catalog:model": [{"name": "qwen"}, {"name": "hosted"}],
    "catalog:model-explain": [{"name": "qwen"}, {"name": "hosted"}],
    "docs-page": [{"slug": "quickstart"}, {"slug": "clients"}],
    "mirror:serve": [{"pk": "1"}],
    "fabrics:fabric": [{"fabric": "ib:0x000000000000000a"}],
    "sim-run": [{"pk": "1"}],
    "batches:batch": [{"pk": "batch_csp"}],
}
# Pages for people who are not signed in (they redirect an administrator away).
ANONYMOUS = {"login", "signup", "signup-done", "sso-failed"}


# Reading the policy and the pages ------------------------------------------------------------------


def directives(header: str) -> dict[str, list[str]]:
    policy: dict[str, list[str]] = {}
    for part in header.split(";"):
        words = part.split()
        if words:
            policy[words[0]] = words[1:]
    return policy


def script_nonce(policy: dict[str, list[str]]) -> str | None:
    for value in policy.get("script-src", []):
        if value.startswith("'nonce-"):
            return value[len("'nonce-") : -1]
    return None


class InlineFinder(HTMLParser):
    """Whatever in a page the policy would block: handlers, style attributes and elements,
    javascript: URLs, and inline scripts without the response's nonce."""

    def __init__(self, nonce: str | None) -> None:
        super().__init__(convert_charrefs=True)
        self.nonce = nonce
        self.problems: list[str] = []
        self.htmx_config = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.problems.append(f"<{tag} {name}=…> inline event handler")
            elif name == "style":
                self.problems.append(f"<{tag} style={value!r}>")
            elif name in ("href", "src", "action", "formaction") and (value or "").strip().lower().startswith(
                "javascript:"
            ):
                self.problems.append(f"<{tag} {name}={value!r}>")
        if tag == "script" and not values.get("src"):
            kind = (values.get("type") or "").lower()
            if kind not in ("application/json", "application/ld+json") and (
                self.nonce is None or values.get("nonce") != self.nonce
            ):
                self.problems.append("inline <script> without the response's nonce")
        if tag == "style":
            self.problems.append("inline <style> element")
        if tag == "meta" and values.get("name") == "htmx-config":
            self.htmx_config = values.get("content") or ""

    handle_startendtag = handle_starttag


def check_strict(response: Any, where: str) -> dict[str, list[str]]:
    header = response.headers.get("Content-Security-Policy")
    assert header, f"{where}: no Content-Security-Policy header"
    policy = directives(header)
    for directive in ("script-src", "style-src"):
        assert "'unsafe-inline'" not in policy.get(directive, []), f"{where}: {directive} allows 'unsafe-inline'"
    assert "'unsafe-eval'" not in policy.get("script-src", []), f"{where}: script-src allows 'unsafe-eval'"
    assert policy.get("default-src") == ["'self'"], where
    assert policy.get("script-src", [])[:1] == ["'self'"], where
    assert policy.get("style-src") == ["'self'"], where
    assert policy.get("object-src") == ["'none'"], where
    assert policy.get("base-uri") == ["'self'"], where
    assert policy.get("frame-ancestors") == ["'none'"], where
    assert policy.get("form-action") == ["'self'"], where
    return policy


def check_body(response: Any, policy: dict[str, list[str]], where: str) -> InlineFinder:
    finder = InlineFinder(script_nonce(policy))
    finder.feed(response.content.decode())
    finder.close()
    assert finder.problems == [], f"{where}: {finder.problems}"
    return finder


# The pages -----------------------------------------------------------------------------------------


def console_patterns() -> Iterator[tuple[str, str, bool]]:
    """(route, full name, takes arguments) for every routed console view."""

    def walk(patterns: list[Any], prefix: str, namespace: str) -> Iterator[tuple[str, str, bool]]:
        for pattern in patterns:
            route = prefix + str(pattern.pattern)
            if isinstance(pattern, URLResolver):
                inner = ":".join(part for part in (namespace, pattern.namespace or "") if part)
                yield from walk(pattern.url_patterns, route, inner)
            elif isinstance(pattern, URLPattern) and not route.startswith(SKIPPED_PREFIXES):
                name = f"{namespace}:{pattern.name}" if namespace else str(pattern.name)
                yield route, name, bool(pattern.pattern.regex.groupindex)

    yield from walk(get_resolver().url_patterns, "", "")


def console_urls() -> tuple[list[str], list[str]]:
    """The URLs to fetch as an administrator and anonymously; fails on a page nobody named."""
    admin_urls: list[str] = []
    anonymous_urls: list[str] = []
    unknown: list[str] = []
    for route, name, has_arguments in console_patterns():
        if name in NOT_PAGES or name in POST_ONLY:
            continue
        if has_arguments:
            if name not in ARGUMENTS:
                unknown.append(f"{route} ({name})")
                continue
            urls = [reverse(name, kwargs=kwargs) for kwargs in ARGUMENTS[name]]
        else:
            urls = [reverse(name)]
        (anonymous_urls if name in ANONYMOUS else admin_urls).extend(urls)
    assert unknown == [], f"name these pages' arguments in ARGUMENTS, or list them in POST_ONLY: {unknown}"
    return admin_urls, anonymous_urls


@pytest.fixture
def fleet(db: Any) -> None:
    """A node with GPUs and figures, a node with none, a local model with a profile, a hosted one."""
    now = timezone.now()
    sample = {
        "cpus": 32,
        "memory_total_bytes": 64 * 1024**3,
        "memory_used_bytes": 4 * 1024**3,
        "cpu_utilization_pct": 12.0,
        "load": [0.5, 0.4, 0.3],
        "shards": [],
        # In a multi-node NVLink domain with one card out, IMEX up: the NVLink page draws its rack.
        "gpus": [
            {
                "index": index,
                "fabric": {
                    "state": "Completed" if index == 0 else "In Progress",
                    "status": "Success",
                    "cluster_uuid": "3b4f1a2c-0000-4000-8000-00000000beef",
                    "clique_id": 7,
                    "health_summary": "Healthy",
                    "bandwidth": "Full",
                },
            }
            for index in range(2)
        ],
        "imex": {"installed": True, "state": "READY", "domain_state": "UP", "channels": [0], "nodes": []},
    }
    topology = {
        "gpus": [
            {
                "index": 0,
                "group": "nvl0",
                "links": {"1": 18},
                "paths": {"1": "NV18"},
                "nearest_nics": ["mlx5_0"],
                "numa_node": 0,
            },
            {
                "index": 1,
                "group": "nvl0",
                "links": {"0": 18},
                "paths": {"0": "NV18"},
                "nearest_nics": ["mlx5_1"],
                "numa_node": 1,
            },
        ]
    }
    gpu1 = Node.objects.create(
        name="gpu1",
        status=NodeStatus.READY,
        agent_version="0.1.0",
        registered_at=now,
        hardware={"cpus": 32, "memory_total_bytes": 64 * 1024**3, "gpu_count": 2, "gpu_topology": topology},
        labels={"rack": "r12"},
        sample=sample,
        sampled_at=now,
    )
    for index in range(2):
        Gpu.objects.create(
            node=gpu1, index=index, gpu_class="H100-80GB", name="NVIDIA H100 80GB HBM3", memory_total_mib=81559
        )
    Node.objects.create(name="bare", status=NodeStatus.PENDING, cordoned=True, cordon_reason="fan")
    qwen = Model.objects.create(name="qwen", min_replicas=1, max_replicas=2, source="/models/qwen.gguf")
    Profile.objects.create(
        model=qwen, name="cpu", engine="llama.cpp", accelerator="cpu", memory_bytes=8 * 1024**3, cpu_cores=4
    )
    Model.objects.create(
        name="hosted", min_replicas=0, max_replicas=0, external_url="https://api.example/v1", external_model="gpt-x"
    )
    # A held GGUF in the mirror, for its serve form.
    from tests.mirror.ggufbytes import held_gguf

    held_gguf(pk=1)
    # A simulation queued by someone (an administrator sees every run).
    from apps.accounts.choices import StaffRole
    from apps.sim.models import SimRun
    from tests.conftest import make_user

    SimRun.objects.create(pk=1, owner=make_user("sim@example.com", role=StaffRole.OPERATOR), scenario="step: 1m\n")
    # A running batch with a line's problem and metadata: the Batches page and its own page draw them.
    from apps.batches.models import Batch

    Batch.objects.create(
        id="batch_csp",
        user=make_user("batch@example.com"),
        endpoint="/v1/chat/completions",
        model="qwen",
        status="in_progress",
        total=4,
        succeeded=1,
        failed=1,
        errors=[{"code": "invalid_json_line", "message": "not JSON", "line": 2, "param": None}],
        metadata={"run": "nightly"},
        expires_at=now + timedelta(hours=24),
    )
    # gpu1 on an InfiniBand fabric that has been mapped: its page draws the map.
    from apps.fabrics import topology
    from apps.fabrics.models import FabricMap, NodeFabrics
    from tests.fabrics.fattree import fat_tree

    port = {"device": "mlx5_0", "port": 1, "fabric": "ib-a", "link_layer": "InfiniBand", "up": True}
    NodeFabrics.objects.create(node=gpu1, ports=[{**port, "sm_guid": "0x000000000000000a"}])
    tree = fat_tree(pods=1, sus_per_pod=1, hosts_per_su=2, rails=2, spines_per_pod=2, uplinks=2, cores_per_group=0)
    FabricMap.objects.create(
        fabric="ib:0x000000000000000a", node=gpu1, data=topology.to_dict(topology.parse(tree.text))
    )


def test_every_console_page_is_served_under_the_strict_policy(client: Client, alice: User, fleet: None) -> None:
    admin_urls, anonymous_urls = console_urls()
    assert {
        "/",
        "/account/keys/",
        "/nodes/",
        "/nodes/add/",
        "/models/",
        "/nodes/gpu1/",
        "/models/qwen/",
        "/models/qwen/explain",
        "/chat/",
        "/usage/",
        "/cluster/",
    } <= set(admin_urls)
    assert "/login/" in anonymous_urls

    for url in anonymous_urls:
        response = Client().get(url)
        assert response.status_code == 200, url
        finder = check_body(response, check_strict(response, url), url)
        assert '"includeIndicatorStyles": false' in finder.htmx_config, url

    client.force_login(alice)
    for url in admin_urls:
        response = client.get(url)
        assert response.status_code == 200, url
        finder = check_body(response, check_strict(response, url), url)
        assert '"includeIndicatorStyles": false' in finder.htmx_config, url
        # The fragment an htmx refresh swaps in obeys the same rules.
        fragment = client.get(url, HTTP_HX_REQUEST="true")
        check_body(fragment, check_strict(fragment, f"{url} (htmx)"), f"{url} (htmx)")


def test_the_open_sign_up_page_and_its_errors_are_strict(settings) -> None:
    settings.SIGNUP_OPEN = True
    client = Client()
    for response in (
        client.get("/signup/"),
        client.post("/signup/", {"email": "x", "password": "short"}),
        client.post("/login/", {"username": "a@example.com", "password": "wrong"}),
    ):
        check_body(response, check_strict(response, response.request["PATH_INFO"]), response.request["PATH_INFO"])


def test_the_django_admin_needs_no_relaxation(client: Client, alice: User, fleet: None) -> None:
    client.force_login(alice)
    for url in (
        "/django-admin/",
        "/django-admin/accounts/user/",
        f"/django-admin/accounts/user/{alice.pk}/change/",
        "/django-admin/cluster/node/",
        "/django-admin/login/",
    ):
        response = client.get(url)
        assert response.status_code in (200, 302), url
        if response.status_code == 200:
            check_body(response, check_strict(response, url), url)


def test_the_api_docs_relax_styles_only(client: Client, alice: User) -> None:
    client.force_login(alice)
    response = client.get("/api/v1/docs")
    assert response.status_code == 200
    policy = directives(response.headers["Content-Security-Policy"])
    assert policy["style-src"] == ["'self'", "'unsafe-inline'"]
    assert policy["script-src"][:1] == ["'self'"]
    assert "'unsafe-inline'" not in policy["script-src"] and "'unsafe-eval'" not in policy["script-src"]
    assert policy["img-src"] == ["'self'", "data:"]
    finder = InlineFinder(script_nonce(policy))
    finder.feed(response.content.decode())
    assert [problem for problem in finder.problems if "script" in problem] == []
    script = client.get("/api/v1/docs?script=")
    assert script.status_code == 200
    assert b"SwaggerUIBundle" in script.content
    assert b'"validatorUrl": null' in script.content


def test_the_page_reader_finds_what_the_policy_would_block() -> None:
    finder = InlineFinder("abc")
    finder.feed(
        '<div style="color:red"><button onclick="go()">x</button><a href="javascript:go()">y</a>'
        '<script>go()</script><script nonce="abc">ok()</script><script nonce="xyz">no()</script>'
        '<script src="/static/a.js"></script><script type="application/json">{}</script>'
        '<style>p{}</style><svg><rect style="fill:red"/></svg></div>'
    )
    assert finder.problems == [
        "<div style='color:red'>",
        "<button onclick=…> inline event handler",
        "<a href='javascript:go()'>",
        "inline <script> without the response's nonce",
        "inline <script> without the response's nonce",
        "inline <style> element",
        "<rect style='fill:red'>",
    ]
