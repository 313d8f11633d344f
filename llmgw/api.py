"""The REST API's shared pieces: the router, the exception handler and the status endpoint."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import APIRootView, DefaultRouter
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

import llmgw
from apps.accounts.access import IsSignedIn
from llmgw import readiness

__all__ = ["StatusView", "exception_handler", "router"]


class ApiRootView(APIRootView):
    """The list of the API's collections."""

    permission_classes = [IsSignedIn]


router = DefaultRouter()
router.APIRootView = ApiRootView
# Accept /api/v1/keys and /api/v1/keys/ alike: scripts rarely agree on the slash.
router.trailing_slash = "/?"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, with a stable `detail` string on every error for scripts and `ctl`."""
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict) and "detail" not in response.data:
        response.data = {"detail": "Invalid input.", "errors": response.data}
    return response


class StatusView(APIView):
    """What the control plane holds and whether its services answer."""

    permission_classes = [IsSignedIn]

    @extend_schema(
        responses=inline_serializer(
            "Status",
            {
                "version": serializers.CharField(),
                "counts": serializers.DictField(child=serializers.IntegerField()),
                "checks": serializers.DictField(child=serializers.CharField()),
            },
        )
    )
    def get(self, request: Request) -> Response:
        from llmgw.console.selectors import landing_counts

        return Response(
            {"version": llmgw.__version__, "counts": landing_counts(), "checks": readiness.run_checks()}
        )
