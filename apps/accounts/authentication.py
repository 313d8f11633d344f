"""Bearer API keys for the REST API."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from apps.accounts.models import ApiKey, User
from apps.accounts.services import check_api_key

__all__ = ["ApiKeyAuthentication"]


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer llmgw_...`; a bad key is a 401 with the reason, never a fallback."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[User, ApiKey] | None:
        header = get_authorization_header(request).split()
        if not header or header[0].lower() != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed(_("Malformed Authorization header: expected 'Bearer <key>'."))
        try:
            raw = header[1].decode()
        except UnicodeDecodeError:
            raise exceptions.AuthenticationFailed(_("The API key is not valid text.")) from None
        result = check_api_key(raw)
        if result.key is None:
            raise exceptions.AuthenticationFailed(result.reason)
        return result.key.user, result.key

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="llmgw"'


def request_api_key(request: Any) -> ApiKey | None:
    auth = getattr(request, "auth", None)
    return auth if isinstance(auth, ApiKey) else None
