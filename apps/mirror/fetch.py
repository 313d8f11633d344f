"""One file from the Hub to the mirror's disk (agent/install/resumable.py does the download:
streamed, resumable, verified on the way, redirects followed only where
agent/install/redirects.py allows)."""

from __future__ import annotations

import urllib.parse

from django.conf import settings

from agent.install.resumable import FetchFailed, download
from llmgw.outbound import destinations

__all__ = ["FetchFailed", "destinations", "download", "resolve_url"]


def resolve_url(repo: str, commit: str, path: str) -> str:
    quoted = urllib.parse.quote(path)
    return f"{settings.HF_ENDPOINT}/{repo}/resolve/{commit}/{quoted}"
