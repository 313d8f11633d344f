"""/api/v1/batches: every organisation's batches, for staff (the clients' own API is /v1/batches).

Staff who read everything list and read them (?status=, ?kind=, ?organization=); administrators and
operators may cancel one. Nobody else may use these endpoints (403): a member reads their own through
/v1/batches with their key, or on the console's Batches page.
"""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.access import IsOperator
from apps.batches import services
from apps.batches.choices import BatchStatus, Kind
from apps.batches.models import Batch
from llmgw.api import ErrorSerializer
from llmgw.ids import parse_id

__all__ = ["BatchSerializer", "BatchViewSet"]


class BatchSerializer(serializers.ModelSerializer[Batch]):
    organization_name = serializers.SerializerMethodField(help_text=_("null for a key without a project"))
    project_name = serializers.SerializerMethodField()
    owner = serializers.SerializerMethodField(help_text=_("the email of the key's owner"))
    percent = serializers.IntegerField(read_only=True, help_text=_("requests answered, in percent of all"))

    class Meta:
        model = Batch
        fields = [
            "id",
            "kind",
            "status",
            "endpoint",
            "model",
            "organization",
            "organization_name",
            "project",
            "project_name",
            "owner",
            "api_key",
            "total",
            "succeeded",
            "failed",
            "canceled",
            "expired",
            "percent",
            "prompt_tokens",
            "completion_tokens",
            "lines_without_tokens",
            "errors",
            "input_file",
            "output_file",
            "error_file",
            "created_at",
            "in_progress_at",
            "expires_at",
            "finalizing_at",
            "completed_at",
            "failed_at",
            "expired_at",
            "cancelling_at",
            "cancelled_at",
        ]
        read_only_fields = fields
        # Declared here, not as a field of the class: `errors` is the serializer's own attribute.
        extra_kwargs = {
            "errors": {"help_text": _("[{code, message, line, param}]: why it failed, or which lines failed alone")}
        }

    def get_organization_name(self, batch: Batch) -> str | None:
        return batch.organization.name if batch.organization else None

    def get_project_name(self, batch: Batch) -> str | None:
        return batch.project.name if batch.project else None

    def get_owner(self, batch: Batch) -> str:
        return batch.user.email


class BatchFilter(serializers.Serializer[Any]):
    status = serializers.ChoiceField(choices=BatchStatus.choices, required=False)
    kind = serializers.ChoiceField(choices=Kind.choices, required=False)
    organization = serializers.CharField(required=False)


class BatchViewSet(viewsets.ReadOnlyModelViewSet[Batch]):
    """Batches of every organisation, newest first."""

    serializer_class = BatchSerializer
    permission_classes = [IsOperator]

    def get_queryset(self) -> QuerySet[Batch]:
        rows = Batch.objects.select_related("organization", "project", "user").order_by("-created_at", "-id")
        if self.action != "list":
            return rows
        query = BatchFilter(data=self.request.query_params)
        query.is_valid(raise_exception=True)
        given = query.validated_data
        if "status" in given:
            rows = rows.filter(status=given["status"])
        if "kind" in given:
            rows = rows.filter(kind=given["kind"])
        if "organization" in given:
            org = parse_id(given["organization"])
            if org is None:
                raise ValidationError({"organization": [_("An organisation's id: a whole number.")]})
            rows = rows.filter(organization_id=org)
        return rows

    @extend_schema(
        parameters=[
            OpenApiParameter("status", str, enum=BatchStatus.values, description="only batches of this status"),
            OpenApiParameter("kind", str, enum=Kind.values, description="openai or anthropic"),
            OpenApiParameter("organization", int, description="only this organisation's"),
        ]
    )
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)

    @extend_schema(
        request=None,
        responses={
            200: BatchSerializer,
            409: OpenApiResponse(ErrorSerializer, description=_("The batch has ended: there is nothing to cancel.")),
        },
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Cancel a batch: no line is started any more; it is cancelled once those running have ended.
        A batch that has ended is refused (409)."""
        batch = self.get_object()
        batch = services.cancel_batch(None, batch, actor=request.user)  # type: ignore[arg-type]
        return Response(BatchSerializer(batch).data)
