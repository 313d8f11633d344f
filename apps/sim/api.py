"""POST /api/v1/sim: run a scenario (YAML text or its mapping), or ask a what-if of the live fleet."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsOperator
from apps.sim.service import ScenarioError, simulate_text, what_if
from llmgw.api import ErrorSerializer


class WhatIfSerializer(serializers.Serializer[Any]):
    kind = serializers.ChoiceField(choices=["node", "rack", "pdu", "model"])
    name = serializers.CharField(max_length=200)
    min = serializers.IntegerField(min_value=0, required=False)


class SimRequestSerializer(serializers.Serializer[Any]):
    scenario = serializers.JSONField(required=False, help_text=gettext_lazy("The scenario: YAML text, or its mapping."))
    what_if = WhatIfSerializer(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("scenario" in attrs) == ("what_if" in attrs):
            raise serializers.ValidationError(_("Give scenario or what_if: one of them."))
        if "scenario" in attrs and not isinstance(attrs["scenario"], str | dict):
            raise serializers.ValidationError({"scenario": _("The scenario is YAML text or a mapping.")})
        if "what_if" in attrs and attrs["what_if"]["kind"] == "model" and "min" not in attrs["what_if"]:
            raise serializers.ValidationError({"what_if": _("A question about a model needs its new min.")})
        return attrs


class SimView(APIView):
    """Run the reconciler's decisions on a simulated fleet; nothing of the real one changes."""

    permission_classes = [IsOperator]

    @extend_schema(
        request=SimRequestSerializer,
        responses={
            200: inline_serializer(
                "SimReport",
                {
                    "scenario": serializers.DictField(),
                    "steps": serializers.ListField(child=serializers.DictField()),
                    "snapshots": serializers.ListField(child=serializers.DictField()),
                    "preemptions": serializers.ListField(child=serializers.DictField()),
                    "timing": serializers.DictField(),
                },
            ),
            400: OpenApiResponse(
                ErrorSerializer, description=gettext_lazy("The scenario is not valid; the errors say where and why.")
            ),
        },
    )
    def post(self, request: Request) -> Response:
        data = SimRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            if "what_if" in data.validated_data:
                question = data.validated_data["what_if"]
                report = what_if(question["kind"], question["name"], question.get("min"))
            else:
                report = simulate_text(data.validated_data["scenario"], max_steps=settings.SIM_MAX_WEB_STEPS)
        except ScenarioError as exc:
            field = "what_if" if "what_if" in data.validated_data else "scenario"
            return Response(
                {
                    "detail": _("The scenario is not valid; the errors say where and why."),
                    "errors": {field: exc.problems},
                },
                status=status.HTTP_400_BAD_REQUEST,
            )
        return Response(report)
