from __future__ import annotations

import re

import pytest
from django.test import Client

from apps.accounts.models import ApiKey

pytestmark = pytest.mark.django_db


def test_the_console_asks_strangers_to_sign_in(client: Client) -> None:
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"].startswith("/login/")


def test_signing_in_through_the_form_shows_the_counts(bob) -> None:
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/")
    token = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', page.content).group(1).decode()
    response = client.post(
        "/login/", {"username": "bob@example.com", "password": "correct horse battery", "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 302
    landing = client.get("/")
    assert landing.status_code == 200
    for name in ("nodes", "models", "replicas"):
        assert f'data-count="{name}">0<'.encode() in landing.content


def test_a_wrong_password_says_so_without_naming_the_account(client: Client, bob) -> None:
    response = client.post("/login/", {"username": "bob@example.com", "password": "nope"})
    assert response.status_code == 200
    assert b"do not match an active account" in response.content


def test_a_forged_sign_in_without_the_csrf_token_is_refused(bob) -> None:
    client = Client(enforce_csrf_checks=True)
    response = client.post("/login/", {"username": "bob@example.com", "password": "correct horse battery"})
    assert response.status_code == 403


def test_the_keys_page_creates_shows_once_and_revokes(client: Client, bob) -> None:
    client.force_login(bob)
    response = client.post("/account/keys/", {"name": "laptop", "expires": "30"})
    assert response.status_code == 200
    secret = re.search(rb'id="new-key">(llmgw_[^<]+)<', response.content).group(1).decode()
    key = ApiKey.objects.get(user=bob)
    assert key.expires_at is not None
    again = client.get("/account/keys/")
    assert secret.encode() not in again.content
    assert key.prefix.encode() in again.content
    client.post("/account/keys/", {"revoke": key.pk})
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_nobody_revokes_another_persons_key_from_the_page(client: Client, bob, charlie, key_for) -> None:
    key_for(bob)
    key = ApiKey.objects.get(user=bob)
    client.force_login(charlie)
    assert client.post("/account/keys/", {"revoke": key.pk}).status_code == 404


def test_the_language_switch_sets_a_cookie_and_turkish_follows(client: Client, bob) -> None:
    client.force_login(bob)
    response = client.get("/_lang/tr?next=/")
    assert response.status_code == 302
    assert response.cookies["llmgw_language"].value == "tr"
    page = client.get("/")
    assert b'<html lang="tr">' in page.content
    assert "Genel bakış".encode() in page.content


def test_accept_language_is_followed_without_a_cookie(client: Client, bob) -> None:
    client.force_login(bob)
    page = client.get("/", HTTP_ACCEPT_LANGUAGE="tr-TR,tr;q=0.9")
    assert b'<html lang="tr">' in page.content


def test_an_unknown_language_falls_back_to_the_default(client: Client, bob) -> None:
    client.force_login(bob)
    client.get("/_lang/tr")
    response = client.get("/_lang/xx?next=/")
    assert response.status_code == 302
    page = client.get("/")
    assert b'<html lang="en">' in page.content


def test_the_language_switch_never_redirects_off_site(client: Client) -> None:
    response = client.get("/_lang/en?next=https://evil.example/")
    assert response["Location"] == "/"


def test_every_page_has_the_language_switch_at_its_foot(client: Client, bob) -> None:
    for path in ("/login/",):
        assert b"/_lang/tr" in client.get(path).content
    client.force_login(bob)
    for path in ("/", "/account/keys/"):
        assert b"/_lang/tr" in client.get(path).content


def test_the_schema_and_its_docs_page_are_served(client: Client, bob) -> None:
    client.force_login(bob)
    schema = client.get("/api/v1/schema", HTTP_ACCEPT="application/json")
    assert schema.status_code == 200
    assert b"/api/v1/keys" in schema.content
    docs = client.get("/api/v1/docs")
    assert docs.status_code == 200
    assert b"swagger" in docs.content.lower()


def test_the_django_admin_lists_every_model(client: Client, alice) -> None:
    from django.apps import apps
    from django.contrib import admin

    client.force_login(alice)
    assert client.get("/django-admin/").status_code == 200
    ours = [m for m in apps.get_models() if m.__module__.startswith("apps.")]
    missing = [m._meta.label for m in ours if m not in admin.site._registry]
    assert missing == []
    for model in ours:
        path = f"/django-admin/{model._meta.app_label}/{model._meta.model_name}/"
        assert client.get(path).status_code == 200, path


def _steps(page: str) -> dict[str, tuple[bool, str]]:
    """Each first step on the Overview: (done, its text without tags)."""
    found = re.findall(r'<li data-step="(\w+)" data-done="(true|false)">(.*?)</li>', page, re.S)
    return {step: (done == "true", " ".join(re.sub(r"<[^>]+>", "", text).split())) for step, done, text in found}


def test_the_overview_shows_the_first_steps_that_remain_and_links_what_is_done(client: Client, alice, key_for) -> None:
    from tests.builders import make_model, make_node

    client.force_login(alice)
    steps = _steps(client.get("/").content.decode())
    assert [done for done, _text in steps.values()] == [False, False, False]
    assert steps["node"][1].startswith("Join a node")
    # `make up`: its own machine joins as a node (a node added but never connected has not joined)
    make_node("pending-box", registered_at=None)
    make_node("workstation")
    page = client.get("/").content.decode()
    steps = _steps(page)
    assert steps["node"] == (True, "✓ A node has joined: workstation.")
    assert 'href="/nodes/workstation/"' in page
    assert not steps["model"][0] and not steps["key"][0]
    make_model("qwen")
    key_for(alice)
    page = client.get("/").content.decode()
    steps = _steps(page)
    assert steps["model"][0] and steps["model"][1].startswith("✓ A model is declared: qwen;")
    assert 'href="/models/qwen/"' in page
    assert steps["key"][0] and "You have an API key" in steps["key"][1]
    make_node("second")
    steps = _steps(client.get("/", headers={"accept-language": "en"}).content.decode())
    assert steps["node"] == (True, "✓ 2 nodes have joined: see Nodes.")


def test_a_member_sees_only_the_key_step(client: Client, bob) -> None:
    from tests.builders import make_node

    make_node("workstation")
    client.force_login(bob)
    steps = _steps(client.get("/").content.decode())
    assert list(steps) == ["key"] and steps["key"][0] is False
