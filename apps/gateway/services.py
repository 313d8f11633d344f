"""The chat page's key: a short-lived API key bound to the person's console session.

The page never holds a long-lived secret. It asks for a key when it loads and keeps it in
memory only; a reload asks again. While the session's key is still good for a while the same
key is handed back, so reloading does not pile up keys; when it runs low a new one is made.
Signing out revokes every session key of the person (the `user_logged_out` signal), and each
expires an hour after it was made whatever happens to the session.

To hand the same key back, its secret is kept in the session's server-side store next to
its id. That store is as sensitive as the session itself (whoever holds the session can make
keys anyway), and the secret never reaches the browser's storage. With a cookie-based
session engine the secret would travel in the cookie, so there only the id is kept and a
reload makes a new key (revoking the old one).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.signals import user_logged_out
from django.db import transaction
from django.utils import timezone

from apps.accounts import services as account_services
from apps.accounts.models import ApiKey, User
from llmgw.http import client_address

__all__ = [
    "SESSION_KEY_LIFETIME",
    "SESSION_KEY_NAME",
    "SessionKey",
    "connect",
    "get_session_key",
    "revoke_session_keys",
]

SESSION_KEY_LIFETIME = timedelta(hours=1)
# A key with less than this left is not handed out again: the page would lose it mid-conversation.
SESSION_KEY_MIN_LEFT = timedelta(minutes=10)
SESSION_KEY_NAME = "Console chat"
# Where the session keeps the chat key: {"id": pk, "secret": "llmgw_..."} (no secret with cookie sessions).
SESSION_FIELD = "llmgw_chat_key"


@dataclass(frozen=True)
class SessionKey:
    key: ApiKey
    secret: str
    created: bool

    @property
    def expires_at(self) -> datetime:
        assert self.key.expires_at is not None
        return self.key.expires_at


def _session_keeps_secrets() -> bool:
    return not settings.SESSION_ENGINE.endswith("signed_cookies")


def _usable(key: ApiKey, user: User, now: datetime) -> bool:
    return (
        key.user_id == user.pk
        and key.is_session_key
        and key.revoked_at is None
        and key.expires_at is not None
        and key.expires_at - now > SESSION_KEY_MIN_LEFT
    )


@transaction.atomic
def get_session_key(session: Any, user: User, *, address: str | None = None) -> SessionKey:
    """The session's chat key while it stays good for a while, else a new one (the old one revoked).

    1. Read {"id", "secret"} from the session; reuse the key if it is the person's own session
       key, not revoked, and has more than SESSION_KEY_MIN_LEFT to live.
    2. Otherwise revoke the key the session named (if any), make a new one that expires in
       SESSION_KEY_LIFETIME, and note it in the session.
    """
    now = timezone.now()
    kept = session.get(SESSION_FIELD) or {}
    previous = None
    if isinstance(kept, dict) and isinstance(kept.get("id"), int):
        previous = ApiKey.objects.filter(pk=kept["id"], user=user, is_session_key=True).first()
        secret = kept.get("secret")
        if previous is not None and isinstance(secret, str) and _usable(previous, user, now):
            return SessionKey(key=previous, secret=secret, created=False)
    if previous is not None and previous.revoked_at is None:
        account_services.revoke_api_key(previous, actor=user, address=address)
    new = account_services.create_api_key(
        user,
        name=SESSION_KEY_NAME,
        expires_at=now + SESSION_KEY_LIFETIME,
        actor=user,
        address=address,
        is_session_key=True,
    )
    session[SESSION_FIELD] = {"id": new.key.pk, **({"secret": new.secret} if _session_keeps_secrets() else {})}
    return SessionKey(key=new.key, secret=new.secret, created=True)


@transaction.atomic
def revoke_session_keys(user: User, *, address: str | None = None) -> int:
    """Revoke every console session key of `user` that is still good; returns how many."""
    keys = list(ApiKey.objects.active().filter(user=user, is_session_key=True))
    for key in keys:
        # One at a time through the service: each is audited and tells the gateway to reload.
        account_services.revoke_api_key(key, actor=user, address=address)
    return len(keys)


def _signed_out(sender: Any, request: Any = None, user: Any = None, **kwargs: Any) -> None:
    if user is None or not getattr(user, "pk", None):
        return
    address = client_address(request)
    revoke_session_keys(user, address=address or None)


def connect() -> None:
    user_logged_out.connect(_signed_out, dispatch_uid="gateway-revoke-chat-keys")
