"""Single sign-on: the mapping, the account service, the views, and a real provider end to end.

The end-to-end tests start panva's oidc-provider (tests/oidc_provider/) on loopback, run
llmgw in pytest-django's live server, and sign in through the authorization-code flow with
PKCE the way a browser would: provider login form, consent, callback. They skip when Node.js
or npm is missing, or when npm cannot install the provider.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import jwt
import pytest
import requests
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from apps.accounts import oidc, services
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership, User
from apps.accounts.sso_mapping import (
    MEMBERSHIP_ROLES,
    STAFF_ROLES,
    MembershipTarget,
    RoleMap,
    identity_from_claims,
    load_role_map,
    parse_role_map,
)
from tests.conftest import make_user

ROOT = Path(__file__).resolve().parents[2]
PROVIDER_DIR = ROOT / "tests" / "oidc_provider"

MAPPING: dict[str, Any] = {
    "roles": {"llm-admins": "admin", "llm-ops": "operator", "llm-viewers": "viewer", "llm-billing": "billing"},
    "memberships": {
        "vision-team": {"organization": "acme", "team": "vision", "role": "member"},
        "vision-leads": {"organization": "acme", "team": "vision", "role": "manager"},
        "research-team": {"organization": "acme", "team": "research"},
        "acme-all": {"organization": "acme"},
    },
}


def role_map() -> RoleMap:
    return parse_role_map(MAPPING, source="test")


# The mapping, without a database -----------------------------------------------------------------


def test_the_highest_mapped_role_wins() -> None:
    roles = role_map()
    assert roles.staff_role_for({"llm-viewers", "llm-ops", "unrelated"}) == "operator"
    assert roles.staff_role_for({"llm-billing", "llm-admins"}) == "admin"
    assert roles.staff_role_for({"llm-billing", "llm-viewers"}) == "billing"


def test_no_mapped_role_group_means_no_role_and_no_roles_section_means_hands_off() -> None:
    assert role_map().staff_role_for({"vision-team"}) == ""
    assert parse_role_map({"memberships": MAPPING["memberships"]}, source="test").staff_role_for({"x"}) is None


def test_groups_give_places_and_the_higher_role_wins_in_one_place() -> None:
    wanted = role_map().memberships_for({"vision-team", "vision-leads", "acme-all", "llm-ops"})
    assert wanted == {
        MembershipTarget("acme", "vision"): "manager",
        MembershipTarget("acme"): "member",
    }


def test_a_group_may_give_several_places() -> None:
    roles = parse_role_map(
        {
            "memberships": {
                "everyone": [
                    {"organization": "acme", "team": "vision"},
                    {"organization": "acme", "team": "vision", "project": "detector", "role": "manager"},
                ]
            }
        },
        source="test",
    )
    assert roles.memberships_for(["everyone"]) == {
        MembershipTarget("acme", "vision"): "member",
        MembershipTarget("acme", "vision", "detector"): "manager",
    }


def test_the_mapping_knows_every_role_the_models_do() -> None:
    assert set(STAFF_ROLES) == {role.value for role in StaffRole if role.value}
    assert set(MEMBERSHIP_ROLES) == {role.value for role in MembershipRole}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"roles": {"llm-admins": "root"}}, "roles.llm-admins: expected one of admin, operator, billing, viewer"),
        ({"role": {}}, "unknown key 'role'"),
        ({"roles": ["llm-admins"]}, "roles: expected a mapping"),
        ({"memberships": {"g": {"team": "vision"}}}, "memberships.g: organization is required"),
        ({"memberships": {"g": {"organization": "acme", "project": "p"}}}, "memberships.g: a project needs its team"),
        ({"memberships": {"g": {"organization": "acme", "role": "owner"}}}, "memberships.g.role: expected one of"),
        ({"memberships": {"g": {"organization": "acme", "tema": "x"}}}, "unknown key 'tema'"),
        ({"memberships": {"g": [{"organization": ""}]}}, "memberships.g[0].organization: expected a non-empty text"),
        ([1, 2], "expected a mapping with roles and memberships"),
    ],
)
def test_a_malformed_mapping_is_refused_naming_where(data: Any, message: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        parse_role_map(data, source="LLMGW_OIDC_ROLE_MAP")


def test_the_mapping_comes_from_json_or_from_a_yaml_file(tmp_path: Path) -> None:
    assert load_role_map({"LLMGW_OIDC_ROLE_MAP": json.dumps(MAPPING)}) == role_map()
    path = tmp_path / "sso.yaml"
    path.write_text("roles:\n  llm-admins: admin\nmemberships:\n  vision-team: {organization: acme, team: vision}\n")
    loaded = load_role_map({"LLMGW_OIDC_MAPPING_FILE": str(path)})
    assert loaded.staff_role_for(["llm-admins"]) == "admin"
    assert loaded.memberships_for(["vision-team"]) == {MembershipTarget("acme", "vision"): "member"}
    assert load_role_map({}) == RoleMap()


def test_a_bad_mapping_variable_is_named(tmp_path: Path) -> None:
    with pytest.raises(ImproperlyConfigured, match="LLMGW_OIDC_ROLE_MAP: not valid JSON"):
        load_role_map({"LLMGW_OIDC_ROLE_MAP": "{roles"})
    with pytest.raises(ImproperlyConfigured, match="LLMGW_OIDC_MAPPING_FILE=.*cannot read the file"):
        load_role_map({"LLMGW_OIDC_MAPPING_FILE": str(tmp_path / "missing.yaml")})
    (tmp_path / "bad.yaml").write_text("roles: [unclosed\n")
    with pytest.raises(ImproperlyConfigured, match="LLMGW_OIDC_MAPPING_FILE=.*not valid YAML"):
        load_role_map({"LLMGW_OIDC_MAPPING_FILE": str(tmp_path / "bad.yaml")})
    with pytest.raises(ImproperlyConfigured, match="both set"):
        load_role_map({"LLMGW_OIDC_ROLE_MAP": "{}", "LLMGW_OIDC_MAPPING_FILE": str(tmp_path / "bad.yaml")})


def test_a_malformed_mapping_stops_start_up(tmp_path: Path) -> None:
    env = {**os.environ, "LLMGW_DATA_DIR": str(tmp_path), "LLMGW_OIDC_ROLE_MAP": '{"roles": {"ops": "root"}}'}
    result = subprocess.run(
        [sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured: LLMGW_OIDC_ROLE_MAP: roles.ops: expected one of" in result.stderr


def test_claims_give_a_lower_case_email_a_name_and_groups() -> None:
    identity = identity_from_claims(
        {
            "email": " Ada@Example.COM ",
            "given_name": "Ada",
            "family_name": "Lovelace",
            "roles": ["llm-ops", "x"],
            "email_verified": "false",
        },
        groups_claim="roles",
    )
    assert identity.email == "ada@example.com"
    assert identity.name == "Ada Lovelace"
    assert identity.groups == {"llm-ops", "x"}
    assert identity.email_verified is False
    bare = identity_from_claims({"email": "a@example.com", "name": "A"})
    assert bare.groups is None and bare.email_verified is None


# The account service -----------------------------------------------------------------------------


@pytest.fixture
def tree(db: Any) -> dict[str, Any]:
    # A standing administrator: the provider may demote anyone, but never the last administrator.
    User.objects.create_superuser("root@example.com", "a long password 1")
    acme = services.create_organization(name="Acme", slug="acme", actor=None)
    return {
        "acme": acme,
        "vision": services.create_team(acme, name="Vision", slug="vision", actor=None),
        "research": services.create_team(acme, name="Research", slug="research", actor=None),
    }


def places(user: User) -> dict[str, tuple[str, bool]]:
    """{"acme/vision": ("member", from_sso)} for each of the person's memberships."""
    found = {}
    for m in Membership.objects.filter(user=user).select_related("organization", "team", "project"):
        label = "/".join(
            part
            for part in (m.organization.slug, m.team.slug if m.team else "", m.project.slug if m.project else "")
            if part
        )
        found[label] = (m.role, m.from_sso)
    return found


def sync(user: User | None, **claims: Any) -> User:
    identity = identity_from_claims({"email": "ada@example.com", "name": "Ada", **claims})
    return oidc.sync_sso_account(user, identity, role_map=role_map(), address="192.0.2.1")


def test_a_first_sign_in_creates_the_account_with_role_and_memberships(tree: dict[str, Any]) -> None:
    user = sync(None, groups=["llm-ops", "vision-team", "vision-leads", "unmapped"])
    assert (user.email, user.name, user.staff_role, user.is_staff) == ("ada@example.com", "Ada", "operator", False)
    assert not user.has_usable_password()
    assert places(user) == {"acme/vision": ("manager", True)}
    event = AuditEvent.objects.get(action="user.sso_create")
    assert event.actor == user and event.address == "192.0.2.1"
    assert event.changes == {
        "email": "ada@example.com",
        "name": "Ada",
        "staff_role": "operator",
        "memberships_added": ["acme/vision: manager"],
    }


def test_later_sign_ins_follow_the_groups_and_leave_hand_made_memberships(tree: dict[str, Any]) -> None:
    user = sync(None, groups=["llm-admins", "vision-team", "acme-all"])
    assert user.is_staff and user.staff_role == "admin"
    Membership.objects.create(user=user, organization=tree["acme"], team=tree["research"], role="manager")

    user = sync(user, name="Ada L.", groups=["llm-viewers", "vision-leads", "research-team"])
    assert (user.name, user.staff_role, user.is_staff) == ("Ada L.", "viewer", False)
    # Re-roled, removed, and the hand-made research membership untouched (still a manager, not from sso).
    assert places(user) == {"acme/vision": ("manager", True), "acme/research": ("manager", False)}
    event = AuditEvent.objects.get(action="user.sso_update")
    assert event.changes == {
        "name": ["Ada", "Ada L."],
        "staff_role": ["admin", "viewer"],
        "is_staff": [True, False],
        "memberships_changed": ["acme/vision: member -> manager"],
        "memberships_removed": ["acme: member"],
    }

    user = sync(user, name="Ada L.", groups=[])
    assert user.staff_role == "" and places(user) == {"acme/research": ("manager", False)}


def test_a_sign_in_that_changes_nothing_writes_no_event(tree: dict[str, Any]) -> None:
    user = sync(None, groups=["llm-ops", "vision-team"])
    sync(user, groups=["vision-team", "llm-ops"])
    assert not AuditEvent.objects.filter(action="user.sso_update").exists()


def test_without_a_groups_claim_role_and_memberships_stay(tree: dict[str, Any]) -> None:
    user = sync(None, groups=["llm-admins", "vision-team"])
    user = sync(user)
    assert user.staff_role == "admin" and places(user) == {"acme/vision": ("member", True)}


def test_a_mapping_without_roles_leaves_the_staff_role_alone(tree: dict[str, Any]) -> None:
    user = make_user("ada@example.com", role=StaffRole.BILLING, name="Ada")
    identity = identity_from_claims({"email": "ADA@example.com", "groups": ["vision-team"]})
    oidc.sync_sso_account(
        user, identity, role_map=parse_role_map({"memberships": MAPPING["memberships"]}, source="test")
    )
    user.refresh_from_db()
    assert (user.staff_role, user.name) == ("billing", "Ada")
    assert places(user) == {"acme/vision": ("member", True)}


def test_a_mapped_place_that_does_not_exist_is_skipped(db: Any) -> None:
    user = sync(None, groups=["vision-team", "llm-ops"])
    assert user.staff_role == "operator" and places(user) == {}


# Views, with the provider's answers made here ----------------------------------------------------

ISSUER = "https://idp.example"


@pytest.fixture
def signing_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def sso(settings: Any, signing_key: rsa.RSAPrivateKey) -> Any:
    """Single sign-on on, with endpoints named (no discovery) and the ID token key given."""
    settings.OIDC_ISSUER = ISSUER
    settings.OIDC_PROVIDER_NAME = "Example ID"
    settings.OIDC_RP_CLIENT_ID = "llmgw"
    settings.OIDC_RP_CLIENT_SECRET = "s3cret"
    settings.OIDC_OP_AUTHORIZATION_ENDPOINT = f"{ISSUER}/authorize"
    settings.OIDC_OP_TOKEN_ENDPOINT = f"{ISSUER}/token"
    settings.OIDC_OP_USER_ENDPOINT = f"{ISSUER}/userinfo"
    settings.OIDC_OP_JWKS_ENDPOINT = f"{ISSUER}/jwks"
    settings.OIDC_RP_IDP_SIGN_KEY = (
        signing_key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    settings.OIDC_ROLE_MAP = role_map()
    oidc.forget_discovery()
    yield settings
    oidc.forget_discovery()


@dataclass
class Provider:
    """What the mocked provider answers: its userinfo claims, and the ID token's nonce and issuer."""

    claims: dict[str, Any]
    nonce: str | None = None  # None: the one llmgw sent
    issuer: str = ISSUER


@pytest.fixture
def provider(monkeypatch: pytest.MonkeyPatch, signing_key: rsa.RSAPrivateKey) -> Provider:
    answer = Provider(
        claims={"email": "ada@example.com", "email_verified": True, "name": "Ada", "groups": ["llm-ops", "vision-team"]}
    )

    def get_token(backend: Any, payload: dict[str, Any]) -> dict[str, str]:
        sent = backend.request.session["oidc_sent"][backend.request.GET["state"]]["nonce"]
        claims = {
            "iss": answer.issuer,
            "aud": "llmgw",
            "sub": "ada",
            "exp": int(time.time()) + 60,
            "nonce": answer.nonce if answer.nonce is not None else sent,
        }
        return {"id_token": jwt.encode(claims, signing_key, algorithm="RS256"), "access_token": "at"}

    monkeypatch.setattr(oidc.SsoBackend, "get_token", get_token)
    monkeypatch.setattr(oidc.SsoBackend, "get_userinfo", lambda backend, *args: answer.claims)
    return answer


def start(client: Client) -> str:
    """Begin a sign-in; returns the state llmgw sent to the provider."""
    response = client.get("/oidc/authenticate/")
    assert response.status_code == 302 and response["Location"].startswith(f"{ISSUER}/authorize?")
    query = parse_qs(urlsplit(response["Location"]).query)
    assert query["code_challenge_method"] == ["S256"] and query["scope"] == ["openid email profile groups"]
    # The mocked token endpoint reads the nonce from here, as the provider would remember it.
    session = client.session
    session["oidc_sent"] = dict(session["oidc_states"])
    session.save()
    return query["state"][0]


def reason(response: Any) -> str:
    found = re.search(r'role="alert">([^<]+)<', response.content.decode())
    assert found is not None, response.content.decode()[:500]
    return found.group(1).strip()


def test_the_sign_in_page_offers_the_provider(client: Client, sso: Any) -> None:
    page = client.get("/login/?next=/nodes/").content.decode()
    assert 'href="/oidc/authenticate/?next=/nodes/"' in page and "Sign in with Example ID" in page
    assert 'name="password"' in page


def test_without_an_issuer_there_is_no_single_sign_on(client: Client, db: Any) -> None:
    assert "oidc/authenticate" not in client.get("/login/").content.decode()
    assert client.get("/oidc/authenticate/").status_code == 404
    assert client.get("/oidc/callback/?code=x&state=y").status_code == 404


def test_a_good_answer_signs_in_and_maps_groups(
    client: Client, sso: Any, provider: Provider, tree: dict[str, Any]
) -> None:
    state = start(client)
    response = client.get(f"/oidc/callback/?code=abc&state={state}")
    assert response.status_code == 302 and response["Location"] == "/"
    user = User.objects.get(email="ada@example.com")
    assert client.session["_auth_user_id"] == str(user.pk)
    assert client.session["_auth_user_backend"] == "apps.accounts.oidc.SsoBackend"
    assert user.staff_role == "operator" and places(user) == {"acme/vision": ("member", True)}
    assert client.get("/").status_code == 200


def test_an_existing_account_is_matched_by_email_in_any_case(
    client: Client, sso: Any, provider: Provider, db: Any
) -> None:
    bob = make_user("bob@example.com", name="Bob")
    provider.claims = {"email": "BOB@Example.com", "email_verified": True, "groups": ["llm-admins"]}
    client.get(f"/oidc/callback/?code=abc&state={start(client)}")
    bob.refresh_from_db()
    assert client.session["_auth_user_id"] == str(bob.pk)
    assert (bob.staff_role, bob.is_staff, bob.name) == ("admin", True, "Bob")
    assert User.objects.count() == 1


@pytest.mark.parametrize(
    ("claims", "nonce", "issuer", "expected"),
    [
        (
            {"email": "ada@example.com", "email_verified": False},
            None,
            ISSUER,
            "the provider has not verified your email address.",
        ),
        ({"name": "No Email"}, None, ISSUER, "the provider did not say what your email address is."),
        ({"email": "ada@example.com"}, "not-the-one-sent", ISSUER, "(bad nonce)"),
        ({"email": "ada@example.com"}, None, "https://evil.example", "identity token could not be verified"),
    ],
)
def test_a_refused_answer_ends_on_the_reason_page(
    client: Client, sso: Any, provider: Provider, db: Any, claims: Any, nonce: str | None, issuer: str, expected: str
) -> None:
    provider.claims, provider.nonce, provider.issuer = claims, nonce, issuer
    response = client.get(f"/oidc/callback/?code=abc&state={start(client)}", follow=True)
    assert response.redirect_chain == [("/oidc/failed/", 302)]
    assert response.status_code == 200
    assert reason(response).startswith("Sign-in failed: ") and expected in reason(response)
    assert "_auth_user_id" not in client.session
    assert not User.objects.exists()


def test_a_suspended_account_is_refused(client: Client, sso: Any, provider: Provider, db: Any) -> None:
    make_user("ada@example.com", is_active=False)
    response = client.get(f"/oidc/callback/?code=abc&state={start(client)}", follow=True)
    assert reason(response) == "Sign-in failed: this account is suspended."


def test_a_bad_state_or_no_sign_in_at_all_ends_on_the_reason_page(client: Client, sso: Any, db: Any) -> None:
    response = client.get("/oidc/callback/?code=abc&state=forged", follow=True)
    assert "no sign-in was in progress" in reason(response)
    start(client)
    response = client.get("/oidc/callback/?code=abc&state=forged", follow=True)
    assert response.status_code == 200 and "(bad state)" in reason(response)


def test_the_providers_own_error_is_shown(client: Client, sso: Any, db: Any) -> None:
    state = start(client)
    response = client.get(
        f"/oidc/callback/?error=access_denied&error_description=End-User+aborted&state={state}", follow=True
    )
    assert reason(response) == "Sign-in failed: the provider answered “End-User aborted”."
    assert state not in client.session["oidc_states"]


def test_a_provider_that_refuses_the_code_or_cannot_be_reached(
    client: Client, sso: Any, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(backend: Any, payload: Any) -> None:
        response = requests.Response()
        response.status_code = 400
        raise requests.HTTPError("invalid_grant", response=response)

    monkeypatch.setattr(oidc.SsoBackend, "get_token", refuse)
    response = client.get(f"/oidc/callback/?code=abc&state={start(client)}", follow=True)
    assert "did not accept the sign-in code" in reason(response)

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise requests.ConnectionError("refused")

    monkeypatch.setattr(oidc.SsoBackend, "get_token", unreachable)
    response = client.get(f"/oidc/callback/?code=abc&state={start(client)}", follow=True)
    assert "could not be reached" in reason(response)


# Discovery and signing out -----------------------------------------------------------------------


class FakeResponse:
    def __init__(self, body: Any, status: int = 200) -> None:
        self.body, self.status_code = body, status

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise requests.HTTPError(str(self.status_code))

    def json(self) -> Any:
        return self.body


METADATA = {
    "issuer": ISSUER,
    "authorization_endpoint": f"{ISSUER}/auth",
    "token_endpoint": f"{ISSUER}/token",
    "userinfo_endpoint": f"{ISSUER}/me",
    "jwks_uri": f"{ISSUER}/jwks",
    "end_session_endpoint": f"{ISSUER}/end",
}


@pytest.fixture
def discovered(settings: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Single sign-on on with every endpoint from a (mocked) discovery document; lists the fetches."""
    fetched: list[str] = []

    def get(url: str, **kwargs: Any) -> FakeResponse:
        fetched.append(url)
        return FakeResponse(METADATA)

    settings.OIDC_ISSUER = ISSUER
    settings.OIDC_RP_CLIENT_ID = "llmgw"
    monkeypatch.setattr(oidc.requests, "get", get)
    oidc.forget_discovery()
    yield fetched
    oidc.forget_discovery()


def test_discovery_fills_the_endpoints_once(discovered: list[str]) -> None:
    assert oidc.oidc_setting("OIDC_OP_AUTHORIZATION_ENDPOINT") == f"{ISSUER}/auth"
    assert oidc.oidc_setting("OIDC_OP_USER_ENDPOINT") == f"{ISSUER}/me"
    assert oidc.oidc_setting("OIDC_OP_JWKS_ENDPOINT") == f"{ISSUER}/jwks"
    assert discovered == [f"{ISSUER}/.well-known/openid-configuration"]


def test_discovery_refuses_a_document_for_another_issuer(monkeypatch: pytest.MonkeyPatch) -> None:
    oidc.forget_discovery()
    monkeypatch.setattr(oidc.requests, "get", lambda url, **kw: FakeResponse({**METADATA, "issuer": "https://x"}))
    with pytest.raises(oidc.DiscoveryError, match="names the issuer 'https://x'"):
        oidc.discover(ISSUER)
    monkeypatch.setattr(oidc.requests, "get", lambda url, **kw: FakeResponse({}, status=503))
    with pytest.raises(oidc.DiscoveryError, match="503"):
        oidc.discover(ISSUER)


def test_an_unreachable_provider_ends_on_the_reason_page(
    client: Client, settings: Any, db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(url: str, **kwargs: Any) -> None:
        raise requests.ConnectionError("connection refused")

    settings.OIDC_ISSUER = ISSUER
    oidc.forget_discovery()
    monkeypatch.setattr(oidc.requests, "get", down)
    response = client.get("/oidc/authenticate/", follow=True)
    assert reason(response) == "Sign-in failed: the provider could not be reached."


def test_signing_out_ends_the_provider_session_too(client: Client, discovered: list[str], bob: User) -> None:
    client.force_login(bob)
    session = client.session
    session["oidc_id_token"] = "the.id.token"
    session.save()
    response = client.post("/logout/")
    assert response.status_code == 302
    location = urlsplit(response["Location"])
    assert f"{location.scheme}://{location.netloc}{location.path}" == f"{ISSUER}/end"
    assert parse_qs(location.query) == {
        "id_token_hint": ["the.id.token"],
        "client_id": ["llmgw"],
        "post_logout_redirect_uri": ["http://testserver/login/"],
    }
    assert "_auth_user_id" not in client.session


def test_signing_out_a_password_session_stays_here(client: Client, discovered: list[str], bob: User) -> None:
    client.force_login(bob)
    response = client.post("/logout/")
    assert (response.status_code, response["Location"]) == (302, "/login/")
    assert client.get("/logout/").status_code == 405
    assert discovered == []


# Password sign-in turned off ---------------------------------------------------------------------


def test_with_local_sign_in_off_passwords_are_refused_everywhere(client: Client, sso: Any, bob: User) -> None:
    sso.LOCAL_SIGNIN = False
    page = client.get("/login/").content.decode()
    assert 'name="password"' not in page and "Sign in with Example ID" in page
    response = client.post("/login/", {"username": "bob@example.com", "password": "correct horse battery"})
    assert "_auth_user_id" not in client.session
    assert "data-password-refused" in response.content.decode()
    assert "Signing in with a password is turned off here." in response.content.decode()
    assert not client.login(username="bob@example.com", password="correct horse battery")
    client.post("/django-admin/login/", {"username": "bob@example.com", "password": "correct horse battery"})
    assert "_auth_user_id" not in client.session

    sso.LOCAL_SIGNIN = True
    assert client.login(username="bob@example.com", password="correct horse battery")


# End to end, against a real OpenID provider -------------------------------------------------------

CLIENT_ID = "llmgw-test"
CLIENT_SECRET = "a-client-secret-only-for-tests"
ACCOUNTS: dict[str, dict[str, Any]] = {
    "ada": {
        "email": "Ada@Example.com",
        "email_verified": True,
        "name": "Ada Lovelace",
        "groups": ["llm-admins", "vision-team", "research-team"],
    },
    "grace": {
        "email": "grace@example.com",
        "email_verified": True,
        "name": "Grace Hopper",
        "groups": ["llm-viewers", "llm-ops"],
    },
    "eve": {"email": "eve@example.com", "email_verified": False, "name": "Eve", "groups": ["llm-admins"]},
}


def _pinned_version() -> str:
    return str(json.loads((PROVIDER_DIR / "package.json").read_text())["dependencies"]["oidc-provider"])


@pytest.fixture(scope="session")
def node_provider() -> str:
    """The path to node, with tests/oidc_provider/node_modules installed (npm ci, once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if not node or not npm:
        pytest.skip("the single sign-on end-to-end tests need Node.js and npm, which are not on PATH")
    installed = PROVIDER_DIR / "node_modules" / "oidc-provider" / "package.json"
    if not installed.exists() or json.loads(installed.read_text())["version"] != _pinned_version():
        try:
            result = subprocess.run(
                [npm, "ci", "--no-audit", "--no-fund"], cwd=PROVIDER_DIR, capture_output=True, text=True, timeout=600
            )
        except subprocess.TimeoutExpired:
            pytest.skip("npm ci for tests/oidc_provider took more than 10 minutes")
        if result.returncode != 0:
            pytest.skip(f"npm ci for tests/oidc_provider failed (no npm registry?): {result.stderr[-500:]}")
    return node


@dataclass
class RunningProvider:
    issuer: str
    accounts_file: Path
    log: Path

    def set_accounts(self, accounts: dict[str, dict[str, Any]]) -> None:
        self.accounts_file.write_text(json.dumps(accounts))


START_WAIT = 90


@pytest.fixture(scope="session")
def real_provider(
    node_provider: str,
    live_server: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningProvider]:
    """panva's oidc-provider on 127.0.0.1, with llmgw's live server as its one client."""
    folder = tmp_path_factory.mktemp("oidc-provider")
    accounts, log = folder / "accounts.json", folder / "provider.log"
    accounts.write_text(json.dumps(ACCOUNTS))
    env = {
        **os.environ,
        "OIDC_CLIENT_ID": CLIENT_ID,
        "OIDC_CLIENT_SECRET": CLIENT_SECRET,
        "OIDC_REDIRECT_URI": f"{live_server.url}/oidc/callback/",
        "OIDC_POST_LOGOUT_REDIRECT_URI": f"{live_server.url}/login/",
        "OIDC_ACCOUNTS_FILE": str(accounts),
    }
    with log.open("w") as out:
        process = subprocess.Popen(
            [node_provider, "server.mjs"], cwd=PROVIDER_DIR, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        # Generous: on a busy 2-core machine, Node loading oidc-provider can take its time.
        deadline = time.monotonic() + START_WAIT
        while not (found := re.search(r"^READY (\S+)$", log.read_text(), re.MULTILINE)):
            code = process.poll()
            if code is not None or time.monotonic() > deadline:
                how = f"it exited with {code}" if code is not None else f"not ready after {START_WAIT} s"
                pytest.fail(f"the OpenID provider did not start ({how}):\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield RunningProvider(issuer=found.group(1), accounts_file=accounts, log=log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def e2e(
    real_provider: RunningProvider,
    live_server: Any,
    settings: Any,
    tree: dict[str, Any],
) -> Iterator[tuple[str, RunningProvider]]:
    """llmgw (live server) pointed at the real provider, which has the starting accounts."""
    real_provider.set_accounts(ACCOUNTS)
    settings.OIDC_ISSUER = real_provider.issuer
    settings.OIDC_PROVIDER_NAME = "Test provider"
    settings.OIDC_RP_CLIENT_ID = CLIENT_ID
    settings.OIDC_RP_CLIENT_SECRET = CLIENT_SECRET
    settings.OIDC_ROLE_MAP = role_map()
    settings.LOCAL_SIGNIN = True
    oidc.forget_discovery()
    yield live_server.url, real_provider
    oidc.forget_discovery()


class Forms(HTMLParser):
    """Each form of a page: its action, method and the fields a browser would send (first named button pressed)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.forms: list[dict[str, Any]] = []
        self._by_id: dict[str, dict[str, Any]] = {}
        self._current: dict[str, Any] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {name: value or "" for name, value in attrs}
        if tag == "form":
            self._current = {
                "action": values.get("action", ""),
                "method": values.get("method", "get").lower(),
                "fields": {},
                "button": None,
            }
            self.forms.append(self._current)
            if values.get("id"):
                self._by_id[values["id"]] = self._current
            return
        owner = self._by_id.get(values["form"]) if values.get("form") else self._current
        if owner is None or not values.get("name"):
            return
        if tag == "input":
            owner["fields"][values["name"]] = values.get("value", "")
        elif tag == "button" and owner["button"] is None:
            owner["button"] = (values["name"], values.get("value", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self._current = None


def submit(http: requests.Session, page: requests.Response, **values: str) -> requests.Response:
    parser = Forms()
    parser.feed(page.text)
    form = next((f for f in parser.forms if f["method"] == "post"), None)
    assert form is not None, f"no form on {page.url}:\n{page.text[:2000]}"
    fields = dict(form["fields"])
    if form["button"] is not None:
        fields.setdefault(*form["button"])
    fields.update({name: value for name, value in values.items() if name in fields})
    return http.post(urljoin(page.url, form["action"]), data=fields, timeout=30)


def sign_in_through_provider(
    http: requests.Session, base: str, provider: RunningProvider, login: str, prompts: list[str] | None = None
) -> requests.Response:
    """GET /oidc/authenticate/, then the provider's login and consent forms, until back at llmgw.

    The provider's prompts ("login", "consent") are added to `prompts`.
    """
    response = http.get(f"{base}/oidc/authenticate/", timeout=30)
    for _ in range(4):
        if not response.url.startswith(provider.issuer):
            return response
        assert response.status_code == 200, f"{response.url}: {response.status_code}\n{response.text[:2000]}"
        prompt = re.search(r'name="prompt" value="(\w+)"', response.text)
        if prompts is not None and prompt:
            prompts.append(prompt.group(1))
        response = submit(http, response, login=login, password="any password")
    raise AssertionError(f"still at the provider after four forms: {response.url}\n{provider.log.read_text()}")


def sign_out(http: requests.Session, base: str, provider: RunningProvider) -> requests.Response:
    page = http.get(f"{base}/", timeout=30)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None
    response = http.post(f"{base}/logout/", data={"csrfmiddlewaretoken": token.group(1)}, timeout=30)
    # The provider asks whether to sign out there too.
    assert response.url.startswith(provider.issuer), response.url
    return submit(http, response)


def signed_in(http: requests.Session, base: str) -> bool:
    return http.get(f"{base}/", allow_redirects=False, timeout=30).status_code == 200


@pytest.mark.e2e
def test_sign_in_through_a_real_provider_maps_groups_and_follows_their_changes(
    e2e: tuple[str, RunningProvider], tree: dict[str, Any]
) -> None:
    base, provider = e2e
    http = requests.Session()

    # 1. First sign-in: the account is made with the mapped role and memberships.
    prompts: list[str] = []
    landing = sign_in_through_provider(http, base, provider, "ada", prompts)
    assert landing.status_code == 200 and landing.url == f"{base}/", landing.url
    assert prompts == ["login", "consent"]
    assert "ada@example.com" in landing.text
    ada = User.objects.get(email="ada@example.com")
    assert (ada.name, ada.staff_role, ada.is_staff) == ("Ada Lovelace", "admin", True)
    assert places(ada) == {"acme/vision": ("member", True), "acme/research": ("member", True)}
    assert AuditEvent.objects.filter(action="user.sso_create", actor=ada).count() == 1
    # Someone adds Ada to the research team's organisation by hand.
    Membership.objects.create(user=ada, organization=tree["acme"], role="manager")

    # 2. Signing out ends both sessions: back on the sign-in page, and the provider asks again.
    back = sign_out(http, base, provider)
    assert back.url == f"{base}/login/" and not signed_in(http, base)

    # 3. The provider moves Ada out of the admins and the vision team.
    provider.set_accounts({**ACCOUNTS, "ada": {**ACCOUNTS["ada"], "groups": ["llm-ops", "research-team"]}})
    prompts = []
    landing = sign_in_through_provider(http, base, provider, "ada", prompts)
    assert landing.url == f"{base}/" and signed_in(http, base)
    assert prompts[:1] == ["login"]  # the provider's session ended with llmgw's
    ada.refresh_from_db()
    assert (ada.staff_role, ada.is_staff) == ("operator", False)
    assert places(ada) == {"acme/research": ("member", True), "acme": ("manager", False)}
    update = AuditEvent.objects.get(action="user.sso_update", actor=ada)
    assert update.changes["staff_role"] == ["admin", "operator"]
    assert update.changes["memberships_removed"] == ["acme/vision: member"]
    assert User.objects.filter(email__iexact="ada@example.com").count() == 1

    # 4. Another person: the highest of their roles wins.
    other = requests.Session()
    sign_in_through_provider(other, base, provider, "grace")
    assert User.objects.get(email="grace@example.com").staff_role == "operator"


@pytest.mark.e2e
def test_a_real_provider_with_an_unverified_email_is_refused(e2e: tuple[str, RunningProvider]) -> None:
    base, provider = e2e
    http = requests.Session()
    page = sign_in_through_provider(http, base, provider, "eve")
    assert page.url == f"{base}/oidc/failed/"
    assert "Sign-in failed: the provider has not verified your email address." in page.text
    assert not User.objects.filter(email="eve@example.com").exists() and not signed_in(http, base)


@pytest.mark.e2e
def test_a_callback_with_a_bad_state_shows_the_reason(e2e: tuple[str, RunningProvider]) -> None:
    base, _provider = e2e
    http = requests.Session()
    started = http.get(f"{base}/oidc/authenticate/", allow_redirects=False, timeout=30)
    assert started.status_code == 302
    page = http.get(f"{base}/oidc/callback/?code=stolen&state=forged", timeout=30)
    assert (page.status_code, page.url) == (200, f"{base}/oidc/failed/")
    assert "Sign-in failed:" in page.text and "(bad state)" in page.text


@pytest.mark.e2e
def test_a_real_deployment_with_local_sign_in_off_refuses_the_password_form(
    e2e: tuple[str, RunningProvider], settings: Any
) -> None:
    base, provider = e2e
    make_user("bob@example.com", name="Bob")
    settings.LOCAL_SIGNIN = False
    http = requests.Session()
    page = http.get(f"{base}/login/", timeout=30)
    assert 'name="password"' not in page.text and "Sign in with Test provider" in page.text
    refused = http.post(
        f"{base}/login/",
        data={
            "username": "bob@example.com",
            "password": "correct horse battery",
            "csrfmiddlewaretoken": http.cookies["csrftoken"],
        },
        timeout=30,
    )
    assert refused.status_code == 200 and "Signing in with a password is turned off here." in refused.text
    assert not signed_in(http, base)
    # Single sign-on still works.
    assert sign_in_through_provider(http, base, provider, "grace").url == f"{base}/"


def test_the_provider_cannot_demote_the_last_administrator(db: Any) -> None:
    user = sync(None, groups=["llm-admins"])
    assert user.staff_role == "admin"
    user = sync(user, groups=["llm-viewers"])
    assert user.staff_role == "admin" and user.is_staff  # kept, and the refusal is logged
