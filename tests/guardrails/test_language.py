"""What guardrails say to people is in their language: a policy the API refuses, in the language the
request asks for (Accept-Language, as everywhere in Django's part of llmgw)."""

from __future__ import annotations

from typing import Any

import pytest

from apps.accounts.choices import StaffRole
from apps.guardrails.models import Policy
from tests.conftest import make_user

pytestmark = pytest.mark.django_db

TWO_SCOPES = {"name": "pii", "organization": "acme", "model": "m", "rules": []}
TWO_CARD_RULES = {
    "name": "pii",
    "rules": [
        {"name": "cards", "kind": "detector", "detector": "card"},
        {"name": "cards", "kind": "detector", "detector": "card"},
    ],
}


def test_a_policy_the_api_refuses_is_explained_in_the_requests_language(api: Any) -> None:
    api.force_authenticate(make_user("ada@example.com", role=StaffRole.ADMIN))
    turkish = api.post("/api/v1/guardrails", TWO_CARD_RULES, format="json", HTTP_ACCEPT_LANGUAGE="tr")
    assert turkish.status_code == 400
    assert turkish.json()["errors"] == {"rules[1].name": ["iki kuralın adı “cards”"]}
    assert turkish.json()["detail"] == "rules[1].name: iki kuralın adı “cards”"
    scopes = api.post("/api/v1/guardrails", TWO_SCOPES, format="json", HTTP_ACCEPT_LANGUAGE="tr")
    assert scopes.json()["errors"]["model"] == [
        "bir politikayı kuruluş, ekip, proje ya da modelden yalnızca birine bağlayın, 2 tanesine değil"
    ]
    missing = api.get("/api/v1/guardrails/nowhere", HTTP_ACCEPT_LANGUAGE="tr")
    assert missing.status_code == 404 and missing.json()["detail"] == "“nowhere” adında bir politika yok."
    english = api.post("/api/v1/guardrails", TWO_CARD_RULES, format="json", HTTP_ACCEPT_LANGUAGE="en")
    assert english.json()["errors"] == {"rules[1].name": ["two rules are named “cards”"]}
    assert not Policy.objects.exists()
