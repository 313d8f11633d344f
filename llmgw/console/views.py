"""The console's shell pages."""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_http_methods

from apps.accounts import services
from apps.accounts.models import ApiKey, User
from llmgw.console.selectors import landing_counts

__all__ = ["api_keys", "landing", "set_language"]


@login_required
@require_GET
def landing(request: HttpRequest) -> HttpResponse:
    return render(request, "console/landing.html", {"counts": landing_counts()})


@require_GET
def set_language(request: HttpRequest, code: str) -> HttpResponse:
    """Remember the person's language in a cookie and go back where they were."""
    target = request.GET.get("next") or request.META.get("HTTP_REFERER") or "/"
    if not url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                           require_https=request.is_secure()):
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


EXPIRY_CHOICES = {"": None, "7": 7, "30": 30, "90": 90, "365": 365}


@login_required
@require_http_methods(["GET", "POST"])
def api_keys(request: HttpRequest) -> HttpResponse:
    """Create, list and revoke one's own API keys. A new key is shown once."""
    user: User = request.user  # type: ignore[assignment]
    new_secret = None
    address = request.META.get("REMOTE_ADDR")
    if request.method == "POST":
        if "revoke" in request.POST:
            key = get_object_or_404(ApiKey, pk=request.POST.get("revoke"), user=user)
            services.revoke_api_key(key, actor=user, address=address)
            messages.success(request, _("Key “%(name)s” revoked.") % {"name": key.name})
            return HttpResponseRedirect(reverse("api-keys"))
        name = request.POST.get("name", "").strip()
        days = EXPIRY_CHOICES.get(request.POST.get("expires", ""))
        if not name:
            messages.error(request, _("Give the key a name, so you can tell it apart later."))
        else:
            expires_at = timezone.now() + timedelta(days=days) if days else None
            new = services.create_api_key(user, name=name, expires_at=expires_at, actor=user, address=address)
            new_secret = new.secret
    keys = ApiKey.objects.filter(user=user, is_session_key=False).select_related("project")
    return render(request, "accounts/api_keys.html", {"keys": keys, "new_secret": new_secret, "now": timezone.now()})
