"""The console's chat page: a page, the short-lived key its script uses, and server-side rendering.

The conversation goes from the browser straight to /v1/chat/completions with the session's
key; the gateway keeps no conversation. The browser keeps it (localStorage), and after a reload
asks /chat/render to turn the model's stored turns into HTML again, as when they came.
"""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache

from apps.accounts.access import requires
from apps.accounts.models import User
from apps.gateway import selectors, services
from apps.gateway.rendering import render_markdown
from llmgw.http import client_address

__all__ = ["chat", "chat_render", "chat_session_key"]

MAX_RENDER_TEXTS = 500


@requires("signed_in", methods=["GET"])
def chat(request: HttpRequest) -> HttpResponse:
    """The chat page. Its key is fetched by its script (POST /chat/session-key), never put in the HTML."""
    return render(request, "gateway/chat.html", {"models": selectors.chat_models(request.user)})


@never_cache  # the answer holds a secret
@requires("signed_in", methods=["POST"])
def chat_session_key(request: HttpRequest) -> HttpResponse:
    """The session's chat key: made now, or the one the session already has while it stays good.

    POST only (so the CSRF check guards it); the secret goes to the page's script in the JSON
    answer and nowhere else.
    """
    user: User = request.user  # type: ignore[assignment]
    got = services.get_session_key(request.session, user, address=client_address(request))
    return JsonResponse(
        {
            "key": got.secret,
            "prefix": got.key.prefix,
            "expires_at": got.expires_at.isoformat(),
            "expires_in": max(0, int((got.expires_at - timezone.now()).total_seconds())),
        }
    )


def _texts(request: HttpRequest) -> list[str] | None:
    """The texts to render: {"texts": [...]} as JSON, or repeated `text` form fields."""
    if request.content_type == "application/json":
        try:
            body: Any = json.loads(request.body or b"{}")
        except ValueError:
            return None
        texts = body.get("texts") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return None
        return texts
    return request.POST.getlist("text")


@requires("signed_in", methods=["POST"])
def chat_render(request: HttpRequest) -> HttpResponse:
    """The model's turns as sanitised HTML, in the order sent: {"html": [...]}."""
    texts = _texts(request)
    if texts is None or len(texts) > MAX_RENDER_TEXTS:
        message = _('Send the texts as {"texts": ["…"]}, at most %(count)s of them.') % {"count": MAX_RENDER_TEXTS}
        return JsonResponse({"error": message}, status=400)
    return JsonResponse({"html": [render_markdown(text) for text in texts]})
