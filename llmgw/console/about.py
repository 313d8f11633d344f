"""The project's page at /about: what llmgw is, how it is installed, and the reverse-proxy
examples of deploy/proxy/, read from the files as they are so the page never drifts from them.

Its fonts are files of this installation (console/fonts, OFL): no request leaves for a font service.
"""

from __future__ import annotations

import re

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_safe

from apps.accounts.access import public
from llmgw.console.docs import manual, manual_language

__all__ = ["PROXY_EXAMPLES", "about", "proxy_examples"]

# (label, path from the repository root): shown verbatim on the page.
PROXY_EXAMPLES = (
    ("Caddy", "deploy/proxy/caddy/Caddyfile"),
    ("nginx", "deploy/proxy/nginx/llmgw.conf"),
)


def proxy_examples() -> list[dict[str, str]]:
    examples = []
    for label, path in PROXY_EXAMPLES:
        try:
            text = (settings.BASE_DIR / path).read_text(encoding="utf-8")
        except OSError:
            continue  # an installation without the deploy folder shows the rest of the page
        examples.append({"label": label, "path": path, "text": text, "url": f"{settings.REPOSITORY_URL}/{path}"})
    return examples


@public
@require_safe
def about(request: HttpRequest) -> HttpResponse:
    language = manual_language()
    return render(
        request,
        "console/about.html",
        {
            "proxies": proxy_examples(),
            # The repository's home: its file URL without /blob/<branch> (GitHub, Gitea) or /-/blob/ (GitLab).
            "repository": re.sub(r"(/-)?/(blob|tree|src)/[^/]+$", "", settings.REPOSITORY_URL),
            "titles": {document.slug: document.title(language) for document in manual()},
        },
    )
