"""Ids, NUL characters and routes that used to be 500s (or HTML) in the REST API and the console:
each is a 4xx with a clear answer, JSON under /api/. The same tests run on SQLite and PostgreSQL
(the CI runs the suite on both); PostgreSQL is where a NUL or an id past a bigint used to fail."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pytest
from django.test import Client

from apps.accounts import services as accounts
from apps.accounts.models import ApiKey, User
from llmgw.ids import MAX_ID, parse_id, whole_number

pytestmark = pytest.mark.django_db

# Unicode digits that str.isdigit() passes and int() refuses, an id past 32 bits, the first
# number past a bigint, and one far past it.
BAD_IDS = ["³", "²", str(2**40), str(2**63), "99999999999999999999999"]


@pytest.fixture
def admin_api(api: Any, alice: User, key_for: Any) -> Any:
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(alice)}")
    return api


@pytest.fixture
def member_api(api: Any, bob: User, key_for: Any) -> Any:
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(bob)}")
    return api


def assert_json(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"] == "application/json", response["Content-Type"]
    body: dict[str, Any] = response.json()
    assert isinstance(body.get("detail"), str) and body["detail"]
    return body


# The one reader of ids -------------------------------------------------------------------------


def test_an_id_is_ascii_digits_within_the_column() -> None:
    from apps.cluster.models import Gpu

    assert parse_id("42") == 42 and parse_id(str(MAX_ID)) == MAX_ID
    for raw in ["³", "２", " 4", "4 ", "1_000", "-1", "0", "", "+4", str(MAX_ID + 1), "9" * 5000, None, 4]:
        assert parse_id(raw) is None, raw
    assert whole_number("3600", 0, 3600) == 3600 and whole_number("3601", 0, 3600) is None
    assert whole_number("²", 0, 10) is None
    assert parse_id(str(2**40), Gpu) == 2**40  # a BigAutoField


# Unicode digits and ids past the column --------------------------------------------------------

ID_ROUTES = [
    ("get", "/api/v1/mirror/{}"),
    ("get", "/api/v1/mirror/{}/manifest"),
    ("get", "/api/v1/mirror/{}/estimate"),
    ("delete", "/api/v1/mirror/{}"),
    ("get", "/api/v1/fabric-tests/{}"),
    ("post", "/api/v1/agent-requests/{}/retry"),
    ("get", "/api/v1/limits/{}/"),
    ("delete", "/api/v1/limits/{}/"),
    ("get", "/api/v1/quotas/{}/"),
    ("get", "/api/v1/keys/{}/"),
    ("post", "/api/v1/keys/{}/revoke/"),
    ("get", "/api/v1/organizations/{}/"),
    ("get", "/api/v1/teams/{}/"),
    ("get", "/api/v1/projects/{}/"),
    ("get", "/api/v1/replicas/{}/"),
    ("get", "/api/v1/audit/{}/"),
]


@pytest.mark.parametrize("raw", BAD_IDS)
def test_an_id_that_is_not_one_or_past_the_column_is_a_json_404(admin_api: Any, raw: str) -> None:
    for method, route in ID_ROUTES:
        response = getattr(admin_api, method)(route.format(quote(raw)))
        assert_json(response, 404)


def test_a_mirror_file_by_a_version_id_that_is_not_one_is_a_json_404(client: Client, alice: User) -> None:
    client.force_login(alice)  # staff, by session: the route is the nodes' (their credential) and staff's
    for raw in BAD_IDS:
        assert_json(client.get(f"/api/v1/mirror-files/{quote(raw)}/tiny.gguf"), 404)


@pytest.mark.parametrize("raw", ["³", str(2**63), "99999999999999999999999"])
def test_a_limits_owner_filter_that_is_not_an_id_is_a_400_naming_it(admin_api: Any, raw: str) -> None:
    body = assert_json(admin_api.get(f"/api/v1/limits/?organization_id={quote(raw)}"), 400)
    assert "organization_id" in body["errors"]
    assert str(MAX_ID) in body["errors"]["organization_id"][0]


def test_a_limits_owner_filter_naming_nothing_is_an_empty_list(admin_api: Any) -> None:
    response = admin_api.get(f"/api/v1/limits/?organization_id={2**40}")
    assert response.status_code == 200 and response.json()["results"] == []


@pytest.mark.parametrize("raw", ["²", "³", str(2**63), "99999999999999999999999", ""])
def test_revoking_a_key_by_an_id_that_is_not_one_is_a_404_and_revokes_nothing(
    client: Client, bob: User, raw: str
) -> None:
    key = accounts.create_api_key(bob, name="ci", actor=bob).key
    client.force_login(bob)
    response = client.post("/account/keys/", {"revoke": raw})
    assert response.status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


@pytest.mark.parametrize("path", ["/people/members/{}/remove", "/people/users/{}/suspend", "/mirror/{}/remove"])
def test_console_routes_with_an_id_past_the_column_are_404s(client: Client, alice: User, path: str) -> None:
    client.force_login(alice)
    for raw in (str(2**63), "99999999999999999999999"):
        assert client.post(path.format(raw)).status_code == 404


def test_a_branch_key_with_unicode_digits_names_nothing(client: Client, alice: User) -> None:
    client.force_login(alice)
    for raw in ("organization:²", "team:³", f"project:{2**63}"):
        assert client.get("/people/limits/", {"branch": raw}).status_code in (200, 404)


# NUL characters --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/guardrails/%00", "/api/v1/fabrics/%00/topology", "/api/v1/requests/%00"])
def test_a_nul_in_an_api_path_is_a_json_400(member_api: Any, path: str) -> None:
    body = assert_json(member_api.get(path), 400)
    assert "NUL" in body["detail"]


def test_a_nul_in_a_query_value_or_name_is_a_400_naming_the_parameter(admin_api: Any) -> None:
    body = assert_json(admin_api.get("/api/v1/mirror/search?q=a%00b"), 400)
    assert body["errors"] == {"q": [body["detail"]]} and "“q”" in body["detail"]
    body = assert_json(admin_api.get("/api/v1/nodes/?na%00me=x"), 400)
    assert list(body["errors"]) == ["na\\x00me"]


def test_a_nul_in_a_console_path_form_or_cookie_is_a_400_saying_so(client: Client, alice: User) -> None:
    client.force_login(alice)
    response = client.get("/nodes/%00/")
    assert response.status_code == 400 and response["Content-Type"].startswith("text/plain")
    assert "NUL" in response.content.decode()
    response = client.post("/guardrails/remove", {"name": "a\x00"})
    assert response.status_code == 400 and "“name”" in response.content.decode()
    client.cookies["sessionid"] = "abcdefgh\x00"
    response = client.get("/")
    assert response.status_code == 400 and "“sessionid”" in response.content.decode()


# JSON answers under /api/ ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/api/v1/nope", "/api/v1/limits/abc/", "/api/v1/limits/1/2/3", "/api/v2/", "/api/"])
def test_an_address_no_route_matches_under_api_is_a_json_404(admin_api: Any, path: str) -> None:
    assert_json(admin_api.get(path), 404)


def test_a_method_not_allowed_under_api_is_a_json_405_listing_the_allowed(admin_api: Any) -> None:
    for path in ("/api/v1/me", "/api/v1/docs", "/api/v1/schema"):
        body = assert_json(admin_api.delete(path), 405)
        assert "GET" in body["detail"] or "GET" in admin_api.delete(path)["Allow"]


def test_a_post_to_a_node_file_route_is_answered_in_json(alice: User) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(alice)
    for path in ("/api/v1/engine-files/x.tar.gz", "/api/v1/mirror-files/1/x.gguf"):
        assert "CSRF" in assert_json(client.post(path), 403)["detail"]


def test_a_malformed_body_under_api_is_a_json_400(admin_api: Any) -> None:
    body = assert_json(admin_api.generic("POST", "/api/v1/limits/", b"{", content_type="application/json"), 400)
    assert "JSON" in body["detail"]
    # A request Django itself refuses (here, for a Host header it does not serve) is JSON too.
    assert_json(admin_api.get("/api/v1/me", HTTP_HOST="elsewhere.example"), 400)


def test_a_failure_under_api_is_a_json_500_without_a_traceback(admin_api: Any, monkeypatch: Any) -> None:
    from llmgw import readiness

    def broken() -> dict[str, str]:
        raise RuntimeError("a secret detail of the fault")

    monkeypatch.setattr(readiness, "run_checks", broken)  # a fault no input can cause
    admin_api.raise_request_exception = False
    body = assert_json(admin_api.get("/api/v1/status"), 500)
    assert "secret" not in body["detail"] and "Traceback" not in body["detail"]


def test_outside_the_api_django_keeps_its_own_pages(client: Client) -> None:
    response = client.get("/no-such-page/")
    assert response.status_code == 404 and response["Content-Type"].startswith("text/html")


def test_api_keys_are_not_touched_by_a_revoke_that_names_another_persons_key(
    client: Client, bob: User, charlie: User
) -> None:
    other = accounts.create_api_key(charlie, name="theirs", actor=charlie).key
    client.force_login(bob)
    assert client.post("/account/keys/", {"revoke": str(other.pk)}).status_code == 404
    assert ApiKey.objects.get(pk=other.pk).revoked_at is None


def test_a_form_body_to_the_api_is_still_refused_as_not_json(admin_api: Any) -> None:
    response = admin_api.post("/api/v1/limits/", {"organization": "1"}, format="multipart")
    assert_json(response, 415)
