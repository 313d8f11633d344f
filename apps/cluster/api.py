"""REST endpoints for nodes and agent enrollment."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from apps.accounts.access import IsOperator
from apps.cluster import selectors, services
from apps.cluster.choices import NodeStatus
from apps.cluster.models import Gpu, Node
from llmgw.api import ErrorSerializer
from llmgw.http import client_address

__all__ = ["AgentEnrollView", "EngineSerializer", "NodeEnrollmentView", "NodeViewSet", "node_summary"]


def node_summary(node: Node, now: Any = None) -> dict[str, Any]:
    """The figures `ctl nodes` and the API list show; None for whatever is unknown."""
    row = selectors.node_row(node, now or timezone.now())
    return {
        "cpus": row.cpus,
        "cpu_utilization_pct": row.cpu_pct,
        "memory_total_bytes": node.memory_total_bytes,
        "memory_used_bytes": row.memory_used,
        "gpu_count": row.gpu_count,
        "gpu_classes": sorted({name for _count, name in row.gpu_groups}),
        "gpus_healthy": sum(1 for gpu in node.gpus.all() if gpu.healthy),
        # local filesystems only; shared space belongs to every node that mounts it
        "disk_free_bytes": row.disk.local_free,
        "disk_total_bytes": row.disk.local_total,
        "shared_disk_free_bytes": row.disk.shared_free,
        "shared_disk_total_bytes": row.disk.shared_total,
        "warnings": row.warnings,
    }


class GpuSerializer(serializers.ModelSerializer[Gpu]):
    class Meta:
        model = Gpu
        fields = [
            "index",
            "uuid",
            "name",
            "gpu_class",
            "pci_bus_id",
            "memory_total_mib",
            "mig_mode",
            "ecc_fault",
            "foreign_processes",
        ]


class EngineSerializer(serializers.Serializer[Any]):
    name = serializers.CharField()
    version = serializers.CharField(allow_null=True, help_text=_("As the node reported it; null when it did not."))


class NodeSerializer(serializers.ModelSerializer[Node]):
    summary = serializers.SerializerMethodField()
    draining = serializers.SerializerMethodField()
    engines = serializers.SerializerMethodField(
        help_text=_("The engines the node has, with their versions; empty when it has none, null when it never said.")
    )
    # Unreachable as soon as its heartbeats are stale, whether or not the scheduler marked it yet.
    status = serializers.ChoiceField(choices=NodeStatus.choices, source="live_status", read_only=True)

    class Meta:
        model = Node
        fields = [
            "name",
            "labels",
            "status",
            "cordoned",
            "cordon_reason",
            "draining",
            "agent_version",
            "features",
            "engines",
            "warnings",
            "created_at",
            "registered_at",
            "last_seen_at",
            "summary",
        ]

    def get_draining(self, node: Node) -> bool:
        return node.drain_requested_at is not None

    @extend_schema_field(EngineSerializer(many=True, allow_null=True))
    def get_engines(self, node: Node) -> list[dict[str, Any]] | None:
        engines = selectors.node_engines(node)
        if engines is None:
            return None
        return [{"name": engine.name, "version": engine.version} for engine in engines]

    def get_summary(self, node: Node) -> dict[str, Any]:
        return node_summary(node)


class DrainReplicaSerializer(serializers.Serializer[Any]):
    replica = serializers.IntegerField()
    model = serializers.CharField()
    state = serializers.ChoiceField(choices=["moving", "queued"])
    reasons = serializers.ListField(child=serializers.CharField())


class DrainStatusSerializer(serializers.Serializer[Any]):
    requested_at = serializers.DateTimeField()
    grace = serializers.IntegerField(allow_null=True)
    force = serializers.BooleanField()
    left = serializers.IntegerField()
    replicas = DrainReplicaSerializer(many=True)


class NodeDetailSerializer(NodeSerializer):
    gpus = GpuSerializer(many=True, read_only=True)
    sample = serializers.SerializerMethodField()
    drain = serializers.SerializerMethodField()

    class Meta(NodeSerializer.Meta):
        fields = [*NodeSerializer.Meta.fields, "hardware", "gpus", "sample", "sampled_at", "drain"]

    def get_sample(self, node: Node) -> dict[str, Any] | None:
        return node.fresh_sample()

    @extend_schema_field(DrainStatusSerializer(allow_null=True))
    def get_drain(self, node: Node) -> dict[str, Any] | None:
        return services.drain_status(node)


class CordonSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(max_length=500)


class DrainSerializer(serializers.Serializer[Any]):
    grace = serializers.IntegerField(
        min_value=0,
        max_value=3600,
        required=False,
        allow_null=True,
        help_text=_("Seconds from SIGTERM to SIGKILL for the engines stopped."),
    )
    force = serializers.BooleanField(
        required=False, default=False, help_text=_("Stop replicas that cannot be placed elsewhere anyway.")
    )


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[Node]):
    """Nodes and what their agents last said. Unknown figures are null."""

    permission_classes = [IsOperator]
    lookup_field = "name"
    lookup_value_regex = "[a-z0-9.-]+"

    def get_queryset(self) -> QuerySet[Node]:
        return Node.objects.prefetch_related("gpus")

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Node]]:
        return NodeDetailSerializer if self.action == "retrieve" else NodeSerializer

    def _address(self) -> str | None:
        return client_address(self.request)

    @extend_schema(request=CordonSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def cordon(self, request: Request, name: str | None = None) -> Response:
        data = CordonSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = services.cordon_node(
            self.get_object(),
            reason=data.validated_data["reason"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=None, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, name: str | None = None) -> Response:
        node = services.uncordon_node(self.get_object(), actor=request.user, address=self._address())  # type: ignore[arg-type]
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=DrainSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, name: str | None = None) -> Response:
        """Cordon the node and move its replicas elsewhere, each replaced before it is stopped;
        `uncordon` ends a drain."""
        data = DrainSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = services.drain_node(
            self.get_object(),
            grace=data.validated_data.get("grace"),
            force=data.validated_data["force"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=None, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str | None = None) -> Response:
        node = services.revoke_node(self.get_object(), actor=request.user, address=self._address())  # type: ignore[arg-type]
        return Response(NodeDetailSerializer(node).data)


class EnrollmentRequestSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=63)
    labels = serializers.DictField(child=serializers.CharField(max_length=256), required=False)
    expires_in_seconds = serializers.IntegerField(min_value=60, max_value=7 * 24 * 3600, required=False)

    def validate_name(self, value: str) -> str:
        try:
            return services.validate_node_name(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


def agent_yaml(server: str, secret: str, labels: dict[str, str]) -> str:
    import yaml

    return yaml.safe_dump(
        {"server": server, "token": secret, "state_dir": "/var/lib/llmgw-agent", "labels": labels, "model_dirs": []},
        sort_keys=False,
    )


class NodeEnrollmentView(APIView):
    """Make a one-time token that lets one agent join as the named node."""

    permission_classes = [IsOperator]

    @extend_schema(
        request=EnrollmentRequestSerializer,
        responses={
            201: inline_serializer(
                "Enrollment",
                {
                    "node": serializers.CharField(),
                    "token": serializers.CharField(),
                    "expires_at": serializers.DateTimeField(),
                    "agent_yaml": serializers.CharField(),
                    "command": serializers.CharField(),
                },
            )
        },
    )
    def post(self, request: Request) -> Response:
        data = EnrollmentRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        seconds = data.validated_data.get("expires_in_seconds") or settings.AGENT_ENROLLMENT_TTL
        labels = data.validated_data.get("labels") or {}
        new = services.create_enrollment(
            data.validated_data["name"],
            labels=labels,
            expires_in=timedelta(seconds=seconds),
            actor=request.user,  # type: ignore[arg-type]
        )
        server = settings.PUBLIC_URL or request.build_absolute_uri("/").rstrip("/")
        return Response(
            {
                "node": new.token.node_name,
                "token": new.secret,
                "expires_at": new.token.expires_at,
                "agent_yaml": agent_yaml(server, new.secret, labels),
                "command": "llmgw agent --config /etc/llmgw/agent.yaml",
            },
            status=status.HTTP_201_CREATED,
        )


class EnrollThrottle(AnonRateThrottle):
    rate = "30/min"


class AgentEnrollView(APIView):
    """An agent trades its one-time token for the node credential. No session or key."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    throttle_classes = [EnrollThrottle]

    @extend_schema(
        request=inline_serializer("EnrollRequest", {"token": serializers.CharField()}),
        responses={
            200: inline_serializer(
                "EnrollAnswer",
                {
                    "node": serializers.CharField(),
                    "credential": serializers.CharField(),
                    "enrolled_at": serializers.DateTimeField(),
                },
            ),
            403: OpenApiResponse(ErrorSerializer, description=_("The token is unknown, used or expired.")),
        },
    )
    def post(self, request: Request) -> Response:
        token = request.data.get("token") if isinstance(request.data, dict) else None
        if not isinstance(token, str) or not token:
            return Response(
                {"detail": _('Send the enrollment token as {"token": "llmgwe_..."}.')},
                status=status.HTTP_400_BAD_REQUEST,
            )
        try:
            node, credential = services.enroll_node(token, address=client_address(request))
        except services.EnrollmentRefused as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_403_FORBIDDEN)
        return Response({"node": node.name, "credential": credential, "enrolled_at": timezone.now()})
