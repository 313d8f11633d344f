"""Who a request came from, read once for the audit log and the sign-in throttle alike."""

from __future__ import annotations

import pytest
from django.test import Client, RequestFactory

from apps.accounts import throttle
from apps.accounts.models import AuditEvent
from llmgw.http import client_address


@pytest.mark.parametrize(
    ("behind", "forwarded", "expected"),
    [
        (False, "203.0.113.7", "10.0.0.2"),  # not behind the proxy: the header is the client's word
        (True, "203.0.113.7", "203.0.113.7"),  # the hop the proxy recorded
        (True, "198.51.100.1, 203.0.113.7", "203.0.113.7"),  # what the client put first is not trusted
        (True, "not-an-address", "10.0.0.2"),
    ],
)
def test_the_address_is_the_proxys_hop_only_behind_the_proxy(
    settings, behind: bool, forwarded: str, expected: str
) -> None:
    settings.BEHIND_TLS_PROXY = behind
    request = RequestFactory().get("/", REMOTE_ADDR="10.0.0.2", HTTP_X_FORWARDED_FOR=forwarded)
    assert client_address(request) == expected == throttle.client_address(request)


def test_no_request_or_no_usable_address_is_unknown() -> None:
    assert client_address(None) is None
    assert client_address(RequestFactory().get("/", REMOTE_ADDR="unix-socket")) is None
    assert throttle.client_address(RequestFactory().get("/", REMOTE_ADDR="unix-socket")) == "0.0.0.0"


@pytest.mark.django_db
def test_the_audit_log_records_the_address_the_throttle_counts(settings, client: Client, alice) -> None:
    settings.BEHIND_TLS_PROXY = True
    client.force_login(alice)
    client.post(
        "/account/keys/",
        {"name": "laptop", "expires": "7"},
        REMOTE_ADDR="10.0.0.2",
        HTTP_X_FORWARDED_FOR="198.51.100.1, 203.0.113.7",
    )
    event = AuditEvent.objects.filter(action__startswith="api_key").latest("pk")
    assert event.address == "203.0.113.7"
