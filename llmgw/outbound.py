"""Where this control plane's own fetches (the Hub, the releases API) may be redirected to: the
rules of agent/install/redirects.py, with this control plane's endpoints forbidden."""

from __future__ import annotations

import ssl
import urllib.request

from django.conf import settings

from agent.install.redirects import Destinations, endpoint, handlers

__all__ = ["destinations", "opener"]


def destinations() -> Destinations:
    """The control plane's own endpoints, which no redirect may lead to: where the web process
    listens (`LLMGW_LISTEN`) and where people reach it (`LLMGW_PUBLIC_URL`)."""
    host, port = settings.LISTEN
    forbidden = [(host, port)]
    if settings.PUBLIC_URL:
        forbidden.append(endpoint(settings.PUBLIC_URL))
    return Destinations(forbidden=tuple(forbidden))


def opener(context: ssl.SSLContext) -> urllib.request.OpenerDirector:
    """urllib's opener with this TLS context, the environment's proxies, and redirects followed
    only where `destinations()` allows, without credentials to another host."""
    return urllib.request.build_opener(urllib.request.ProxyHandler(), *handlers(context, destinations()))
