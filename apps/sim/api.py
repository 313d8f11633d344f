"""POST /api/v1/sim: queue a scenario (YAML text or its mapping) or a what-if question of the live
fleet for the worker, answered 202 with the run's id and URL; GET /api/v1/sim/<id>: the run's
state, and its report once it is done. Operators and administrators only: each sees their own
runs, an administrator every run."""

from __future__ import annotations

from typing import Any

from django.http import Http404
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import RulePermission
from apps.sim import runs
from apps.sim.models import SimRun
from apps.sim.service import WHAT_IF_KINDS, ScenarioError
from llmgw.api import ErrorSerializer

__all__ = ["SimRunView", "SimView", "Simulates"]


class Simulates(RulePermission):
    """Simulations take the worker's time and memory: administrators and operators run them and
    read their own."""

    read_rule = write_rule = "change_cluster"


class WhatIfSerializer(serializers.Serializer[Any]):
    kind = serializers.ChoiceField(choices=list(WHAT_IF_KINDS))
    name = serializers.CharField(max_length=200)
    min = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)


@extend_schema_field({"oneOf": [{"type": "string"}, {"type": "object", "additionalProperties": {}}]})
class ScenarioField(serializers.JSONField):
    """YAML text or its mapping (the serializer's validate says which it is not)."""


class SimRequestSerializer(serializers.Serializer[Any]):
    scenario = ScenarioField(required=False, help_text=gettext_lazy("The scenario: YAML text, or its mapping."))
    what_if = WhatIfSerializer(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("scenario" in attrs) == ("what_if" in attrs):
            raise serializers.ValidationError(_("Give scenario or what_if: one of them."))
        if "scenario" in attrs and not isinstance(attrs["scenario"], str | dict):
            raise serializers.ValidationError({"scenario": _("The scenario is YAML text or a mapping.")})
        if "what_if" in attrs and attrs["what_if"]["kind"] == "model" and "min" not in attrs["what_if"]:
            raise serializers.ValidationError({"what_if": _("A question about a model needs its new min.")})
        return attrs


class SimRunSerializer(serializers.ModelSerializer[SimRun]):
    url = serializers.SerializerMethodField(help_text=gettext_lazy("Where to ask for the run's state and report."))
    report = serializers.JSONField(
        allow_null=True, help_text=gettext_lazy("The report once the run is done (see the manual), else null.")
    )
    problems = serializers.ListField(
        child=serializers.CharField(), help_text=gettext_lazy("What the run found wrong with the scenario.")
    )

    class Meta:
        model = SimRun
        fields = [
            "id",
            "url",
            "state",
            "title",
            "error",
            "problems",
            "created_at",
            "started_at",
            "finished_at",
            "report",
        ]
        read_only_fields = fields

    def get_url(self, row: SimRun) -> str:
        return reverse("api-sim-run", kwargs={"pk": row.pk})


class SimView(APIView):
    """Queue a simulation: the reconciler's decisions on a simulated fleet, run by the worker;
    nothing of the real fleet changes."""

    permission_classes = [Simulates]

    @extend_schema(
        request=SimRequestSerializer,
        responses={
            202: SimRunSerializer,
            400: OpenApiResponse(
                ErrorSerializer,
                description=gettext_lazy(
                    "The scenario is not valid, or asks more than a run may have; the errors say where and why."
                ),
            ),
            429: OpenApiResponse(
                ErrorSerializer,
                description=gettext_lazy("The caller has as many simulations queued or running as one person may."),
            ),
        },
    )
    def post(self, request: Request) -> Response:
        data = SimRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        field = "what_if" if "what_if" in data.validated_data else "scenario"
        try:
            if field == "what_if":
                question = data.validated_data["what_if"]
                row = runs.ask_what_if(request.user, question["kind"], question["name"], question.get("min"))
            else:
                row = runs.ask(request.user, data.validated_data["scenario"])
        except ScenarioError as exc:  # the problems go under the field the request gave
            return Response(
                {
                    "detail": _("The scenario is not valid; the errors say where and why."),
                    "code": exc.code,
                    "errors": {field: exc.problems},
                },
                status=status.HTTP_400_BAD_REQUEST,
            )
        return Response(SimRunSerializer(row).data, status=status.HTTP_202_ACCEPTED)


class SimRunView(APIView):
    """One of the caller's simulations: queued, running, done (with its report) or failed (with why)."""

    permission_classes = [Simulates]

    @extend_schema(
        responses={
            200: SimRunSerializer,
            404: OpenApiResponse(
                ErrorSerializer, description=gettext_lazy("No simulation of the caller's by that id.")
            ),
        }
    )
    def get(self, request: Request, pk: int) -> Response:
        row = runs.run_for(request.user, pk)
        if row is None:
            raise Http404(_("No simulation %(id)s of yours.") % {"id": pk})
        return Response(SimRunSerializer(row).data)
