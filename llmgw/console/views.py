"""The console's shell pages."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_safe

from apps.accounts.access import can_read_everything, public, requires
from llmgw import readiness
from llmgw.console.selectors import first_steps, landing_counts

__all__ = ["favicon", "landing", "set_language"]

_FAVICON = Path(__file__).resolve().parent / "static" / "console" / "favicon.ico"


@requires("signed_in", methods=["GET"])
def landing(request: HttpRequest) -> HttpResponse:
    staff = can_read_everything(request.user)
    context: dict[str, object] = {
        "counts": landing_counts(),
        "steps": first_steps(request.user, operator_steps=staff),
    }
    if staff:
        context["scheduler"] = readiness.scheduler()
    return render(request, "console/landing.html", context)


@public
@require_GET
def set_language(request: HttpRequest, code: str) -> HttpResponse:
    """Remember the person's language in a cookie and go back where they were."""
    target = request.GET.get("next") or request.META.get("HTTP_REFERER") or "/"
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = "/"
    else:
        parts = urlsplit(target)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
    response = HttpResponseRedirect(target or "/")
    if code in dict(settings.LANGUAGES):
        response.set_cookie(settings.LANGUAGE_COOKIE_NAME, code, max_age=365 * 24 * 3600, samesite="Lax")
    else:
        # An unknown code falls back to the site default rather than failing.
        response.delete_cookie(settings.LANGUAGE_COOKIE_NAME)
    return response


@cache
def _favicon_bytes() -> bytes:
    return _FAVICON.read_bytes()


@public
@require_safe
def favicon(request: HttpRequest) -> HttpResponse:
    """/favicon.ico, which browsers ask for on pages that name no icon (the admin's, Swagger's):
    the console's icon, from the package itself so that it needs no collectstatic."""
    response = HttpResponse(_favicon_bytes(), content_type="image/x-icon")
    response["Cache-Control"] = "public, max-age=86400"
    return response
