"""One file from the Hub to the mirror's disk (agent/install/resumable.py does the download:
streamed, resumable, verified on the way)."""

from __future__ import annotations

import urllib.parse

from django.conf import settings

from agent.install.resumable import FetchFailed, download

__all__ = ["FetchFailed", "download", "resolve_url"]


def resolve_url(repo: str, commit: str, path: str) -> str:
    quoted = urllib.parse.quote(path)
    return f"{settings.HF_ENDPOINT}/{repo}/resolve/{commit}/{quoted}"
