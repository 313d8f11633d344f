"""One file from the Hub to the mirror's disk (agent/install/resumable.py does the download:
streamed, resumable, verified on the way, redirects followed only where
agent/install/redirects.py allows)."""

from __future__ import annotations

import urllib.parse

from django.conf import settings

from agent.install.redirects import Destinations, endpoint
from agent.install.resumable import FetchFailed, download

__all__ = ["FetchFailed", "destinations", "download", "resolve_url"]


def resolve_url(repo: str, commit: str, path: str) -> str:
    quoted = urllib.parse.quote(path)
    return f"{settings.HF_ENDPOINT}/{repo}/resolve/{commit}/{quoted}"


def destinations() -> Destinations:
    """The control plane's own endpoints, which no redirect from the Hub may lead to: where the
    web process listens (`LLMGW_LISTEN`) and where people reach it (`LLMGW_PUBLIC_URL`)."""
    host, port = settings.LISTEN
    forbidden = [(host, port)]
    if settings.PUBLIC_URL:
        forbidden.append(endpoint(settings.PUBLIC_URL))
    return Destinations(forbidden=tuple(forbidden))
