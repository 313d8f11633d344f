"""The chat page's server side: the page, its short-lived key, and rendering the model's turns.

The page's script (streaming, Stop, the figures under each reply, localStorage) is checked in a
browser elsewhere; here: what the server hands it and what it refuses.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.test import Client
from django.utils import timezone

from apps.accounts import services as account_services
from apps.accounts.models import ApiKey, AuditEvent, User
from apps.gateway import rendering
from apps.gateway.services import SESSION_FIELD
from apps.gateway.tables import key_hash, load_tables
from tests.builders import H100, make_model, make_node, make_replica
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db


def signed_in(user: User, **kwargs: Any) -> Client:
    client = Client(**kwargs)
    client.force_login(user)
    return client


def new_key(client: Client) -> dict[str, Any]:
    response = client.post("/chat/session-key")
    assert response.status_code == 200, response.content
    return response.json()


def render(client: Client, *texts: str) -> list[str]:
    response = client.post("/chat/render", json.dumps({"texts": list(texts)}), content_type="application/json")
    assert response.status_code == 200, response.content
    return response.json()["html"]


# The page ------------------------------------------------------------------------------------


def test_the_page_holds_no_key_and_loads_its_script_as_a_file(bob: User) -> None:
    client = signed_in(bob)
    response = client.get("/chat/")
    assert response.status_code == 200
    page = response.content.decode()
    assert 'data-session-key-url="/chat/session-key"' in page
    assert 'data-render-url="/chat/render"' in page
    assert 'data-api-url="/v1/chat/completions"' in page
    assert "/static/console/chat.js" in page and "defer" in page
    assert "llmgw_" not in page  # no secret in the HTML
    assert not ApiKey.objects.filter(user=bob).exists()  # the key is asked for by the script
    # Every text the script shows comes translated through the page.
    for attribute in ("data-t-send", "data-t-stop", "data-t-usage", "data-t-refused", "data-t-broke"):
        assert attribute in page
    assert '<details id="chat-settings"' in page
    assert 'id="chat-temperature"' in page and 'min="0" max="2"' in page
    assert "New conversation" in page


def test_the_page_obeys_the_strict_policy(bob: User) -> None:
    response = signed_in(bob).get("/chat/")
    check_body(response, check_strict(response, "/chat/"), "/chat/")


def test_the_chat_is_in_everyones_menu(bob: User) -> None:
    page = signed_in(bob).get("/").content.decode()
    assert 'href="/chat/"' in page and 'href="/usage/"' in page
    assert 'href="/cluster/"' not in page  # for staff only


def test_strangers_are_sent_to_sign_in(db: Any) -> None:
    client = Client()
    for response in (client.get("/chat/"), client.post("/chat/session-key"), client.post("/chat/render")):
        assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert not ApiKey.objects.exists()


# The picker says where each model runs ----------------------------------------------------------


def options(page: str) -> dict[str, str]:
    import re

    return {name: text for name, text in re.findall(r'<option value="([^"]+)"[^>]*>([^<]*)</option>', page)}


def test_the_picker_names_the_gpu_class_or_cpu_each_model_answers_on(bob: User) -> None:
    node = make_node("n1", gpus=1)
    # Each profile, on a GPU class or the CPU, is named after it in lower case: "h100-80gb", "cpu".
    profiles: dict[str, Any] = {"max_replicas": 2, "engine": "llama.cpp", "memory_gb": 2, "cores": 1, "gpus": 1}
    llama = make_model("llama", accelerators=(H100, "cpu"), **profiles)
    make_replica(llama, node, profile="h100-80gb", gpu_indices=(0,))
    both = make_model("both", accelerators=(H100, "cpu"), **profiles)
    make_replica(both, node, profile="h100-80gb", gpu_indices=(0,))
    make_replica(both, node, profile="cpu")
    make_replica(make_model("small", accelerators=("cpu",), **profiles), node, profile="cpu")
    make_model("idle", accelerators=("cpu",), **profiles)
    make_model("hosted", external_url="https://api.example/v1")
    page = signed_in(bob).get("/chat/").content.decode()
    shown = options(page)
    assert shown["llama"] == "llama · H100-80GB"
    assert shown["both"] == "both · H100-80GB, CPU"
    assert shown["small"] == "small · CPU"
    assert shown["idle"] == "idle · CPU, not running now"
    assert shown["hosted"] == "hosted · external provider"
    assert 'data-where="H100-80GB, CPU"' in page


def test_a_gateway_without_models_says_so(bob: User) -> None:
    page = signed_in(bob).get("/chat/").content.decode()
    assert "No model is declared" in page
    assert 'id="chat-model" class="field w-auto max-w-full" data-chat-model disabled' in page


# The session key -----------------------------------------------------------------------------


def test_the_session_key_is_marked_owned_and_lives_an_hour(bob: User) -> None:
    client = signed_in(bob)
    before = timezone.now()
    answer = new_key(client)
    key = ApiKey.objects.get()
    assert answer["key"].startswith("llmgw_") and answer["prefix"] == key.prefix
    assert key.is_session_key and key.user == bob and key.project is None and key.allowed_models == []
    assert before + timedelta(minutes=59) < key.expires_at <= timezone.now() + timedelta(hours=1)
    assert 3500 < answer["expires_in"] <= 3600
    assert client.session[SESSION_FIELD]["id"] == key.pk
    assert account_services.check_api_key(answer["key"]).key == key
    # The gateway's tables know it, so the page can use it at once.
    assert key_hash(answer["key"]) in load_tables().keys
    event = AuditEvent.objects.get(action="api_key.create")
    assert event.changes.get("session_key") is True


def test_the_answer_is_never_cached(bob: User) -> None:
    response = signed_in(bob).post("/chat/session-key")
    assert "no-cache" in response["Cache-Control"] or "no-store" in response["Cache-Control"]


def test_the_session_key_is_reused_while_it_is_good(bob: User) -> None:
    client = signed_in(bob)
    first, second = new_key(client), new_key(client)
    assert first["key"] == second["key"]
    assert ApiKey.objects.count() == 1


def test_a_key_near_its_end_is_replaced_and_the_old_one_revoked(bob: User) -> None:
    client = signed_in(bob)
    first = new_key(client)
    with time_machine.travel(timezone.now() + timedelta(minutes=55)):
        second = new_key(client)
    assert second["key"] != first["key"]
    old, new = ApiKey.objects.order_by("created_at")
    assert old.revoked_at is not None and new.revoked_at is None and new.is_session_key


def test_each_session_has_its_own_key(bob: User) -> None:
    assert new_key(signed_in(bob))["key"] != new_key(signed_in(bob))["key"]


def test_a_key_named_by_someone_elses_session_is_never_handed_out(bob: User, charlie: User) -> None:
    charlies = new_key(signed_in(charlie))
    client = signed_in(bob)
    session = client.session
    session[SESSION_FIELD] = {"id": ApiKey.objects.get(user=charlie).pk, "secret": charlies["key"]}
    session.save()
    mine = new_key(client)
    assert mine["key"] != charlies["key"]
    assert ApiKey.objects.get(user=charlie).revoked_at is None


def test_signing_out_revokes_the_session_keys_and_nothing_else(bob: User, key_for: Any) -> None:
    lasting = key_for(bob, name="laptop")
    client = signed_in(bob)
    secret = new_key(client)["key"]
    response = client.post("/logout/")
    assert response.status_code == 302
    assert account_services.check_api_key(secret).key is None
    assert ApiKey.objects.get(is_session_key=True).revoked_at is not None
    assert account_services.check_api_key(lasting).key is not None
    assert key_hash(secret) not in load_tables().keys


def test_session_keys_are_never_listed_with_the_persons_keys(bob: User, api: Any) -> None:
    client = signed_in(bob)
    prefix = new_key(client)["prefix"]
    assert prefix not in client.get("/account/keys/").content.decode()
    assert "0 active API keys" in client.get("/account/").content.decode()
    api.force_authenticate(bob)
    listed = api.get("/api/v1/keys").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert rows == []


def test_the_key_is_given_only_to_a_post_with_the_csrf_token(bob: User) -> None:
    client = signed_in(bob, enforce_csrf_checks=True)
    assert client.get("/chat/session-key").status_code == 405
    assert client.post("/chat/session-key").status_code == 403
    assert not ApiKey.objects.exists()
    client.get("/chat/")  # sets the CSRF cookie, as the page does
    token = client.cookies["csrftoken"].value
    assert client.post("/chat/session-key", HTTP_X_CSRFTOKEN=token).status_code == 200


# Rendering the model's turns -----------------------------------------------------------------


def test_raw_html_in_a_reply_is_shown_as_text(bob: User) -> None:
    (html,) = render(signed_in(bob), 'Hi <script>alert(1)</script> <img src=x onerror="go()"> <b>bold</b>')
    assert "<script" not in html and "<img" not in html and "<b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;bold&lt;/b&gt;" in html


def test_markdown_and_code_blocks_are_rendered(bob: User) -> None:
    html = render(
        signed_in(bob),
        "# Title\n\n**strong** and `x < 1`\n\n- one\n- two",
        "```python\nif a < b:\n    print('<ok>')\n```",
    )
    assert "<h1>Title</h1>" in html[0] and "<strong>strong</strong>" in html[0]
    assert "<code>x &lt; 1</code>" in html[0] and "<li>one</li>" in html[0]
    assert "<pre><code class=\"language-python\">if a &lt; b:\n    print('&lt;ok&gt;')" in html[1]


def test_math_is_kept_as_written_in_a_math_span(bob: User) -> None:
    (html,) = render(
        signed_in(bob),
        r"Euler: $e^{i\pi} + 1 = 0$, sum $$\sum_{n=1}^N a_n * b_n$$ and \(x_1\); "
        "prices $5 and $10; code `$x$`",
    )
    assert r'<span class="math">$e^{i\pi} + 1 = 0$</span>' in html
    assert r'<span class="math math-display">$$\sum_{n=1}^N a_n * b_n$$</span>' in html
    assert r'<span class="math">\(x_1\)</span>' in html
    assert "prices $5 and $10" in html
    assert "<code>$x$</code>" in html
    assert "<em>" not in html


def test_links_keep_only_safe_targets_and_images_fetch_nothing(bob: User) -> None:
    (html,) = render(
        signed_in(bob),
        "[a](javascript:alert(1)) [b](javascript&#58;go()) [c](https://example.com/x) "
        "![tracker](https://evil.example/pixel.png)",
    )
    assert "javascript" not in html
    assert 'href="https://example.com/x"' in html
    assert "<img" not in html and "tracker" in html


def test_the_turns_come_back_in_the_order_sent(bob: User) -> None:
    html = render(signed_in(bob), "one", "two", "three")
    assert [h.strip() for h in html] == ["<p>one</p>", "<p>two</p>", "<p>three</p>"]


def test_form_fields_are_rendered_too(bob: User) -> None:
    response = signed_in(bob).post("/chat/render", {"text": ["*a*", "b"]})
    assert response.json()["html"] == ["<p><em>a</em></p>", "<p>b</p>"]


def test_a_malformed_render_request_is_refused(bob: User) -> None:
    client = signed_in(bob)
    for body in ("not json", json.dumps({"texts": "x"}), json.dumps({"texts": [1]}), json.dumps([])):
        response = client.post("/chat/render", body, content_type="application/json")
        assert response.status_code == 400, body
    too_many = json.dumps({"texts": ["x"] * 501})
    assert client.post("/chat/render", too_many, content_type="application/json").status_code == 400


def test_without_python_markdown_text_is_escaped_and_code_kept(monkeypatch: Any) -> None:
    monkeypatch.setattr(rendering, "_markdown", lambda: None)
    html = rendering.render_markdown("Hi <b>there</b>\n\n```sh\necho '<x>'\n```\n\n$a_b$")
    assert "<p>Hi &lt;b&gt;there&lt;/b&gt;</p>" in html
    assert "<pre><code class=\"language-sh\">echo '&lt;x&gt;'\n</code></pre>" in html
    assert '<span class="math">$a_b$</span>' in html


def test_the_gateway_keeps_no_conversation() -> None:
    from apps.gateway import models

    names = {model.__name__ for model in vars(models).values() if isinstance(model, type)}
    assert not any("conversation" in name.lower() or "message" in name.lower() for name in names)
