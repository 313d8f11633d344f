from __future__ import annotations

import logging
import re
import time
from typing import Any

import pytest
from django.db import connection, transaction
from django.test import Client, RequestFactory
from django.test.utils import CaptureQueriesContext

from apps.accounts import services, throttle
from apps.accounts.models import AuditEvent, User

pytestmark = pytest.mark.django_db

GOOD = "correct horse battery"
ADDRESS_A = "203.0.113.7"
ADDRESS_B = "198.51.100.20"


# Builders ------------------------------------------------------------------------------------------


def client_at(address: str, *, csrf: bool = False) -> Client:
    return Client(enforce_csrf_checks=csrf, REMOTE_ADDR=address)


def sign_in(client: Client, email: str, password: str, **extra: str) -> Any:
    return client.post("/login/", {"username": email, "password": password, **extra})


def form_token(content: bytes) -> str:
    found = re.search(rb'name="csrfmiddlewaretoken" value="([^"]+)"', content)
    assert found is not None, "the page has no form token"
    return found.group(1).decode()


def signed_in_as(client: Client) -> str | None:
    return client.session.get("_auth_user_id")


def refusal(response: Any) -> str:
    found = re.search(rb"data-refusal>([^<]+)<", response.content)
    assert found is not None, "the page says nothing about a refusal"
    return found.group(1).decode()


@pytest.fixture
def slots_taken(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every password-hash slot of this process busy, and a short wait for one."""
    monkeypatch.setattr(throttle, "HASH_WAIT", 0.05)
    for _ in range(throttle.HASH_SLOTS):
        assert throttle._slots.acquire(timeout=1)
    yield
    for _ in range(throttle.HASH_SLOTS):
        throttle._slots.release()


# Failed sign-ins per address and email ------------------------------------------------------------


def test_ten_wrong_passwords_lock_that_email_from_that_address_but_not_its_owner_elsewhere(bob) -> None:
    stranger = client_at(ADDRESS_A)
    for _ in range(throttle.PAIR_FAILURES.limit):
        response = sign_in(stranger, "bob@example.com", "guess")
        assert response.status_code == 200
        assert b"do not match an active account" in response.content

    refused = sign_in(stranger, "bob@example.com", GOOD)
    assert refused.status_code == 429
    assert "with this email address from your network" in refusal(refused)
    assert 0 < int(refused["Retry-After"]) <= throttle.PAIR_FAILURES.period
    assert signed_in_as(stranger) is None

    owner = client_at(ADDRESS_B)
    response = sign_in(owner, "bob@example.com", GOOD)
    assert response.status_code == 302
    assert signed_in_as(owner) == str(bob.pk)


def test_a_locked_email_leaves_other_accounts_open_from_the_same_address(bob, charlie) -> None:
    stranger = client_at(ADDRESS_A)
    for _ in range(throttle.PAIR_FAILURES.limit):
        sign_in(stranger, "bob@example.com", "guess")
    assert sign_in(stranger, "bob@example.com", GOOD).status_code == 429
    assert sign_in(stranger, "charlie@example.com", GOOD).status_code == 302


def test_the_lockout_reads_the_same_for_an_account_that_does_not_exist(bob) -> None:
    texts = []
    for email in ("bob@example.com", "nobody@example.com"):
        client = client_at(ADDRESS_A)
        for _ in range(throttle.PAIR_FAILURES.limit):
            sign_in(client, email, "guess")
        response = sign_in(client, email, "guess")
        assert response.status_code == 429
        texts.append(refusal(response))
    assert texts[0] == texts[1]


def test_fifty_failures_from_one_address_refuse_every_email_from_it(bob, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle, "POSTS", throttle.Bound(limit=1000, period=60))  # only failures count here
    stranger = client_at(ADDRESS_A)
    for n in range(throttle.ADDRESS_FAILURES.limit):
        # Nine tries per email, under the per-email bound, so only the address's bound is met.
        response = sign_in(stranger, f"user{n // 9}@example.com", "guess")
        assert response.status_code == 200, n

    refused = sign_in(stranger, "bob@example.com", GOOD)
    assert refused.status_code == 429
    assert "Too many failed sign-ins from your network" in refusal(refused)
    assert signed_in_as(stranger) is None

    assert sign_in(client_at(ADDRESS_B), "bob@example.com", GOOD).status_code == 302


def test_a_lockout_ends_with_its_window(bob, monkeypatch: pytest.MonkeyPatch) -> None:
    # Real seconds rather than a frozen clock: Redis expires keys by its own clock.
    monkeypatch.setattr(throttle, "PAIR_FAILURES", throttle.Bound(limit=2, period=1))
    client = client_at(ADDRESS_A)
    sign_in(client, "bob@example.com", "guess")
    sign_in(client, "bob@example.com", "guess")
    refused = sign_in(client, "bob@example.com", GOOD)
    assert refused.status_code == 429
    assert refused["Retry-After"] == "1"
    assert "Try again in 1 minute." in refusal(refused)
    time.sleep(1.2)
    assert sign_in(client, "bob@example.com", GOOD).status_code == 302


def test_a_good_password_clears_the_count_for_that_email(bob) -> None:
    client = client_at(ADDRESS_A)
    for _ in range(throttle.PAIR_FAILURES.limit - 1):
        sign_in(client, "bob@example.com", "guess")
    assert sign_in(client, "bob@example.com", GOOD).status_code == 302
    client.post("/logout/")
    for _ in range(throttle.PAIR_FAILURES.limit - 1):
        sign_in(client, "bob@example.com", "guess")
    assert sign_in(client, "bob@example.com", GOOD).status_code == 302


def test_a_lockout_is_logged(bob, caplog: pytest.LogCaptureFixture) -> None:
    client = client_at(ADDRESS_A)
    with caplog.at_level(logging.WARNING, logger="apps.accounts.throttle"):
        for _ in range(throttle.PAIR_FAILURES.limit):
            sign_in(client, "bob@example.com", "guess")
    locked = [record.getMessage() for record in caplog.records if "sign-in locked" in record.getMessage()]
    assert len(locked) == 1
    assert ADDRESS_A in locked[0] and "bob@example.com" in locked[0]


def test_a_failed_sign_in_writes_nothing_to_the_database(bob) -> None:
    client = client_at(ADDRESS_A)
    client.get("/login/")
    with CaptureQueriesContext(connection) as queries:
        sign_in(client, "bob@example.com", "guess")
        sign_in(client, "nobody@example.com", "guess")
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))
    ]
    assert writes == []
    assert not AuditEvent.objects.exists()


def test_a_sign_in_is_audited_with_the_address(bob) -> None:
    assert sign_in(client_at(ADDRESS_B), "bob@example.com", GOOD).status_code == 302
    event = AuditEvent.objects.get(action="user.sign_in")
    assert event.actor == bob
    assert event.address == ADDRESS_B


def test_a_sign_in_goes_to_next_on_this_site_only(bob) -> None:
    response = sign_in(client_at(ADDRESS_A), "bob@example.com", GOOD, next="/account/keys/")
    assert response["Location"] == "/account/keys/"
    response = sign_in(client_at(ADDRESS_B), "bob@example.com", GOOD, next="https://evil.example/")
    assert response["Location"] == "/"


def test_a_signed_in_person_is_sent_on_from_the_sign_in_page(client: Client, bob) -> None:
    client.force_login(bob)
    response = client.get("/login/")
    assert response.status_code == 302


# POSTs per address ---------------------------------------------------------------------------------


def test_more_than_thirty_posts_a_minute_from_one_address_are_refused(bob) -> None:
    client = client_at(ADDRESS_A)
    for n in range(throttle.POSTS.limit):
        # Empty passwords: nothing is checked, so no failure counts, only the POST.
        assert sign_in(client, f"user{n}@example.com", "").status_code == 200
    refused = sign_in(client, "bob@example.com", GOOD)
    assert refused.status_code == 429
    assert "sign-in and sign-up requests" in refusal(refused)
    assert 0 < int(refused["Retry-After"]) <= throttle.POSTS.period
    assert signed_in_as(client) is None

    assert sign_in(client_at(ADDRESS_B), "bob@example.com", GOOD).status_code == 302


def test_sign_up_posts_count_against_the_same_bound(settings, bob) -> None:
    settings.SIGNUP_OPEN = True
    client = client_at(ADDRESS_A)
    for n in range(throttle.POSTS.limit):
        client.post("/signup/", {"email": f"new{n}@example.com", "name": "N", "password": "short"})
    assert sign_in(client, "bob@example.com", GOOD).status_code == 429


def test_the_client_address_is_the_proxys_last_hop_only_behind_the_proxy(settings) -> None:
    request = RequestFactory().get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="1.1.1.1, 203.0.113.7")
    settings.BEHIND_TLS_PROXY = False
    assert throttle.client_address(request) == "10.0.0.2"
    settings.BEHIND_TLS_PROXY = True
    assert throttle.client_address(request) == "203.0.113.7"
    forged = RequestFactory().get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR="not-an-address")
    assert throttle.client_address(forged) == "10.0.0.2"


# Password-hash slots -------------------------------------------------------------------------------


def test_a_sign_in_is_refused_with_429_when_no_hash_slot_comes_free(bob, slots_taken) -> None:
    client = client_at(ADDRESS_A)
    response = sign_in(client, "bob@example.com", GOOD)
    assert response.status_code == 429
    assert "busy checking other passwords" in refusal(response)
    assert response["Retry-After"] == "5"
    assert signed_in_as(client) is None


def test_a_sign_up_is_refused_with_429_when_no_hash_slot_comes_free(settings, slots_taken) -> None:
    settings.SIGNUP_OPEN = True
    response = client_at(ADDRESS_A).post(
        "/signup/", {"email": "dana@example.com", "name": "Dana", "password": "a long enough passphrase"}
    )
    assert response.status_code == 429
    assert "busy checking other passwords" in refusal(response)
    assert not User.objects.filter(email="dana@example.com").exists()


def test_a_sign_in_waits_for_a_slot_and_goes_ahead_when_one_is_free(bob) -> None:
    with throttle.hash_slot():  # one slot of several taken
        assert sign_in(client_at(ADDRESS_A), "bob@example.com", GOOD).status_code == 302


# Login CSRF ----------------------------------------------------------------------------------------


def test_a_sign_in_without_the_form_token_is_refused_with_a_page(bob) -> None:
    client = client_at(ADDRESS_A, csrf=True)
    client.get("/login/")
    response = sign_in(client, "bob@example.com", GOOD)
    assert response.status_code == 403
    assert b'data-csrf="refused"' in response.content
    assert b"reload the page" in response.content
    assert signed_in_as(client) is None


def test_a_form_token_from_another_session_is_refused(bob) -> None:
    victim = client_at(ADDRESS_A, csrf=True)
    token = form_token(victim.get("/login/").content)
    attacker = client_at(ADDRESS_A, csrf=True)
    attacker.get("/login/")  # has a form-token cookie of its own
    response = sign_in(attacker, "bob@example.com", GOOD, csrfmiddlewaretoken=token)
    assert response.status_code == 403
    assert signed_in_as(attacker) is None


def test_signing_in_rotates_the_form_token(bob) -> None:
    client = client_at(ADDRESS_A, csrf=True)
    before = form_token(client.get("/login/").content)
    cookie_before = client.cookies["csrftoken"].value
    assert sign_in(client, "bob@example.com", GOOD, csrfmiddlewaretoken=before).status_code == 302
    assert client.cookies["csrftoken"].value != cookie_before
    # The token of the sign-in page no longer works once signed in; the new one does.
    assert client.post("/logout/", {"csrfmiddlewaretoken": before}).status_code == 403
    after = form_token(client.get("/").content)
    assert client.post("/logout/", {"csrfmiddlewaretoken": after}).status_code == 302


# Sign-up -------------------------------------------------------------------------------------------


def new_account(**fields: str) -> dict[str, str]:
    return {"email": "dana@example.com", "name": "Dana", "password": "a long enough passphrase", **fields}


def test_sign_up_is_closed_by_default(client: Client) -> None:
    page = client.get("/signup/")
    assert page.status_code == 200
    assert b'data-signup="closed"' in page.content
    assert b"Ask an administrator" in page.content
    assert b"Sign up</a>" not in client.get("/login/").content

    response = client.post("/signup/", new_account())
    assert response.status_code == 403
    assert not User.objects.filter(email="dana@example.com").exists()


def test_an_open_sign_up_creates_an_audited_account_that_can_sign_in(settings) -> None:
    settings.SIGNUP_OPEN = True
    client = client_at(ADDRESS_A)
    assert b"/signup/" in client.get("/login/").content
    response = client.post("/signup/", new_account(email="Dana@Example.com"))
    assert response.status_code == 302
    assert response["Location"] == "/signup/done/"
    user = User.objects.get(email="dana@example.com")
    assert user.name == "Dana" and not user.is_staff
    event = AuditEvent.objects.get(action="user.sign_up")
    assert event.actor == user and event.address == ADDRESS_A
    assert signed_in_as(client) is None
    assert sign_in(client, "dana@example.com", "a long enough passphrase").status_code == 302


def test_a_taken_address_ends_on_the_same_page_as_a_new_one(settings, bob) -> None:
    settings.SIGNUP_OPEN = True
    new = client_at(ADDRESS_A).post("/signup/", new_account())
    taken = client_at(ADDRESS_B).post("/signup/", new_account(email="bob@example.com", password="another passphrase"))
    assert (new.status_code, new["Location"]) == (taken.status_code, taken["Location"]) == (302, "/signup/done/")

    done = client_at(ADDRESS_B).get("/signup/done/")
    assert b"You can now sign in" in done.content
    assert b"ask an administrator to reset it" in done.content
    assert User.objects.filter(email="bob@example.com").count() == 1
    assert sign_in(client_at(ADDRESS_B), "bob@example.com", GOOD).status_code == 302
    assert not AuditEvent.objects.filter(action="user.sign_up", actor=bob).exists()


def test_a_duplicate_inside_a_transaction_leaves_the_connection_usable(bob) -> None:
    # On PostgreSQL a unique violation aborts the transaction unless it happened in a savepoint.
    with transaction.atomic():
        assert services.sign_up(email="bob@example.com", name="Bob", password="x" * 12) is None
        assert User.objects.filter(email="bob@example.com").count() == 1
    assert User.objects.count() == 1


def test_an_address_that_differs_only_in_case_counts_as_taken(db) -> None:
    User.objects.create(email="Dana@Example.com")  # as an older account might have been stored
    assert services.sign_up(email="dana@example.com", name="Dana", password="x" * 12) is None
    assert User.objects.count() == 1


def test_a_weak_password_is_refused_with_the_validators_words(settings) -> None:
    settings.SIGNUP_OPEN = True
    response = client_at(ADDRESS_A).post("/signup/", new_account(password="short"))
    assert response.status_code == 200
    assert b'data-error="password"' in response.content
    assert not User.objects.exists()


def test_any_other_failure_shows_a_reference_that_is_logged(
    settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    settings.SIGNUP_OPEN = True

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(services, "sign_up", broken)
    with caplog.at_level(logging.ERROR, logger="apps.accounts.views"):
        response = client_at(ADDRESS_A).post("/signup/", new_account())
    assert response.status_code == 500
    reference = re.search(rb'data-reference="([0-9a-f]+)"', response.content).group(1).decode()
    logged = [record for record in caplog.records if reference in record.getMessage()]
    assert logged and logged[0].exc_info is not None
    assert b"disk full" not in response.content


def test_the_django_admin_signs_in_through_the_bounded_page(client: Client, bob) -> None:
    response = client.get("/django-admin/")
    assert response.status_code == 302
    followed = client.get(response["Location"])
    assert followed.status_code == 302
    assert followed["Location"].startswith("/login/?next=/django-admin/")
    assert client.post("/django-admin/login/", {"username": "bob@example.com", "password": GOOD}).status_code == 405
    client.force_login(bob)  # signed in, but no admin access: sent to the console, not round in a loop
    assert client.get("/django-admin/login/?next=/django-admin/")["Location"] == "/"
