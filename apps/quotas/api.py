"""REST endpoints for usage, single requests, rate limits and capacity quotas."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, status, viewsets
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import CanChangeLimits, IsSignedIn
from apps.quotas import selectors, services
from apps.quotas.choices import UsageGroup
from apps.quotas.models import LIMIT_FIELDS, CapacityQuota, RateLimit, UsageRecord
from llmgw.http import client_address
from llmgw.ids import MAX_ID, parse_id

__all__ = ["CapacityQuotaViewSet", "RateLimitViewSet", "RequestView", "UsageView"]

DEFAULT_RANGE = timedelta(hours=24)


# Usage ----------------------------------------------------------------------------------


class UsageQuerySerializer(serializers.Serializer[Any]):
    group_by = serializers.ChoiceField(choices=UsageGroup.choices, default=UsageGroup.MODEL)
    since = serializers.DateTimeField(required=False)
    until = serializers.DateTimeField(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs["until"] = attrs.get("until") or timezone.now()
        attrs["since"] = attrs.get("since") or attrs["until"] - DEFAULT_RANGE
        if attrs["since"] >= attrs["until"]:
            raise serializers.ValidationError({"since": [_("The start must be before the end.")]})
        return attrs


@extend_schema_field({"oneOf": [{"type": "integer"}, {"type": "string"}], "nullable": True})
class UsageGroupField(serializers.Field):  # type: ignore[type-arg]
    """Only for the schema: a row's group is an id (organisation, team, project, key, person), a
    model's name when grouped by model, and null for requests outside any group."""


# Only for the schema: "errors" and "label" cannot be attributes of a serializer class.
USAGE_ROW = inline_serializer(
    "UsageRow",
    {
        "group": UsageGroupField(help_text="The group's id, or the model's name; null for none"),
        "label": serializers.CharField(),
        "requests": serializers.IntegerField(),
        "errors": serializers.IntegerField(help_text="the same as server_errors, kept for older clients"),
        "server_errors": serializers.IntegerField(
            help_text="status 500 and above, or an answer that broke after it began"
        ),
        "client_errors": serializers.IntegerField(
            allow_null=True,
            help_text="status 400 to 499 other than 429 (a model that does not exist, a bad body, a "
            "client that went away); null when part of the range was recorded before client errors were counted",
        ),
        "refusals": serializers.IntegerField(help_text="status 429: refused by a limit"),
        "prompt_tokens": serializers.IntegerField(allow_null=True, help_text="null when no request had token counts"),
        "completion_tokens": serializers.IntegerField(allow_null=True),
        "requests_without_tokens": serializers.IntegerField(help_text="requests missing from the token sums"),
        "gpu_hours": serializers.DictField(
            child=serializers.FloatField(),
            allow_null=True,
            help_text="GPU-hours the group's replicas held, by GPU class, over the range's whole hours; "
            "null where held time is not counted (per key or person) or not visible to the caller",
        ),
        "core_hours": serializers.FloatField(
            allow_null=True, help_text="core-hours held by the group's replicas that hold no GPU; null as gpu_hours"
        ),
        "watt_hours": serializers.FloatField(
            allow_null=True,
            help_text="energy the held cards (and CPU shards' share of RAPL) drew; null unless all was measured",
        ),
        "tokens_per_gpu_hour": serializers.FloatField(
            allow_null=True, help_text="tokens served (prompt and completion) per GPU-hour held"
        ),
        "tokens_per_watt_hour": serializers.FloatField(allow_null=True, help_text="tokens served per watt-hour drawn"),
        **{
            f"{name}_ms_{q}": serializers.FloatField(
                allow_null=True,
                help_text="milliseconds, nearest-rank, within 1 % of the exact value; null when nothing was timed",
            )
            for name in ("first_token", "latency")
            for q in ("p50", "p95", "p99")
        },
        **{
            f"queue_ms_{q}": serializers.FloatField(
                allow_null=True,
                help_text="milliseconds a request waited in the gateway's queue for a slot (0 when it took a free "
                "one), nearest-rank, within 1 %; null when no request's wait is known",
            )
            for q in ("p50", "p99")
        },
    },
)


class UsageView(APIView):
    """Usage per group over a range (default the last 24 hours): requests, server errors, client
    errors, refusals, tokens, time-to-first-token and latency percentiles, and the median and 99th
    percentile of the wait for a slot. Requests for a model
    that does not exist are grouped under the model "-". Staff see everyone's, managers their
    branch's, everyone else their own."""

    permission_classes = [IsSignedIn]

    @extend_schema(
        parameters=[
            OpenApiParameter("group_by", str, enum=list(UsageGroup.values)),
            OpenApiParameter("since", str, description="ISO 8601; default 24 hours before `until`"),
            OpenApiParameter("until", str, description="ISO 8601; default now"),
        ],
        responses=inline_serializer(
            "Usage",
            {
                "group_by": serializers.CharField(),
                "since": serializers.DateTimeField(),
                "until": serializers.DateTimeField(),
                "period": serializers.CharField(),
                "results": serializers.ListField(child=USAGE_ROW),
                "guardrails": serializers.ListField(
                    child=serializers.DictField(),
                    help_text="per guardrail policy: the requests it refused, redacted, stopped or only logged",
                ),
            },
        ),
    )
    def get(self, request: Request) -> Response:
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        period = selectors.period_for(params["since"], params["until"])
        rows = selectors.usage_summary(
            request.user,  # type: ignore[arg-type]
            group_by=params["group_by"],
            since=params["since"],
            until=params["until"],
            period=period,
        )
        return Response(
            {
                "group_by": params["group_by"],
                "since": params["since"],
                "until": params["until"],
                "period": period,
                "results": [row.as_dict() for row in rows],
                "guardrails": selectors.guardrail_counts(
                    request.user,  # type: ignore[arg-type]
                    since=params["since"],
                    until=params["until"],
                ),
            }
        )


class UsageRecordSerializer(serializers.ModelSerializer[UsageRecord]):
    user = serializers.CharField(source="user.email", default=None, allow_null=True)
    api_key = serializers.SerializerMethodField()
    organization = serializers.CharField(source="organization.name", default=None, allow_null=True)
    team = serializers.CharField(source="team.name", default=None, allow_null=True)
    project = serializers.CharField(source="project.name", default=None, allow_null=True)

    class Meta:
        model = UsageRecord
        fields = [
            "request_id",
            "created_at",
            "user_id",
            "user",
            "api_key_id",
            "api_key",
            "organization_id",
            "organization",
            "team_id",
            "team",
            "project_id",
            "project",
            "model",
            "endpoint",
            "replica",
            "hardware",
            "stream",
            "prompt_tokens",
            "completion_tokens",
            "tokens_estimated",
            "first_token_ms",
            "total_ms",
            "queue_ms",
            "status",
            "error",
            "guardrail",
        ]

    def get_api_key(self, record: UsageRecord) -> str | None:
        key = record.api_key
        return f"{key.name} ({key.prefix}…)" if key is not None else None


class RequestView(APIView):
    """One request through the gateway, for its owner and for staff."""

    permission_classes = [IsSignedIn]

    @extend_schema(responses=UsageRecordSerializer)
    def get(self, request: Request, request_id: str) -> Response:
        record = selectors.get_request_for_user(request.user, request_id)  # type: ignore[arg-type]
        if record is None:
            raise NotFound(_("No such request."))
        return Response(UsageRecordSerializer(record).data)


# Rate limits ------------------------------------------------------------------------------


def _model_rules(candidate: Any, instance: Any, attrs: dict[str, Any], kept: tuple[str, ...]) -> dict[str, Any]:
    """Run the model's full_clean on the row as it would be saved: the stored row's `kept` fields
    (when it exists) with the new values on top. Its errors become the API's field errors."""
    if instance is not None:
        for name in kept:
            setattr(candidate, name, getattr(instance, name))
        candidate._state.adding = False  # so unique checks leave the row itself out
    for name, value in attrs.items():
        setattr(candidate, name, value)
    try:
        candidate.full_clean()
    except DjangoValidationError as exc:
        raise serializers.ValidationError(serializers.as_serializer_error(exc)) from None
    return attrs


class RateLimitSerializer(serializers.ModelSerializer[RateLimit]):
    scope = serializers.CharField(read_only=True)

    class Meta:
        model = RateLimit
        fields = ["id", "scope", "organization", "team", "project", "api_key", *LIMIT_FIELDS, "updated_at"]
        read_only_fields = ["id", "scope", "updated_at"]

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        if self.instance is not None:  # the owner is fixed once the limit exists
            for name in ("organization", "team", "project", "api_key"):
                fields[name].read_only = True
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # The model's own rules, so the API and the console refuse the same input.
        return _model_rules(
            RateLimit(),
            self.instance,
            attrs,
            ("id", "organization_id", "team_id", "project_id", "api_key_id", *LIMIT_FIELDS),
        )


class RateLimitChangeSerializer(RateLimitSerializer):
    """A limit as PUT and PATCH change it: its owner is fixed, and the schema says so."""

    class Meta(RateLimitSerializer.Meta):
        read_only_fields = [*RateLimitSerializer.Meta.read_only_fields, "organization", "team", "project", "api_key"]


#: The query parameters that narrow the list of limits to one owner's.
LIMIT_OWNERS = ("organization_id", "team_id", "project_id", "api_key_id")


@extend_schema_view(
    list=extend_schema(
        parameters=[
            OpenApiParameter(name, int, description=_("Only this owner's limits (an id).")) for name in LIMIT_OWNERS
        ]
    )
)
class RateLimitViewSet(viewsets.ModelViewSet[RateLimit]):
    """Rate limits and token budgets of organisations, teams, projects and keys.
    Staff may read; administrators and billing may change."""

    serializer_class = RateLimitSerializer
    permission_classes = [CanChangeLimits]

    def get_serializer_class(self) -> type[RateLimitSerializer]:
        return RateLimitChangeSerializer if self.action in ("update", "partial_update") else RateLimitSerializer

    def get_queryset(self) -> QuerySet[RateLimit]:
        limits = RateLimit.objects.order_by("pk")
        for name in LIMIT_OWNERS:
            raw = self.request.query_params.get(name)
            if raw is None:
                continue
            number = parse_id(raw)
            if number is None:
                message = gettext("Expected an id, a whole number from 1 to %(max)s; got “%(value)s”.") % {
                    "max": MAX_ID,
                    "value": raw[:40],
                }
                raise ValidationError({name: [message]})
            limits = limits.filter(**{name: number})
        return limits

    def perform_create(self, serializer: serializers.BaseSerializer[RateLimit]) -> None:
        serializer.instance = services.create_rate_limit(
            actor=self.request.user,  # type: ignore[arg-type]
            address=client_address(self.request),
            **serializer.validated_data,
        )

    def perform_update(self, serializer: serializers.BaseSerializer[RateLimit]) -> None:
        assert serializer.instance is not None
        changes = {k: v for k, v in serializer.validated_data.items() if k in LIMIT_FIELDS}
        serializer.instance = services.update_rate_limit(
            serializer.instance,
            actor=self.request.user,  # type: ignore[arg-type]
            address=client_address(self.request),
            **changes,
        )

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        services.delete_rate_limit(
            self.get_object(),
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


# Capacity quotas --------------------------------------------------------------------------


class CapacityQuotaSerializer(serializers.ModelSerializer[CapacityQuota]):
    owner = serializers.CharField(source="owner_key", read_only=True)

    class Meta:
        model = CapacityQuota
        fields = ["id", "owner", "organization", "team", "project", *services.QUOTA_FIELDS]
        read_only_fields = ["id", "owner"]

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        if self.instance is not None:  # the owner is fixed once the quota exists
            for name in services.QUOTA_OWNER_FIELDS:
                fields[name].read_only = True
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        # The model's own rules, so the API and the Django admin refuse the same input.
        return _model_rules(
            CapacityQuota(),
            self.instance,
            attrs,
            ("id", "organization_id", "team_id", "project_id", *services.QUOTA_FIELDS),
        )


class CapacityQuotaChangeSerializer(CapacityQuotaSerializer):
    """A quota as PUT and PATCH change it: its owner is fixed, and the schema says so."""

    class Meta(CapacityQuotaSerializer.Meta):
        read_only_fields = [*CapacityQuotaSerializer.Meta.read_only_fields, *services.QUOTA_OWNER_FIELDS]


class CapacityQuotaViewSet(viewsets.ModelViewSet[CapacityQuota]):
    """The most GPUs, cores, memory and replicas an organisation, team or project may hold.
    Staff may read; administrators and billing may change."""

    serializer_class = CapacityQuotaSerializer
    permission_classes = [CanChangeLimits]

    def get_serializer_class(self) -> type[CapacityQuotaSerializer]:
        return CapacityQuotaChangeSerializer if self.action in ("update", "partial_update") else CapacityQuotaSerializer

    def get_queryset(self) -> QuerySet[CapacityQuota]:
        return CapacityQuota.objects.order_by("pk")

    def perform_create(self, serializer: serializers.BaseSerializer[CapacityQuota]) -> None:
        serializer.instance = services.create_capacity_quota(
            actor=self.request.user,  # type: ignore[arg-type]
            address=client_address(self.request),
            **serializer.validated_data,
        )

    def perform_update(self, serializer: serializers.BaseSerializer[CapacityQuota]) -> None:
        assert serializer.instance is not None
        changes = {k: v for k, v in serializer.validated_data.items() if k in services.QUOTA_FIELDS}
        serializer.instance = services.update_capacity_quota(
            serializer.instance,
            actor=self.request.user,  # type: ignore[arg-type]
            address=client_address(self.request),
            **changes,
        )

    def destroy(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        services.delete_capacity_quota(
            self.get_object(),
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
        return Response(status=status.HTTP_204_NO_CONTENT)
