"""What every view asks of a request: is it htmx asking for a fragment, and who sent it."""

from __future__ import annotations

import ipaddress
from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django_htmx.middleware import HtmxDetails

__all__ = ["HtmxHttpRequest", "client_address", "is_fragment"]


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


def is_fragment(request: HtmxHttpRequest) -> bool:
    """True when htmx asks for a piece of the page rather than the page (a boosted link wants it all)."""
    return bool(request.htmx) and not request.htmx.boosted


def client_address(request: Any) -> str | None:
    """The address a request came from, as the audit log and the sign-in throttle both record it;
    None when there is no request or no usable address.

    REMOTE_ADDR, unless llmgw runs behind its TLS proxy (LLMGW_BEHIND_TLS_PROXY): then the hop
    that proxy recorded, the last entry of X-Forwarded-For. Entries before it were sent by the
    client and can be anything, so trusting them would let one client pass for many.
    """
    meta = getattr(request, "META", None)
    if meta is None:
        return None
    if getattr(settings, "BEHIND_TLS_PROXY", False):
        hops = [hop.strip() for hop in meta.get("HTTP_X_FORWARDED_FOR", "").split(",") if hop.strip()]
        if hops and _is_address(hops[-1]):
            return hops[-1]
    remote = meta.get("REMOTE_ADDR") or ""
    return remote if _is_address(remote) else None


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
