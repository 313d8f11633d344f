"""Signing in and signing up, and the page a refused form token ends on.

Both forms are bounded by accounts.throttle: failed sign-ins per address and email, POSTs
per address, and password hashes per process. A failed sign-in writes nothing to the
database; a good one is audited as "user.sign_in" with the client's address.
"""

from __future__ import annotations

import logging
import secrets

from django.conf import settings
from django.contrib.auth import login as auth_login
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render, resolve_url
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.utils.translation import ngettext
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_protect
from django.views.decorators.debug import sensitive_post_parameters
from django.views.decorators.http import require_GET, require_http_methods

from apps.accounts import services, throttle
from apps.accounts.forms import SignUpForm
from llmgw.edge import is_api, refusal

__all__ = ["admin_sign_in", "csrf_failure", "sign_in", "sign_up", "sign_up_done"]

logger = logging.getLogger(__name__)

SIGN_IN_TEMPLATE = "console/login.html"
SIGN_UP_TEMPLATE = "accounts/signup.html"
# How long to tell someone to wait when no password-hash slot came free.
BUSY_RETRY_AFTER = 5


def _refusal_text(refusal: throttle.Refusal) -> str:
    if refusal.reason == "pair":
        return ngettext(
            "Too many failed sign-ins with this email address from your network. Try again in %(minutes)d minute.",
            "Too many failed sign-ins with this email address from your network. Try again in %(minutes)d minutes.",
            refusal.minutes,
        ) % {"minutes": refusal.minutes}
    if refusal.reason == "address":
        return ngettext(
            "Too many failed sign-ins from your network. Try again in %(minutes)d minute.",
            "Too many failed sign-ins from your network. Try again in %(minutes)d minutes.",
            refusal.minutes,
        ) % {"minutes": refusal.minutes}
    return ngettext(
        "Too many sign-in and sign-up requests from your network. Try again in %(seconds)d second.",
        "Too many sign-in and sign-up requests from your network. Try again in %(seconds)d seconds.",
        refusal.retry_after,
    ) % {"seconds": refusal.retry_after}


def _busy_text() -> str:
    return _("The server is busy checking other passwords. Try again in a few seconds.")


def _refused(
    request: HttpRequest, template: str, context: dict[str, object], text: str, retry_after: int
) -> HttpResponse:
    response = render(request, template, {**context, "refusal": text}, status=429)
    response["Retry-After"] = str(retry_after)
    return response


def _next_url(request: HttpRequest) -> str:
    """Where to go after signing in: the `next` asked for when it stays on this site."""
    target = request.POST.get("next") or request.GET.get("next") or ""
    if target and url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return target
    return resolve_url(settings.LOGIN_REDIRECT_URL)


# Sign in -------------------------------------------------------------------------------


@sensitive_post_parameters("password")
@csrf_protect
@never_cache
@require_http_methods(["GET", "POST"])
def sign_in(request: HttpRequest) -> HttpResponse:
    """The sign-in form, with the login CSRF token Django's middleware checks on POST.

    1. Count the POST against the client's address; refuse past that bound.
    2. Refuse, before any password is checked, an email that failed too often from this
       address, or an address that failed too often with any email.
    3. Check the password in one of the process's hash slots (429 when none comes free).
    4. A failure is counted (cache only); a success signs in (new session key, new CSRF
       token), clears the pair's count and is audited.
    """
    if request.user.is_authenticated:
        return HttpResponseRedirect(_next_url(request))
    context: dict[str, object] = {
        "next": request.POST.get("next") or request.GET.get("next", ""),
        "signup_open": settings.SIGNUP_OPEN,
    }
    if request.method != "POST":
        return render(request, SIGN_IN_TEMPLATE, {**context, "form": AuthenticationForm(request)})

    address = throttle.client_address(request)
    email = request.POST.get("username", "")
    # An unbound form for refusals: asking a bound one for its errors would check the password.
    untried = AuthenticationForm(request, initial={"username": email})
    refusal = throttle.count_post(address) or throttle.check_sign_in(address, email)
    if refusal is not None:
        return _refused(
            request, SIGN_IN_TEMPLATE, {**context, "form": untried}, _refusal_text(refusal), refusal.retry_after
        )
    form = AuthenticationForm(request, data=request.POST)
    try:
        with throttle.hash_slot():
            valid = form.is_valid()
    except throttle.Busy:
        return _refused(request, SIGN_IN_TEMPLATE, {**context, "form": untried}, _busy_text(), BUSY_RETRY_AFTER)
    if not valid:
        if email and request.POST.get("password"):
            throttle.count_failure(address, email)
        return render(request, SIGN_IN_TEMPLATE, {**context, "form": form})
    user = form.get_user()
    auth_login(request, user)
    throttle.forget_failures(address, email)
    services.record_sign_in(user, address=address)
    return HttpResponseRedirect(_next_url(request))


@require_GET
def admin_sign_in(request: HttpRequest) -> HttpResponse:
    """The Django admin's own sign-in page, replaced: it would check passwords unbounded.

    The admin sends here whoever it does not let in. Strangers go to /login/ and come back;
    someone signed in without admin access goes to the console instead of round in a loop.
    """
    if request.user.is_authenticated:
        return HttpResponseRedirect(resolve_url(settings.LOGIN_REDIRECT_URL))
    return redirect_to_login(request.GET.get("next") or reverse("admin:index"))


# Sign up -------------------------------------------------------------------------------


@sensitive_post_parameters("password")
@csrf_protect
@never_cache
@require_http_methods(["GET", "POST"])
def sign_up(request: HttpRequest) -> HttpResponse:
    """The sign-up form, closed unless LLMGW_SIGNUP_OPEN is on.

    A new address and a taken one end on the same page (sign_up_done), so the form never
    says who has an account. Any other failure shows a reference that is logged with it.
    """
    if not settings.SIGNUP_OPEN:
        return render(request, SIGN_UP_TEMPLATE, {"closed": True}, status=403 if request.method == "POST" else 200)
    if request.user.is_authenticated:
        return HttpResponseRedirect(resolve_url(settings.LOGIN_REDIRECT_URL))
    context: dict[str, object] = {"help_texts": password_validation.password_validators_help_texts()}
    if request.method != "POST":
        return render(request, SIGN_UP_TEMPLATE, {**context, "form": SignUpForm()})

    address = throttle.client_address(request)
    form = SignUpForm(request.POST)
    refusal = throttle.count_post(address)
    if refusal is not None:
        return _refused(
            request,
            SIGN_UP_TEMPLATE,
            {**context, "form": SignUpForm(initial=_kept(request))},
            _refusal_text(refusal),
            refusal.retry_after,
        )
    if not form.is_valid():
        return render(request, SIGN_UP_TEMPLATE, {**context, "form": form})
    try:
        with throttle.hash_slot():
            services.sign_up(
                email=form.cleaned_data["email"],
                name=form.cleaned_data["name"],
                password=form.cleaned_data["password"],
                address=address,
            )
    except throttle.Busy:
        return _refused(
            request,
            SIGN_UP_TEMPLATE,
            {**context, "form": SignUpForm(initial=_kept(request))},
            _busy_text(),
            BUSY_RETRY_AFTER,
        )
    except Exception:
        reference = secrets.token_hex(6)
        logger.exception("sign-up failed, reference %s (address %s)", reference, address)
        return render(
            request,
            SIGN_UP_TEMPLATE,
            {**context, "form": SignUpForm(initial=_kept(request)), "reference": reference},
            status=500,
        )
    return HttpResponseRedirect(reverse("signup-done"))


def _kept(request: HttpRequest) -> dict[str, str]:
    return {"email": request.POST.get("email", ""), "name": request.POST.get("name", "")}


@require_GET
def sign_up_done(request: HttpRequest) -> HttpResponse:
    """What every accepted sign-up ends on, whether its address was new or not."""
    return render(request, "accounts/signup_done.html")


# Refused form tokens -------------------------------------------------------------------


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """CSRF_FAILURE_VIEW: a console page instead of Django's bare one, still a 403; under /api/,
    JSON saying what is missing (every API answer is JSON).

    Django has logged the reason already (django.security.csrf).
    """
    if is_api(request):
        return refusal(
            request,
            403,
            _("A request made with a session's cookie must carry its CSRF token; send an API key instead."),
        )
    return render(request, "accounts/csrf_failure.html", status=403)
