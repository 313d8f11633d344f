"""Single sign-on through OpenID Connect, on mozilla-django-oidc.

The provider is found by discovery: LLMGW_OIDC_ISSUER names it, and the endpoints come from
<issuer>/.well-known/openid-configuration, fetched on first use and kept for the life of the
process (discover()). mozilla-django-oidc reads its settings at request time through each
class's get_settings(); here that is oidc_setting(), which answers the endpoint settings from
discovery unless settings name them explicitly.

A sign-in that fails (a bad state or nonce, a provider that refuses or cannot be reached, an
unverified email address) ends on a page that says why, never on a 500 or a silent redirect:
the reason travels in the session to sign_in_failed().

Who a person is here follows the provider's claims: sync_sso_account() creates or updates the
account, sets the staff role from the groups through settings.OIDC_ROLE_MAP, and adds or
removes the memberships that mapping manages (Membership.from_sso), in one transaction with
an audit event.
"""

from __future__ import annotations

import logging
import threading
from typing import Any
from urllib.parse import urlencode

import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.backends import ModelBackend
from django.core.exceptions import PermissionDenied, SuspiciousOperation, ValidationError
from django.db import IntegrityError, transaction
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from django.utils.decorators import method_decorator
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from django.views.generic import View
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import (
    OIDCAuthenticationCallbackView,
    OIDCAuthenticationRequestView,
    OIDCLogoutView,
)

from apps.accounts import audit, services
from apps.accounts.models import Membership, Organization, Project, Team, User
from apps.accounts.sso_mapping import MembershipTarget, RoleMap, SsoIdentity, identity_from_claims
from llmgw.http import client_address

__all__ = [
    "DiscoveryError",
    "LocalSignInGate",
    "SsoAuthenticateView",
    "SsoBackend",
    "SsoCallbackView",
    "SsoLogoutView",
    "discover",
    "failure_reason",
    "forget_discovery",
    "oidc_setting",
    "provider_logout_url",
    "provider_name",
    "sign_in_failed",
    "sign_in_options",
    "sso_enabled",
    "sync_sso_account",
]

logger = logging.getLogger(__name__)

# Where a failed sign-in leaves its reason for sign_in_failed(): [code, detail].
FAILURE_SESSION_KEY = "llmgw_sso_failure"


def sso_enabled() -> bool:
    return bool(getattr(settings, "OIDC_ISSUER", ""))


def provider_name() -> str:
    return str(getattr(settings, "OIDC_PROVIDER_NAME", "") or _("single sign-on"))


# Discovery -------------------------------------------------------------------------------


class DiscoveryError(Exception):
    """The provider's discovery document could not be fetched or does not describe it."""


_discovered: dict[str, dict[str, Any]] = {}
_discovered_lock = threading.Lock()

# mozilla-django-oidc's setting -> the discovery document's key.
_DISCOVERED_SETTINGS = {
    "OIDC_OP_AUTHORIZATION_ENDPOINT": "authorization_endpoint",
    "OIDC_OP_TOKEN_ENDPOINT": "token_endpoint",
    "OIDC_OP_USER_ENDPOINT": "userinfo_endpoint",
    "OIDC_OP_JWKS_ENDPOINT": "jwks_uri",
}


def discover(issuer: str) -> dict[str, Any]:
    """The provider's metadata from <issuer>/.well-known/openid-configuration, fetched once per process.

    A failed fetch is not kept, so the next sign-in tries again. The document must name the
    same issuer (OpenID Connect Discovery 1.0, section 4.3) and the four endpoints llmgw uses.
    """
    issuer = issuer.rstrip("/")
    if not issuer:
        raise DiscoveryError("single sign-on is not configured (LLMGW_OIDC_ISSUER is empty)")
    with _discovered_lock:
        cached = _discovered.get(issuer)
    if cached is not None:
        return cached
    url = f"{issuer}/.well-known/openid-configuration"
    try:
        response = requests.get(
            url,
            timeout=import_from_settings("OIDC_TIMEOUT", 10),
            verify=import_from_settings("OIDC_VERIFY_SSL", True),
            proxies=import_from_settings("OIDC_PROXY", None),
        )
        response.raise_for_status()
        metadata = response.json()
    except (requests.RequestException, ValueError) as exc:
        raise DiscoveryError(f"{url}: {exc}") from exc
    if not isinstance(metadata, dict):
        raise DiscoveryError(f"{url}: expected a JSON object")
    if str(metadata.get("issuer", "")).rstrip("/") != issuer:
        raise DiscoveryError(f"{url}: names the issuer {metadata.get('issuer')!r}, expected {issuer!r}")
    missing = [key for key in _DISCOVERED_SETTINGS.values() if not metadata.get(key)]
    if missing:
        raise DiscoveryError(f"{url}: no {', '.join(missing)}")
    with _discovered_lock:
        _discovered[issuer] = metadata
    return metadata


def forget_discovery() -> None:
    """Drop the fetched discovery documents (tests, or after the provider moved)."""
    with _discovered_lock:
        _discovered.clear()


def oidc_setting(name: str, *default: Any) -> Any:
    """mozilla-django-oidc's settings, with the provider's endpoints from discovery unless set explicitly."""
    if name in _DISCOVERED_SETTINGS and not getattr(settings, name, None):
        return discover(settings.OIDC_ISSUER)[_DISCOVERED_SETTINGS[name]]
    return import_from_settings(name, *default)


# Reasons ---------------------------------------------------------------------------------


def failure_reason(code: str, detail: str = "") -> str:
    """The sentence that completes "Sign-in failed: …" for a failure code."""
    if code == "provider":
        return _("the provider answered “{error}”.").format(error=detail)
    reasons = {
        "state": _("this answer does not belong to a sign-in started in this browser (bad state). Start again."),
        "no_session": _("no sign-in was in progress in this browser, or it took too long. Start again."),
        "nonce": _("the provider's answer does not belong to this sign-in (bad nonce)."),
        "invalid_token": _("the provider's identity token could not be verified."),
        "token": _("the provider did not accept the sign-in code."),
        "unavailable": _("the provider could not be reached."),
        "no_email": _("the provider did not say what your email address is."),
        "email_unverified": _("the provider has not verified your email address."),
        "inactive": _("this account is suspended."),
        "ambiguous": _("more than one account has your email address."),
    }
    return reasons.get(code, _("the provider did not confirm who you are."))


def _remember_failure(request: HttpRequest, code: str, detail: str = "") -> None:
    # The first reason found is the one shown: later steps fail because of it.
    if FAILURE_SESSION_KEY not in request.session:
        request.session[FAILURE_SESSION_KEY] = [code, detail[:300]]


# The account: one service ----------------------------------------------------------------


def _resolve_targets(
    wanted: dict[MembershipTarget, str],
) -> dict[MembershipTarget, tuple[Organization, Team | None, Project | None]]:
    """The tree's rows for each target, in three queries. A target that names no row is logged and left out."""
    orgs = {org.slug: org for org in Organization.objects.filter(slug__in={t.organization for t in wanted})}
    teams = {
        (team.organization_id, team.slug): team
        for team in Team.objects.filter(organization__in=orgs.values(), slug__in={t.team for t in wanted if t.team})
    }
    projects = {
        (project.team_id, project.slug): project
        for project in Project.objects.filter(
            team__in=teams.values(), slug__in={t.project for t in wanted if t.project}
        )
    }
    places: dict[MembershipTarget, tuple[Organization, Team | None, Project | None]] = {}
    for target in wanted:
        org = orgs.get(target.organization)
        team = teams.get((org.pk, target.team)) if org is not None and target.team else None
        project = projects.get((team.pk, target.project)) if team is not None and target.project else None
        if org is None or (target.team and team is None) or (target.project and project is None):
            logger.warning("single sign-on mapping names %s, which does not exist; skipped", target.label())
            continue
        places[target] = (org, team, project)
    return places


def _membership_label(membership: Membership) -> str:
    parts = [
        membership.organization.slug,
        membership.team.slug if membership.team else "",
        membership.project.slug if membership.project else "",
    ]
    return "/".join(part for part in parts if part) + f": {membership.role}"


@transaction.atomic(savepoint=False)
def _sync_memberships(user: User, wanted: dict[MembershipTarget, str]) -> dict[str, list[str]]:
    """Make the memberships marked from_sso match `wanted`; hand-made ones are neither changed nor removed."""
    existing = {
        (m.organization_id, m.team_id, m.project_id): m
        for m in Membership.objects.filter(user=user).select_related("organization", "team", "project")
    }
    added: list[str] = []
    changed: list[str] = []
    removed: list[str] = []
    kept: set[tuple[int, int | None, int | None]] = set()
    for target, (org, team, project) in sorted(_resolve_targets(wanted).items()):
        role = wanted[target]
        key = (org.pk, team.pk if team else None, project.pk if project else None)
        kept.add(key)
        membership = existing.get(key)
        if membership is None:
            membership = Membership.objects.create(
                user=user, organization=org, team=team, project=project, role=role, from_sso=True
            )
            added.append(_membership_label(membership))
        elif membership.from_sso and membership.role != role:
            before = _membership_label(membership)
            membership.role = role
            membership.save(update_fields=["role"])
            changed.append(f"{before} -> {role}")
    for key, membership in sorted(existing.items(), key=lambda item: _membership_label(item[1])):
        if membership.from_sso and key not in kept:
            removed.append(_membership_label(membership))
            membership.delete()
    changes = {"memberships_added": added, "memberships_changed": changed, "memberships_removed": removed}
    return {name: labels for name, labels in changes.items() if labels}


@transaction.atomic
def sync_sso_account(
    user: User | None, identity: SsoIdentity, *, role_map: RoleMap, address: str | None = None
) -> User:
    """Create or update the account a provider vouched for, with its staff role and managed memberships.

    1. Create the account (no usable password), or update its email address and name; a
       provider that sends no name keeps the name the account has.
    2. When the mapping sets roles, the staff role is the highest one the groups give, and
       none when they give none: someone taken out of every mapped group loses the role.
       Django admin access (is_staff) follows it. is_superuser is never changed here.
    3. Memberships marked from_sso are added, re-roled and removed to match the groups;
       memberships made by hand are left as they are.
    4. Audit "user.sso_create", or "user.sso_update" when anything changed, with the changes.

    Without a groups claim at all, steps 2 and 3 are skipped: the provider said nothing about groups.
    """
    created = False
    if user is None:
        try:
            with transaction.atomic():
                user = User.objects.create_user(identity.email, name=identity.name)
            created = True
        except IntegrityError:
            # A second sign-in of the same person, at the same moment, created it first.
            user = User.objects.get(email__iexact=identity.email)
    before = {"email": user.email, "name": user.name, "staff_role": user.staff_role, "is_staff": user.is_staff}
    fields: list[str] = []
    if identity.email and user.email != identity.email:
        user.email = identity.email
        fields.append("email")
    if identity.name and user.name != identity.name:
        user.name = identity.name
        fields.append("name")
    if fields:
        user.save(update_fields=fields)
    role = role_map.staff_role_for(identity.groups) if identity.groups is not None else None
    if role is not None and role != user.staff_role:
        # Through the one service that keeps is_staff and is_superuser in step with the role (a
        # superuser moved to another role by the provider's groups must not stay an administrator).
        try:
            services.set_staff_role(user, role, actor=None, address=address)
        except ValidationError as exc:
            logger.warning("single sign-on kept the role of %s: %s", user.email, " ".join(exc.messages))
    memberships = (
        _sync_memberships(user, role_map.memberships_for(identity.groups)) if identity.groups is not None else {}
    )
    if created:
        audit.record(
            user,
            "user.sso_create",
            user,
            changes={
                "email": user.email,
                "name": user.name,
                "staff_role": user.staff_role,
                **memberships,
            },
            address=address,
        )
    else:
        after = {"email": user.email, "name": user.name, "staff_role": user.staff_role, "is_staff": user.is_staff}
        changes: dict[str, Any] = {**audit.diff(before, after), **memberships}
        if changes:
            audit.record(user, "user.sso_update", user, changes=changes, address=address)
    return user


# Authentication backends -----------------------------------------------------------------


class LocalSignInGate:
    """First of AUTHENTICATION_BACKENDS: refuses every password while LLMGW_LOCAL_SIGNIN is off.

    PermissionDenied makes Django stop before ModelBackend, so the sign-in page, the Django
    admin's and any other password form are all closed. It has no get_user(), so no session
    ever names it (Django's test client picks the first backend that has one).
    """

    def authenticate(
        self, request: HttpRequest | None, username: str | None = None, password: str | None = None, **kwargs: Any
    ) -> None:
        if password is not None and not settings.LOCAL_SIGNIN:
            raise PermissionDenied

    async def aauthenticate(
        self, request: HttpRequest | None, username: str | None = None, password: str | None = None, **kwargs: Any
    ) -> None:
        return self.authenticate(request, username=username, password=password, **kwargs)


class SsoBackend(OIDCAuthenticationBackend):
    """Accounts from the provider's claims, matched by email address (any letter case)."""

    get_settings = staticmethod(oidc_setting)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the parent's __init__: it reads the endpoints, which would fetch the discovery
        # document whenever Django loads its backends, on every password sign-in too.
        self.UserModel = get_user_model()

    # The parent's attribute names, read when used rather than when the backend is loaded.
    @property
    def OIDC_OP_TOKEN_ENDPOINT(self) -> str:
        return str(oidc_setting("OIDC_OP_TOKEN_ENDPOINT"))

    @property
    def OIDC_OP_USER_ENDPOINT(self) -> str:
        return str(oidc_setting("OIDC_OP_USER_ENDPOINT"))

    @property
    def OIDC_OP_JWKS_ENDPOINT(self) -> str:
        return str(oidc_setting("OIDC_OP_JWKS_ENDPOINT"))

    @property
    def OIDC_RP_CLIENT_ID(self) -> str:
        return str(oidc_setting("OIDC_RP_CLIENT_ID"))

    @property
    def OIDC_RP_CLIENT_SECRET(self) -> str | None:
        return oidc_setting("OIDC_RP_CLIENT_SECRET", None)  # type: ignore[no-any-return]

    @property
    def OIDC_RP_SIGN_ALGO(self) -> str:
        return str(oidc_setting("OIDC_RP_SIGN_ALGO", "RS256"))

    @property
    def OIDC_RP_IDP_SIGN_KEY(self) -> Any:
        return oidc_setting("OIDC_RP_IDP_SIGN_KEY", None)

    def authenticate(self, request: HttpRequest | None, **kwargs: Any) -> User | None:  # type: ignore[override]
        # Only the callback view passes a nonce: a password sign-in whose URL happens to carry
        # ?code=&state= must not start a token exchange.
        if request is None or "nonce" not in kwargs or not sso_enabled():
            return None
        return super().authenticate(request, **kwargs)  # type: ignore[no-any-return]

    def get_user(self, user_id: Any) -> User | None:  # type: ignore[override]
        # ModelBackend's, which refuses suspended accounts; the parent's does not.
        return ModelBackend.get_user(self, user_id)  # type: ignore[return-value]

    def _refuse(self, code: str) -> None:
        request = getattr(self, "request", None)
        if request is not None:
            _remember_failure(request, code)

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        """The signature, then the nonce, issuer and audience, each refused with its own reason."""
        if self.OIDC_RP_SIGN_ALGO.startswith(("RS", "ES")):
            key = self.OIDC_RP_IDP_SIGN_KEY
            if key is None:
                key = self.retrieve_matching_jwk(token)
        else:
            key = self.OIDC_RP_CLIENT_SECRET
        try:
            payload = self.get_payload_data(token, key)
        except (SuspiciousOperation, jwt.PyJWTError) as exc:
            self._refuse("invalid_token")
            raise SuspiciousOperation(f"identity token not verified: {exc}") from exc
        # The userinfo endpoint may answer with a JWT too; only ID tokens carry the nonce.
        if "nonce" in kwargs and kwargs["nonce"] != payload.get("nonce"):
            self._refuse("nonce")
            raise SuspiciousOperation("the ID token's nonce does not match this sign-in")
        issuer = str(payload.get("iss", settings.OIDC_ISSUER)).rstrip("/")
        audience = payload.get("aud", self.OIDC_RP_CLIENT_ID)
        audiences = [audience] if isinstance(audience, str) else list(audience or [])
        if issuer != settings.OIDC_ISSUER.rstrip("/") or self.OIDC_RP_CLIENT_ID not in audiences:
            self._refuse("invalid_token")
            raise SuspiciousOperation(f"token from {issuer!r} for {audiences!r}")
        return payload  # type: ignore[no-any-return]

    def _identity(self, claims: dict[str, Any]) -> SsoIdentity:
        return identity_from_claims(claims, groups_claim=settings.OIDC_GROUPS_CLAIM)

    def verify_claims(self, claims: dict[str, Any]) -> bool:
        identity = self._identity(claims)
        if not identity.email:
            self._refuse("no_email")
            return False
        if identity.email_verified is False:
            self._refuse("email_unverified")
            return False
        return True

    def filter_users_by_claims(self, claims: dict[str, Any]) -> Any:
        users = self.UserModel.objects.filter(email__iexact=self._identity(claims).email)
        if len(users) > 1:
            # Older accounts may differ only in letter case; the parent refuses to pick one.
            self._refuse("ambiguous")
        return users

    def create_user(self, claims: dict[str, Any]) -> User:
        return sync_sso_account(
            None,
            self._identity(claims),
            role_map=settings.OIDC_ROLE_MAP,
            address=client_address(getattr(self, "request", None)),
        )

    def update_user(self, user: User, claims: dict[str, Any]) -> User:
        if not user.is_active:
            self._refuse("inactive")
            return user
        return sync_sso_account(
            user,
            self._identity(claims),
            role_map=settings.OIDC_ROLE_MAP,
            address=client_address(getattr(self, "request", None)),
        )


# Views ------------------------------------------------------------------------------------


def _fail(request: HttpRequest, code: str, detail: str = "") -> HttpResponseRedirect:
    _remember_failure(request, code, detail)
    return HttpResponseRedirect(resolve_url(settings.LOGIN_REDIRECT_URL_FAILURE))


class SsoAuthenticateView(OIDCAuthenticationRequestView):
    """/oidc/authenticate/: off to the provider, with state, nonce and PKCE kept in the session."""

    get_settings = staticmethod(oidc_setting)

    def __init__(self, **kwargs: Any) -> None:
        # Not the parent's __init__, which reads the endpoint (a discovery fetch) before get().
        View.__init__(self, **kwargs)

    @property
    def OIDC_OP_AUTH_ENDPOINT(self) -> str:
        return str(oidc_setting("OIDC_OP_AUTHORIZATION_ENDPOINT"))

    @property
    def OIDC_RP_CLIENT_ID(self) -> str:
        return str(oidc_setting("OIDC_RP_CLIENT_ID"))

    def get(self, request: HttpRequest) -> HttpResponseBase:
        if not sso_enabled():
            raise Http404
        request.session.pop(FAILURE_SESSION_KEY, None)
        try:
            oidc_setting("OIDC_OP_AUTHORIZATION_ENDPOINT")  # discovery, before any state is kept
        except DiscoveryError as exc:
            logger.warning("single sign-on: %s", exc)
            return _fail(request, "unavailable")
        return super().get(request)  # type: ignore[no-any-return]


class SsoCallbackView(OIDCAuthenticationCallbackView):
    """/oidc/callback/: the provider's answer. Every failure ends on sign_in_failed() with its reason."""

    get_settings = staticmethod(oidc_setting)

    @property
    def failure_url(self) -> str:
        return resolve_url(settings.LOGIN_REDIRECT_URL_FAILURE)

    def get(self, request: HttpRequest) -> HttpResponseBase:
        if not sso_enabled():
            raise Http404
        request.session.pop(FAILURE_SESSION_KEY, None)
        error = request.GET.get("error")
        if error:
            super().get(request)  # forgets the state and signs out, as the library does
            # The library's failure left a generic reason; the provider's own is better.
            request.session[FAILURE_SESSION_KEY] = ["provider", (request.GET.get("error_description") or error)[:300]]
            return HttpResponseRedirect(self.failure_url)
        if "code" in request.GET and "state" in request.GET:
            states = request.session.get("oidc_states")
            if not states:
                return _fail(request, "no_session")
            if request.GET["state"] not in states:
                return _fail(request, "state")
        try:
            return super().get(request)  # type: ignore[no-any-return]
        except DiscoveryError as exc:
            logger.warning("single sign-on: %s", exc)
            return _fail(request, "unavailable")
        except requests.HTTPError as exc:
            logger.warning("single sign-on: the provider refused a request: %s", exc)
            return _fail(request, "token")
        except requests.RequestException as exc:
            logger.warning("single sign-on: the provider could not be reached: %s", exc)
            return _fail(request, "unavailable")
        except (SuspiciousOperation, jwt.PyJWTError) as exc:
            logger.warning("single sign-on refused: %s", exc)
            return _fail(request, "invalid_token")

    def login_failure(self) -> HttpResponseRedirect:
        user = getattr(self, "user", None)
        return _fail(self.request, "inactive" if user is not None and not user.is_active else "unknown")

    def login_success(self) -> HttpResponseRedirect:
        self.request.session.pop(FAILURE_SESSION_KEY, None)
        return super().login_success()  # type: ignore[no-any-return]


@method_decorator(never_cache, name="dispatch")
class SsoLogoutView(OIDCLogoutView):
    """Sign out (POST only): ends the session here, and the provider's too for people who came through it."""

    get_settings = staticmethod(oidc_setting)


def provider_logout_url(request: HttpRequest) -> str:
    """OIDC_OP_LOGOUT_URL_METHOD: the provider's end_session_endpoint when it has one and the person signed in there.

    The provider sends people back to LOGOUT_REDIRECT_URL (the sign-in page), which has to be
    registered with it as a post-logout redirect URI.
    """
    back = resolve_url(settings.LOGOUT_REDIRECT_URL)
    id_token = request.session.get("oidc_id_token")
    if not id_token or not sso_enabled():
        return back
    try:
        end_session = discover(settings.OIDC_ISSUER).get("end_session_endpoint")
    except DiscoveryError as exc:
        logger.warning("single sign-on: signing out here only: %s", exc)
        return back
    if not end_session:
        return back
    query = urlencode(
        {
            "id_token_hint": id_token,
            "post_logout_redirect_uri": request.build_absolute_uri(back),
            "client_id": settings.OIDC_RP_CLIENT_ID,
        }
    )
    return f"{end_session}{'&' if '?' in end_session else '?'}{query}"


@never_cache
@require_GET
def sign_in_failed(request: HttpRequest) -> HttpResponse:
    """LOGIN_REDIRECT_URL_FAILURE: "Sign-in failed: <reason>", with a way to try again."""
    code, detail = request.session.pop(FAILURE_SESSION_KEY, None) or ["unknown", ""]
    return render(request, "accounts/sso_failed.html", {"reason": failure_reason(code, detail)})


def sign_in_options(request: HttpRequest) -> dict[str, Any]:
    """Context processor for the sign-in page: whether to show the password form and the provider's button."""
    return {
        "sso_enabled": sso_enabled(),
        "sso_name": provider_name() if sso_enabled() else "",
        "password_sign_in": getattr(settings, "LOCAL_SIGNIN", True),
    }
