from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from django.utils.translation import get_language

import llmgw

__all__ = ["console"]


def console(request: HttpRequest) -> dict[str, Any]:
    return {
        "llmgw_version": llmgw.__version__,
        "languages": settings.LANGUAGES,
        "current_language": get_language(),
    }
