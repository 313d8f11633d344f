"""/api/v1/facility: the domains nodes name (site, room, row, rack, PDU) and the holds on them."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext_lazy
from drf_spectacular.utils import OpenApiResponse, OpenApiTypes, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsOperator, IsStaffReader
from apps.facility import services
from apps.facility.locations import parse_domain
from apps.facility.serializers import BudgetInput
from llmgw.api import ErrorSerializer
from llmgw.api_serializers import read_body
from llmgw.http import client_address


def _error(text: Any) -> OpenApiResponse:
    return OpenApiResponse(ErrorSerializer, description=text)


class HoldInput(serializers.Serializer[Any]):
    domain = serializers.CharField(max_length=120, help_text=gettext_lazy("LEVEL=NAME, e.g. rack=r12"))
    reason = serializers.CharField(max_length=500, required=False, allow_blank=True, default="")
    drain = serializers.BooleanField(
        required=False,
        default=False,
        help_text=gettext_lazy("also move the replicas out, each replaced elsewhere first"),
    )


class FacilityView(APIView):
    """Each domain some node names, level by level (site, room, row, rack, pdu) with its nodes and
    the hold on it; `unplaced`: nodes that name no location; `holds`: the active holds."""

    permission_classes = [IsStaffReader]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(services.facility_overview())


class HoldsView(APIView):
    """The active holds (GET); hold a domain (POST `{"domain": "rack=r12", "reason": "...", "drain":
    false}`): nothing new is placed on its nodes until it is released, and with `drain` the replicas
    on them are moved out, each replaced elsewhere first."""

    permission_classes = [IsOperator]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response({"results": [services.hold_dict(h) for h in services.active_holds()]})

    @extend_schema(
        request=HoldInput,
        responses={
            201: OpenApiTypes.OBJECT,
            400: _error(gettext_lazy("The domain is not LEVEL=NAME, or it is already held.")),
        },
    )
    def post(self, request: Request) -> Response:
        data = HoldInput(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            level, name = parse_domain(data.validated_data["domain"])
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=400)
        row = services.hold(
            level,
            name,
            reason=data.validated_data["reason"],
            drain=data.validated_data["drain"],
            actor=request.user,
            address=client_address(request),
        )
        return Response(services.hold_dict(row), status=201)


class ReleaseView(APIView):
    """End the active hold on a domain (POST `{"domain": "rack=r12"}`)."""

    permission_classes = [IsOperator]

    @extend_schema(
        request=HoldInput,
        responses={200: OpenApiTypes.OBJECT, 400: _error(gettext_lazy("The domain is not held."))},
    )
    def post(self, request: Request) -> Response:
        data = HoldInput(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            level, name = parse_domain(data.validated_data["domain"])
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=400)
        row = services.release(level, name, actor=request.user, address=client_address(request))
        return Response(services.hold_dict(row))


class BudgetsView(APIView):
    """The power caps (GET); set one (POST `{"domain": "rack=r12", "watts": 15000}`, or with `feeds`
    `[{"name": "A", "watts": 17300}, ...]` and `redundant`: an A/B-fed domain's cap is one feed). A
    shard that would take a capped domain past its cap is not placed there, and says so."""

    permission_classes = [IsOperator]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        from apps.facility.models import Budget
        from apps.facility.power import budget_dict

        return Response({"results": [budget_dict(b) for b in Budget.objects.all()]})

    @extend_schema(
        request=BudgetInput,
        responses={201: OpenApiTypes.OBJECT, 400: _error(gettext_lazy("The budget is not valid; the errors say why."))},
    )
    def post(self, request: Request) -> Response:
        from apps.facility.power import budget_dict, set_budget

        data = read_body(BudgetInput, request)
        row = set_budget(data, source="api", actor=request.user, address=client_address(request))
        return Response(budget_dict(row), status=201)
