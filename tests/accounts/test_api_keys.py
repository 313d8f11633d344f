from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from apps.accounts import services
from apps.accounts.models import ApiKey, AuditEvent, hash_key

pytestmark = pytest.mark.django_db


def test_a_key_is_shown_once_and_only_its_hash_is_stored(api, bob) -> None:
    api.force_authenticate(bob)
    response = api.post("/api/v1/keys/", {"name": "laptop"}, format="json")
    assert response.status_code == 201, response.content
    secret = response.json()["key"]
    assert secret.startswith("llmgw_") and len(secret) > 40
    stored = ApiKey.objects.get(pk=response.json()["id"])
    assert stored.key_hash == hash_key(secret)
    assert secret not in str(ApiKey.objects.filter(pk=stored.pk).values().first())
    listed = api.get("/api/v1/keys/").json()["results"]
    assert [k["name"] for k in listed] == ["laptop"]
    assert "key" not in listed[0]
    assert AuditEvent.objects.filter(action="api_key.create", actor=bob).count() == 1


def test_me_answers_with_a_bearer_key(api, bob, key_for) -> None:
    secret = key_for(bob, name="ci")
    response = api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 200
    body = response.json()
    assert body["email"] == "bob@example.com"
    assert body["auth"]["method"] == "api_key"
    assert body["auth"]["key_name"] == "ci"


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("wrong", "Invalid API key."),
        ("revoked", "API key revoked."),
        ("expired", "API key expired."),
        ("foreign", "Not an llmgw API key."),
    ],
)
def test_a_bad_key_is_refused_with_a_json_reason(api, bob, key_for, state: str, reason: str) -> None:
    secret = key_for(bob)
    key = ApiKey.objects.get(key_hash=hash_key(secret))
    if state == "wrong":
        secret = secret[:-4] + "abcd"
    elif state == "revoked":
        services.revoke_api_key(key, actor=bob)
    elif state == "expired":
        ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    else:
        secret = "sk-something-else"
    response = api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 401
    assert response.json() == {"detail": reason}
    assert "bob" not in response.content.decode()


def test_a_suspended_owner_cannot_use_their_keys(api, bob, key_for) -> None:
    secret = key_for(bob)
    bob.is_active = False
    bob.save(update_fields=["is_active"])
    response = api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert response.status_code == 401


def test_nobody_sees_or_revokes_another_persons_keys(api, bob, charlie, key_for) -> None:
    key_for(bob, name="bobs")
    bobs = ApiKey.objects.get(user=bob)
    api.force_authenticate(charlie)
    assert api.get("/api/v1/keys/").json()["results"] == []
    assert api.get(f"/api/v1/keys/{bobs.pk}/").status_code == 404
    assert api.post(f"/api/v1/keys/{bobs.pk}/revoke").status_code == 404
    bobs.refresh_from_db()
    assert bobs.revoked_at is None


def test_revoking_through_the_api_stops_the_key(api, bob, key_for) -> None:
    secret = key_for(bob)
    key = ApiKey.objects.get(user=bob)
    api.force_authenticate(bob)
    assert api.post(f"/api/v1/keys/{key.pk}/revoke").json()["state"] == "revoked"
    api.force_authenticate(None)
    assert api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}").status_code == 401


def test_last_used_is_written_at_most_once_a_minute(api, bob, key_for, django_assert_num_queries) -> None:
    secret = key_for(bob)
    api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    first = ApiKey.objects.get(user=bob).last_used_at
    assert first is not None
    api.get("/api/v1/me", HTTP_AUTHORIZATION=f"Bearer {secret}")
    assert ApiKey.objects.get(user=bob).last_used_at == first


def test_a_malformed_key_list_is_a_field_error(api, bob) -> None:
    api.force_authenticate(bob)
    response = api.post("/api/v1/keys/", {"name": "x", "allowed_models": "all"}, format="json")
    assert response.status_code == 400
    assert "allowed_models" in response.json()["errors"]


def test_anonymous_requests_are_refused(api) -> None:
    response = api.get("/api/v1/me")
    assert response.status_code in {401, 403}
    assert "detail" in response.json()
