"""The REST API's shared pieces: the router, the schema's error answers and authentication, the
exception handler and the status endpoint. What the API accepts is in llmgw.api_input."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.routers import APIRootView, DefaultRouter
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

import llmgw
from apps.accounts.access import IsSignedIn, can_read_everything
from llmgw import readiness
from llmgw.errors import ServiceError

__all__ = ["ApiKeyScheme", "AutoSchema", "ErrorSerializer", "StatusView", "exception_handler", "refusal", "router"]


class ApiRootView(APIRootView):
    """The list of the API's collections."""

    permission_classes = [IsSignedIn]


router = DefaultRouter()
router.APIRootView = ApiRootView
# Accept /api/v1/keys and /api/v1/keys/ alike: scripts rarely agree on the slash.
router.trailing_slash = "/?"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler, with a stable `detail` string on every error for scripts and `ctl`; a service's
    refusal (llmgw.errors.ServiceError) answers with its status, message, code and details."""
    if isinstance(exc, ServiceError):
        return refusal(exc)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict) and "detail" not in response.data:
        response.data = {"detail": gettext("Invalid input."), "errors": response.data}
    return response


def refusal(exc: ServiceError, *, status: int | None = None) -> Response:
    """A service's refusal as the API's error body: its message, code and details, with its status or,
    where the view knows better (the same refusal is a conflict on one path), `status`."""
    body: dict[str, Any] = {"detail": exc.message}
    if exc.code:
        body["code"] = exc.code
    if exc.details:
        body["errors"] = exc.details
    return Response(body, status=status or exc.status)


# The schema -----------------------------------------------------------------------------------

# Only for the schema: the body of every refusal ("errors" cannot be an attribute of a serializer class).
ErrorSerializer = inline_serializer(
    "Error",
    {
        "detail": serializers.CharField(help_text=_("Why, in words.")),
        "code": serializers.CharField(
            required=False,
            help_text=_("A service's refusal: a short name for it that scripts can test, e.g. spec_invalid."),
        ),
        "errors": serializers.DictField(
            required=False,
            help_text=_("For refused input: each field (a path such as models[0].name in a spec) with its messages."),
        ),
    },
)


ERRORS = {
    "400": _(
        "The input was refused: `detail` says why and `errors` names each field. Every operation refuses"
        " a NUL character in its path, its query or a cookie this way."
    ),
    "401": _("No API key or session, or a key that is not valid (the reason is in `detail`)."),
    "403": _("Signed in, but this role may not do this (or a session's CSRF token is missing)."),
    "404": _("Nothing by that name or id that the caller may see."),
    "415": _("The body is not JSON (send Content-Type: application/json)."),
    "429": _("Too many requests; `Retry-After` says when to try again."),
}


class AutoSchema(SpectacularAutoSchema):
    """drf-spectacular's schema, with the error answers each operation can give declared too."""

    def _error_codes(self) -> set[str]:
        codes = {"400"}  # a NUL in the path, the query or a cookie, refused before any view (llmgw.edge)
        view = self.view
        permissions = self.view.get_permissions() if hasattr(view, "get_permissions") else []
        if not all(isinstance(p, AllowAny) for p in permissions):
            codes |= {"401", "403"} if view.get_authenticators() else {"403"}
        if "{" in self.path:
            codes.add("404")
        if self.method in ("POST", "PUT", "PATCH") and self.get_request_serializer() is not None:
            codes.add("415")
        if getattr(view, "throttle_classes", None):
            codes.add("429")
        return codes

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        for code in sorted(self._error_codes() - set(responses)):
            responses[code] = self._get_response_for_code(
                OpenApiResponse(ErrorSerializer, description=str(ERRORS[code])), code, direction=direction
            )
        return responses


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """`Authorization: Bearer llmgw_...` in the schema, next to the console's session cookie."""

    target_class = "apps.accounts.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, Any]:
        return {
            "type": "http",
            "scheme": "bearer",
            "bearerFormat": "llmgw_...",
            "description": str(_("An API key, as made on the Account page or at /api/v1/keys.")),
        }


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
                "fabrics": serializers.DictField(
                    child=serializers.ListField(child=serializers.DictField()), required=False
                ),
            },
        )
    )
    def get(self, request: Request) -> Response:
        from llmgw.console.selectors import landing_counts

        body: dict[str, Any] = {
            "version": llmgw.__version__,
            "counts": landing_counts(),
            "checks": readiness.run_checks(),
        }
        if can_read_everything(request.user):
            from apps.fabrics.services import fabric_weights

            # Per physical fabric, the models whose weights its nodes hold (a shared filer once).
            body["fabrics"] = fabric_weights()
        return Response(body)
