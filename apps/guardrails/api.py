"""/api/v1/guardrails: the policies, each as it is set (see apps.guardrails.services), with what
its rules did in the last 24 hours; administrators set and remove them."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext, gettext_lazy
from drf_spectacular.utils import OpenApiResponse, OpenApiTypes, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsStaffReader
from apps.guardrails import services
from apps.guardrails.models import Policy
from apps.guardrails.serializers import PolicyInput, PolicyReplaceInput
from llmgw.api import ErrorSerializer
from llmgw.api_serializers import read_body
from llmgw.http import client_address


def _error(text: Any) -> OpenApiResponse:
    return OpenApiResponse(ErrorSerializer, description=text)


def _counted(policies: list[Policy]) -> list[dict[str, Any]]:
    from apps.guardrails.selectors import action_counts

    counts = action_counts()
    return [{**services.policy_dict(p), "counts": counts.get(p.name, {})} for p in policies]


def _set(request: Request, data: Any) -> Response:
    existed = isinstance(data, dict) and Policy.objects.filter(name=str(data.get("name") or "").strip()).exists()
    policy = services.set_policy(data, actor=request.user, address=client_address(request))
    return Response(_counted([policy])[0], status=200 if existed else 201)


class PoliciesView(APIView):
    """Every policy (GET), with `counts`: what its rules did in the last 24 hours, by action; set one
    (POST the policy: its name, where it applies, its rules in order; one of that name is replaced)."""

    permission_classes = [IsStaffReader]

    @extend_schema(operation_id="guardrails_list", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response({"results": _counted(list(Policy.objects.all()))})

    @extend_schema(
        request=PolicyInput,
        responses={
            200: OpenApiTypes.OBJECT,
            201: OpenApiTypes.OBJECT,
            400: _error(gettext_lazy("The policy is not valid; the errors say where and why.")),
        },
    )
    def post(self, request: Request) -> Response:
        return _set(request, read_body(PolicyInput, request))


class PolicyView(APIView):
    """One policy (GET), replaced whole (PUT, its name from the path) or removed (DELETE)."""

    permission_classes = [IsStaffReader]

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 404: _error(gettext_lazy("No policy of that name."))})
    def get(self, request: Request, name: str) -> Response:
        policy = Policy.objects.filter(name=name).first()
        if policy is None:
            return Response({"detail": gettext("No policy “%(name)s”.") % {"name": name}}, status=404)
        return Response(_counted([policy])[0])

    @extend_schema(
        request=PolicyReplaceInput,
        responses={
            200: OpenApiTypes.OBJECT,
            201: OpenApiTypes.OBJECT,
            400: _error(gettext_lazy("The policy is not valid; the errors say where and why.")),
        },
    )
    def put(self, request: Request, name: str) -> Response:
        refused = gettext("A policy is a JSON object: its fields and rules.")
        data = read_body(PolicyReplaceInput, request, context={"not_an_object": refused})
        return _set(request, {**data, "name": name})

    @extend_schema(responses={204: None, 404: _error(gettext_lazy("No policy of that name."))})
    def delete(self, request: Request, name: str) -> Response:
        try:
            services.delete_policy(name, actor=request.user, address=client_address(request))
        except services.PolicyError:
            return Response({"detail": gettext("No policy “%(name)s”.") % {"name": name}}, status=404)
        return Response(status=204)
