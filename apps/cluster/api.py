"""REST endpoints for nodes and agent enrollment."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.utils import timezone
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiResponse, OpenApiTypes, extend_schema, extend_schema_field, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.throttling import AnonRateThrottle
from rest_framework.views import APIView

from apps.accounts import audit
from apps.accounts.access import IsOperator, public
from apps.cluster import actions, agent_requests, enrolment, selectors
from apps.cluster import engines as engine_choices
from apps.cluster.choices import NodeStatus
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import AgentRequest, EngineChoice, EngineRelease, Gpu, Node
from apps.cluster.onboarding import agent_yaml, install_command
from llmgw.api import ErrorSerializer
from llmgw.api_serializers import StrictCharField, read_body
from llmgw.http import client_address
from llmgw.ids import parse_id

__all__ = [
    "AgentEnrollView",
    "EngineChoicesView",
    "EngineRefreshView",
    "EngineRemoveView",
    "EngineSerializer",
    "NodeEnrollmentView",
    "NodeViewSet",
    "node_summary",
]


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
        "gpus_healthy": sum(1 for gpu in node.gpus.all() if gpu.healthy and gpu.parent_index is None),  # cards
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
    location = serializers.SerializerMethodField(
        help_text=_(
            "Site, room, row, rack and PDU from the llmgw.io/ labels (the stored ones over the agent's); "
            "null where the node does not say."
        )
    )
    draining = serializers.SerializerMethodField()
    engines = serializers.SerializerMethodField(
        help_text=_("The engines the node has, with their versions; empty when it has none, null when it never said.")
    )
    engine_status = serializers.SerializerMethodField(
        help_text=_(
            "Per engine, what its install on the node is doing, in the node's words "
            "(“installing: downloading … (16 MB, 40 %)”, “failed: …”); empty when nothing is under way."
        )
    )
    # Unreachable as soon as its heartbeats are stale, whether or not the scheduler marked it yet.
    status = serializers.ChoiceField(choices=NodeStatus.choices, source="live_status", read_only=True)

    class Meta:
        model = Node
        fields = [
            "name",
            "labels",
            "location",
            "status",
            "cordoned",
            "cordon_reason",
            "draining",
            "agent_version",
            "features",
            "engines",
            "engine_status",
            "disabled_engines",
            "engine_build",
            "warnings",
            "created_at",
            "registered_at",
            "last_seen_at",
            "summary",
        ]

    def get_location(self, row: Node) -> dict[str, str | None]:
        return EXTENSIONS.node_location(row)

    def get_draining(self, node: Node) -> bool:
        return node.drain_requested_at is not None

    @extend_schema_field(EngineSerializer(many=True, allow_null=True))
    def get_engines(self, node: Node) -> list[dict[str, Any]] | None:
        engines = selectors.node_engines(node)
        if engines is None:
            return None
        return [{"name": engine.name, "version": engine.version} for engine in engines]

    @extend_schema_field(serializers.DictField(child=serializers.CharField()))
    def get_engine_status(self, node: Node) -> dict[str, str]:
        return selectors.node_engine_status(node)

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
        # The schema says an object, the agent's sample as it is (open to the keys a newer agent adds).
        return cast("dict[str, Any] | None", node.fresh_sample())

    @extend_schema_field(DrainStatusSerializer(allow_null=True))
    def get_drain(self, node: Node) -> dict[str, Any] | None:
        return actions.drain_status(node)


class CordonSerializer(serializers.Serializer[Any]):
    reason = serializers.CharField(max_length=500)


class DrainSerializer(serializers.Serializer[Any]):
    grace = serializers.IntegerField(
        min_value=0,
        max_value=3600,
        required=False,
        allow_null=True,
        help_text=_(
            "Seconds the engines stopped run on for the requests in flight, each stopped as soon as it "
            "is idle (the server's LLMGW_DRAIN_GRACE_SECONDS when left out)."
        ),
    )
    force = serializers.BooleanField(
        required=False, default=False, help_text=_("Stop replicas that cannot be placed elsewhere anyway.")
    )


class EngineBuildSerializer(serializers.Serializer[Any]):
    build = serializers.ChoiceField(
        choices=Node.EngineBuild.choices, help_text=_("Which CUDA build of vLLM and SGLang the node installs.")
    )


class NodeEnginesSerializer(serializers.Serializer[Any]):
    disable = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(engine_choices.ENGINE_REPOS)), required=False, default=list
    )
    enable = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(engine_choices.ENGINE_REPOS)), required=False, default=list
    )


_LABEL_KEY = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,99}$", max_length=100)


class LabelsSerializer(serializers.Serializer[Any]):
    set = serializers.DictField(
        child=serializers.CharField(max_length=256, allow_blank=False),
        required=False,
        default=dict,
        help_text=_("Labels to keep on the node, over what its agent says (llmgw.io/rack: r12)."),
    )
    remove = serializers.ListField(
        child=serializers.CharField(max_length=100),
        required=False,
        default=list,
        help_text=_("Stored labels to drop (the agent's own, if it says one, then shows again)."),
    )

    def validate_set(self, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            _LABEL_KEY.run_validation(key)
        return value


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
        node = actions.cordon_node(
            self.get_object(),
            reason=data.validated_data["reason"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=LabelsSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def labels(self, request: Request, name: str | None = None) -> Response:
        data = LabelsSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = actions.set_labels(
            self.get_object(),
            set_labels=data.validated_data["set"],
            remove=data.validated_data["remove"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=None, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def uncordon(self, request: Request, name: str | None = None) -> Response:
        node = actions.uncordon_node(self.get_object(), actor=request.user, address=self._address())  # type: ignore[arg-type]
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=DrainSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, name: str | None = None) -> Response:
        """Cordon the node and move its replicas elsewhere, each replaced before it is stopped;
        `uncordon` ends a drain."""
        data = DrainSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = actions.drain_node(
            self.get_object(),
            grace=data.validated_data.get("grace"),
            force=data.validated_data["force"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=NodeEnginesSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def engines(self, request: Request, name: str | None = None) -> Response:
        """Keep engines off this node (`disable`), or let them back (`enable`)."""
        data = NodeEnginesSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = actions.set_disabled_engines(
            self.get_object(),
            disable=data.validated_data["disable"],
            enable=data.validated_data["enable"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=EngineBuildSerializer, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"], url_path="engine-build")
    def engine_build(self, request: Request, name: str | None = None) -> Response:
        """Choose which CUDA build of vLLM and SGLang this node installs: `auto` (the best its driver
        and GPUs allow), `cu13`, `cu129`, or `none`."""
        data = EngineBuildSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        node = actions.set_engine_build(
            self.get_object(),
            data.validated_data["build"],
            actor=request.user,  # type: ignore[arg-type]
            address=self._address(),
        )
        return Response(NodeDetailSerializer(node).data)

    @extend_schema(request=None, responses=NodeDetailSerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, name: str | None = None) -> Response:
        node = actions.revoke_node(self.get_object(), actor=request.user, address=self._address())  # type: ignore[arg-type]
        return Response(NodeDetailSerializer(node).data)


class EnrollmentRequestSerializer(serializers.Serializer[Any]):
    name = serializers.CharField(max_length=63)
    labels = serializers.DictField(child=serializers.CharField(max_length=256), required=False)
    expires_in_seconds = serializers.IntegerField(min_value=60, max_value=7 * 24 * 3600, required=False)
    disabled_engines = serializers.ListField(
        child=serializers.ChoiceField(choices=sorted(engine_choices.ENGINE_REPOS)),
        required=False,
        default=list,
        help_text=_("Engines this node must not install or run."),
    )

    def validate_name(self, value: str) -> str:
        try:
            return enrolment.validate_node_name(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None


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
                    "install_command": serializers.CharField(),
                },
            )
        },
    )
    def post(self, request: Request) -> Response:
        data = EnrollmentRequestSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        seconds = data.validated_data.get("expires_in_seconds") or settings.AGENT_ENROLLMENT_TTL
        labels = data.validated_data.get("labels") or {}
        new = enrolment.create_enrollment(
            data.validated_data["name"],
            labels=labels,
            expires_in=timedelta(seconds=seconds),
            disabled_engines=data.validated_data["disabled_engines"],
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
                "install_command": install_command(server, new.secret),
            },
            status=status.HTTP_201_CREATED,
        )


class EnrollThrottle(AnonRateThrottle):
    rate = "30/min"


class EnrollRequestSerializer(serializers.Serializer[Any]):
    token = StrictCharField(help_text=_("The one-time enrollment token (llmgwe_...) the node was given."))


class AgentEnrollView(APIView):
    """An agent trades its one-time token for the node credential. No session or key."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]
    throttle_classes = [EnrollThrottle]

    @extend_schema(
        request=EnrollRequestSerializer,
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
        refused = _('Send the enrollment token as {"token": "llmgwe_..."}.')
        data = read_body(EnrollRequestSerializer, request, detail=str(refused))
        node, credential = enrolment.enroll_node(data["token"], address=client_address(request))
        return Response({"node": node.name, "credential": credential, "enrolled_at": timezone.now()})


# Engines ----------------------------------------------------------------------------------------


class EngineChoiceSerializer(serializers.ModelSerializer[EngineChoice]):
    engine = serializers.ChoiceField(choices=sorted(engine_choices.ENGINE_REPOS))
    version = serializers.CharField(
        max_length=64, help_text=_("A release tag (llama.cpp: b10991), or “none” to keep the engine off.")
    )
    match = serializers.CharField(
        max_length=300,
        required=False,
        allow_blank=True,
        default="",
        help_text=_("The GPU class, the label as key=value, or the node name; empty for every node."),
    )

    class Meta:
        model = EngineChoice
        fields = ["engine", "version", "scope", "match", "updated_at"]
        read_only_fields = ["updated_at"]
        validators: list[Any] = []  # POST sets a rule, whether or not one exists for the same nodes


class EngineReleaseSerializer(serializers.ModelSerializer[EngineRelease]):
    assets = serializers.SerializerMethodField()

    class Meta:
        model = EngineRelease
        fields = ["engine", "version", "fetched_at", "tried_at", "error", "assets"]

    @extend_schema_field(serializers.IntegerField())
    def get_assets(self, release: EngineRelease) -> int:
        return len(release.assets or [])


class EngineOverviewSerializer(serializers.Serializer[Any]):
    defaults = serializers.DictField(child=serializers.CharField())
    choices = EngineChoiceSerializer(many=True)
    releases = EngineReleaseSerializer(many=True)


class EngineRemoveSerializer(serializers.Serializer[Any]):
    engine = serializers.ChoiceField(choices=sorted(engine_choices.ENGINE_REPOS))
    scope = serializers.ChoiceField(choices=EngineChoice.Scope.choices, default=EngineChoice.Scope.ALL)
    match = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")


def _overview() -> dict[str, Any]:
    return {
        "defaults": engine_choices.DEFAULT_VERSIONS,
        "choices": EngineChoiceSerializer(EngineChoice.objects.all(), many=True).data,
        "releases": EngineReleaseSerializer(EngineRelease.objects.all(), many=True).data,
    }


class EngineChoicesView(APIView):
    """Which engine versions the nodes should have: the rules, and the releases read for them.

    GET lists them; POST sets one rule (the most specific rule that matches a node wins: node,
    label, GPU class, every node; without one, `defaults`)."""

    permission_classes = [IsOperator]

    @extend_schema(responses=EngineOverviewSerializer)
    def get(self, request: Request) -> Response:
        return Response(_overview())

    @extend_schema(request=EngineChoiceSerializer, responses=EngineOverviewSerializer)
    def post(self, request: Request) -> Response:
        data = EngineChoiceSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        engine_choices.set_choice(
            data.validated_data["engine"],
            data.validated_data["version"],
            data.validated_data.get("scope", EngineChoice.Scope.ALL),
            data.validated_data.get("match", ""),
            actor=request.user,
            address=client_address(request),
        )
        return Response(_overview())


class EngineRemoveView(APIView):
    """Remove one engine rule; the nodes it picked fall back to the next that matches them."""

    permission_classes = [IsOperator]

    @extend_schema(
        request=EngineRemoveSerializer,
        responses={
            200: EngineOverviewSerializer,
            404: OpenApiResponse(ErrorSerializer, description=_("No such rule.")),
        },
    )
    def post(self, request: Request) -> Response:
        data = EngineRemoveSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        removed = engine_choices.remove_choice(
            data.validated_data["engine"],
            data.validated_data["scope"],
            data.validated_data["match"],
            actor=request.user,
            address=client_address(request),
        )
        if not removed:
            return Response({"detail": _("No such engine rule.")}, status=status.HTTP_404_NOT_FOUND)
        return Response(_overview())


class EngineRefreshView(APIView):
    """Read the engine releases the nodes want now, instead of at the worker's next pass."""

    permission_classes = [IsOperator]

    @extend_schema(request=None, responses=EngineOverviewSerializer)
    def post(self, request: Request) -> Response:
        for engine, version in sorted(engine_choices.wanted_versions()):
            release = EngineRelease.objects.filter(engine=engine, version=version).first()
            if release is None or release.fetched_at is None:
                engine_choices.fetch_release(engine, version)
        engine_choices.nodes_changed(None)
        return Response(_overview())


@public
def engine_file(request: HttpRequest, name: str) -> HttpResponseBase:
    """An engine archive the control plane holds, for its nodes (their credential as a Bearer
    token) and its staff; the node checks it against the release's digest as it would GitHub's."""
    from django.http import FileResponse, JsonResponse

    if not enrolment.node_or_staff(request):
        return JsonResponse({"detail": str(_("A node credential is needed to fetch engine files."))}, status=401)
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"detail": str(_("Only GET and HEAD."))}, status=405)
    path = engine_choices.held_file(name)
    if path is None:
        return JsonResponse(
            {"detail": str(_("The control plane holds no engine file named %(name)s.") % {"name": name})}, status=404
        )
    return FileResponse(open(path, "rb"), as_attachment=True, filename=name)  # noqa: SIM115 - closed by the response


def _request_row(row: Any) -> dict[str, Any]:
    return {
        "id": row.pk,
        "node": row.node.name,
        "kind": row.kind,
        "params": row.params,
        "state": row.state,
        "error": row.error,
        "group": row.group,
        "retry_of": row.retry_of_id,
        "created_at": row.created_at.isoformat(),
        "sent_at": row.sent_at.isoformat() if row.sent_at else None,
        "answered_at": row.answered_at.isoformat() if row.answered_at else None,
        "result": row.result,
    }


class AgentRequestsView(APIView):
    """Requests sent to agents (fabric maps, bandwidth tests), newest first: pending, sent, answered,
    failed or timed out, with the answer or the error. Filter with ?node=, ?kind=, ?state=, ?group=."""

    permission_classes = [IsOperator]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        rows = AgentRequest.objects.select_related("node")
        for name in ("kind", "state", "group"):
            if request.query_params.get(name):
                rows = rows.filter(**{name: request.query_params[name]})
        if request.query_params.get("node"):
            rows = rows.filter(node__name=request.query_params["node"])
        return Response({"results": [_request_row(r) for r in rows[:200]]})


class AgentRequestRetryView(APIView):
    """POST: the same request again, as a new row (a failed or timed-out one)."""

    permission_classes = [IsOperator]

    @extend_schema(
        request=None,
        responses={
            202: OpenApiTypes.OBJECT,
            404: OpenApiResponse(ErrorSerializer, description=_("No such request.")),
            409: OpenApiResponse(ErrorSerializer, description=_("It is still waiting, or its node cannot be asked.")),
        },
    )
    def post(self, request: Request, pk: str) -> Response:
        number = parse_id(pk, AgentRequest)
        row = AgentRequest.objects.select_related("node").filter(pk=number).first() if number else None
        if row is None:
            return Response({"detail": _("No such request.")}, status=status.HTTP_404_NOT_FOUND)
        with transaction.atomic():  # an operator's request to a node (a fabric map, a test rail): audited
            again = agent_requests.retry(row)
            audit.record(
                request.user,  # type: ignore[arg-type]
                "agent_request.retry",
                again,
                address=client_address(request),
                node=again.node.name,
                kind=again.kind,
                retry_of=row.pk,
            )
        return Response(_request_row(again), status=status.HTTP_202_ACCEPTED)
