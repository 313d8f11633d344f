"""REST endpoints for models: declare (apply), inspect, explain, headroom, and change targets."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from apps.accounts.access import IsOperator
from apps.catalog import profile_fields, services
from apps.catalog.choices import CapacityClass
from apps.catalog.models import Model, Profile
from apps.cluster import model_selectors as selectors
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Replica, Shard
from apps.cluster.placement import EXPLAIN_NODES
from llmgw.api import ErrorSerializer
from llmgw.api_serializers import ServiceCheckedInput, read_body
from llmgw.http import client_address

__all__ = ["ModelViewSet", "ReplicaViewSet", "explain_model", "explain_placed", "headroom"]


class ProfileSerializer(serializers.ModelSerializer[Profile]):
    class Meta:
        model = Profile
        fields = ["name"]  # and every declared field (apps.catalog.profile_fields), below

    def get_field_names(self, declared_fields: Any, info: Any) -> list[str]:
        return ["name", *profile_fields.field_names()]


class ShardSerializer(serializers.ModelSerializer[Shard]):
    node = serializers.CharField(source="node.name")

    class Meta:
        model = Shard
        fields = [
            "rank",
            "node",
            "gpu_indices",
            "memory_bytes",
            "cpu_cores",
            "port",
            "state",
            "pid",
            "exit_code",
            "context_tokens",
            "log_tail",
            "message",
            "reported_at",
            "env",
        ]


class ReplicaSerializer(serializers.ModelSerializer[Replica]):
    model = serializers.CharField(source="model.name")
    profile = serializers.CharField(source="profile.name", default=None, allow_null=True)
    shards = ShardSerializer(many=True, read_only=True)

    class Meta:
        model = Replica
        fields = [
            "id",
            "model",
            "profile",
            "state",
            "above_minimum",
            "failures",
            "next_attempt_at",
            "message",
            "created_at",
            "placed_at",
            "ready_at",
            "stop_requested_at",
            "stop_reason",
            "drain_grace",
            "shards",
            "rejections",
        ]


class ModelSerializer(serializers.ModelSerializer[Model]):
    status = serializers.SerializerMethodField()
    capacity_class = serializers.CharField(source="effective_class")
    owner = serializers.SerializerMethodField()

    class Meta:
        model = Model
        fields = [
            "name",
            "capacity_class",
            "min_replicas",
            "max_replicas",
            "source",
            "fallbacks",
            "external_url",
            "external_model",
            "owner",
            "held_until",
            "load_replicas",
            "busy_at",
            "status",
        ]
        read_only_fields = ["load_replicas", "busy_at"]

    def get_status(self, model: Model) -> dict[str, Any]:
        return selectors.model_status(model)

    def get_owner(self, model: Model) -> dict[str, str | None]:
        return {
            "organization": model.organization.slug if model.organization else None,
            "team": model.team.slug if model.team else None,
            "project": model.project.slug if model.project else None,
        }


class ModelDetailSerializer(ModelSerializer):
    profiles = ProfileSerializer(many=True, read_only=True)
    replicas = ReplicaSerializer(many=True, read_only=True)

    class Meta(ModelSerializer.Meta):
        fields = [*ModelSerializer.Meta.fields, "external_api_key_file", "profiles", "replicas"]


def _errors(exc: ValidationError) -> dict[str, list[str]]:
    return exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}


def explain_nodes(value: str | None) -> int | None:
    """The `nodes` query parameter: a count (at least 1), or "all"; absent: EXPLAIN_NODES."""
    if value is None or value == "":
        return EXPLAIN_NODES
    if value == "all":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValidationError(gettext("nodes must be a number or all, not %(value)s") % {"value": value}) from None
    if count < 1:
        raise ValidationError(gettext("nodes must be at least 1, not %(value)s") % {"value": value})
    return count


def explain_model(model: Model, limit: int | None = EXPLAIN_NODES) -> list[dict[str, Any]]:
    """For each profile, each node and every reason it was refused; plus what placed replicas met.

    With a limit, that many nodes per profile are spelled out (those that fit first, best first)
    and the others counted: `more_fit`, and `more_refused` by reason with one example each."""
    from apps.cluster import placement
    from apps.cluster.inventory import build_inventory, replica_request

    inventory = build_inventory()
    request = replica_request(model)
    holders = set(inventory.weights_nodes(request.source))
    out = []
    for verdict in placement.explain(inventory, request, limit=limit):
        out.append(
            {
                "profile": verdict.profile.name,
                "priority": verdict.profile.priority,
                "fits": verdict.fits,
                # refusals of the whole profile: capacity quotas, no fabric with enough nodes, no node fits
                "reasons": [selectors.translate_reason(_rejection(r)) for r in verdict.reasons],
                "nodes": [
                    {
                        "node": n.node_name,
                        "fits": n.fits,
                        "score": n.score,
                        "scores": n.scores,
                        "weights": _weights_note(n, holders, request.source),
                        "reasons": [selectors.translate_reason(_rejection(r)) for r in n.reasons],
                        # what the placement plugins say of the node: its fabric and leaf
                        "notes": dict(n.notes),
                    }
                    for n in verdict.nodes
                ],
                "more_fit": verdict.more_fit,
                "more_refused": [
                    {"code": code, "count": count, "example": selectors.translate_reason(_rejection(example))}
                    for code, (count, example) in sorted(verdict.more_refused.items(), key=lambda item: -item[1][0])
                ],
            }
        )
    return out


EXPLAIN_PLACED = 20  # placed replicas explained one by one on the page and in the API; the rest are counted
PLACED_STATES = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.FAILED)


def explain_placed(model: Model) -> tuple[list[dict[str, Any]], int]:
    """Where each placed replica (starting, ready or failed) runs and why: its nodes as placement
    sees them with the replica's own claims released (so that what it holds is not counted against
    it), each node fitting it with its score and whether it holds the weights, or refusing it now
    with every reason (a node cordoned since, say). Its siblings' claims count, once. Also how many
    placed replicas were left out past EXPLAIN_PLACED."""
    from apps.cluster import placement
    from apps.cluster.inventory import build_inventory, replica_request

    placed = [r for r in model.replicas.all() if r.state in PLACED_STATES and r.shards.all()]
    if not placed:
        return [], 0
    inventory = build_inventory()
    out = []
    for replica in placed[:EXPLAIN_PLACED]:
        shards = sorted(replica.shards.all(), key=lambda s: s.rank)
        request = replica_request(model, replica)
        profile = next((p for p in request.profiles if p.id == replica.profile_id), None)
        if profile is None or any(s.node_id not in inventory.nodes for s in shards):
            out.append(_placed(replica, shards, [], [], holders=set(), source=request.source))
            continue
        without = inventory.copy()
        without.release(str(replica.pk))
        reasons, verdicts = placement.judge(without, request, profile, [s.node_id for s in shards])
        holders = set(without.weights_nodes(request.source))
        out.append(_placed(replica, shards, reasons, verdicts, holders=holders, source=request.source))
    return out, max(len(placed) - EXPLAIN_PLACED, 0)


def _placed(
    replica: Replica, shards: list[Any], reasons: list[Any], verdicts: list[Any], *, holders: set[int], source: str
) -> dict[str, Any]:
    by_node = {v.node_id: v for v in verdicts}
    nodes = []
    for shard in shards:
        verdict = by_node.get(shard.node_id)
        nodes.append(
            {
                "node": shard.node.name,
                "rank": shard.rank,
                # None: the node is gone from placement's view (revoked) or the profile was removed.
                "fits": verdict.fits if verdict is not None else None,
                "score": verdict.score if verdict is not None else None,
                "scores": verdict.scores if verdict is not None else None,
                "weights": _weights_note(verdict, holders, source) if verdict is not None else None,
                "reasons": [selectors.translate_reason(_rejection(r)) for r in verdict.reasons] if verdict else [],
                "notes": dict(verdict.notes) if verdict is not None else {},
            }
        )
    return {
        "replica": replica.pk,
        "state": replica.state,
        "profile": replica.profile.name if replica.profile is not None else None,
        "reasons": [selectors.translate_reason(_rejection(r)) for r in reasons],
        "nodes": nodes,
    }


def _weights_note(verdict: Any, holders: set[int], source: str) -> str | None:
    """For a node that fits: whether it holds the model's weights or must fetch them first."""
    if not verdict.fits or not source:
        return None
    return gettext("holds the weights") if verdict.node_id in holders else gettext("must fetch them")


def _rejection(rejection: Any) -> dict[str, Any]:
    return rejection.to_dict()  # type: ignore[no-any-return]


def headroom(model: Model) -> dict[str, int]:
    from apps.cluster import placement
    from apps.cluster.inventory import build_inventory, replica_request

    inventory = build_inventory()
    request = replica_request(model)
    return {
        "without_preemption": placement.headroom(inventory, request),
        "with_preemption": placement.headroom(inventory, request, preempt=True),
    }


class TargetSerializer(serializers.Serializer[Any]):
    min = serializers.IntegerField(min_value=0, max_value=services.MAX_REPLICAS, required=False)
    max = serializers.IntegerField(min_value=0, max_value=services.MAX_REPLICAS, required=False)


class ResourcesSerializer(serializers.Serializer[Any]):
    memory = serializers.CharField(
        required=False, max_length=32, help_text=_("e.g. 24GB, 512MiB, or a number of gigabytes")
    )
    cores = serializers.FloatField(min_value=0, max_value=services.MAX_CPU_CORES, required=False)
    profile = serializers.CharField(required=False, max_length=100)


class ClassSerializer(serializers.Serializer[Any]):
    capacity_class = serializers.ChoiceField(choices=CapacityClass.choices, source="class")


class ApplyRequestSerializer(ServiceCheckedInput):
    """Model specs, as in models.yaml, to create or update all at once."""

    models = serializers.ListField(
        child=serializers.DictField(), help_text=_("The specs, one per model: each states its whole declaration.")
    )
    dry_run = serializers.BooleanField(
        required=False, help_text=_("true: write nothing, and say field by field what an apply would change.")
    )

    def to_internal_value(self, data: Any) -> dict[str, Any]:
        """The specs as given (apply_models checks each, with the same words as for models.yaml; a bare
        list of specs is taken too) and whether this is a dry run (only `true` is)."""
        if isinstance(data, dict) and "dry_run" in data:
            return {"specs": {k: v for k, v in data.items() if k != "dry_run"}, "dry_run": data["dry_run"] is True}
        return {"specs": data, "dry_run": False}


class ModelViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet[Model]
):
    """Models and how they run. Staff read; administrators and operators change."""

    permission_classes = [IsOperator]
    lookup_field = "name"
    lookup_value_regex = "[A-Za-z0-9][A-Za-z0-9._:-]*"

    def get_queryset(self) -> QuerySet[Model]:
        return selectors.models_with_replicas()

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Model]]:
        return ModelDetailSerializer if self.action == "retrieve" else ModelSerializer

    @extend_schema(
        request=ApplyRequestSerializer,
        responses=inline_serializer(
            "ApplyAnswer",
            {"dry_run": serializers.BooleanField(), "results": serializers.ListField(child=serializers.DictField())},
        ),
    )
    @action(detail=False, methods=["post"])
    def apply(self, request: Request) -> Response:
        """Create or update models from specs (as in models.yaml). Idempotent; all or nothing. A spec
        states the model's whole declaration (what it leaves out takes its default). With
        `"dry_run": true` (or `?dry_run=1`) nothing is written and `changes` lists, field by field,
        [before, after] of what an apply would change."""
        body = read_body(ApplyRequestSerializer, request)
        dry_run = body["dry_run"] or request.query_params.get("dry_run", "").lower() in ("1", "true", "yes")
        results = services.apply_models(body["specs"], actor=request.user, dry_run=dry_run)  # type: ignore[arg-type]
        return Response(
            {
                "dry_run": dry_run,
                "results": [{"name": r.name, "outcome": r.outcome, "changes": r.changes} for r in results],
            }
        )

    def perform_destroy(self, instance: Model) -> None:
        """DELETE: no route serves the model from now on; its replicas stop with the engine stop
        grace and the model is gone once they have. Its usage history stays."""
        services.delete_model(
            instance,
            actor=self.request.user,  # type: ignore[arg-type]
            address=client_address(self.request),
        )

    @extend_schema(
        request=TargetSerializer,
        responses={
            200: ModelSerializer,
            409: OpenApiResponse(
                ErrorSerializer, description=_("That many always-running replicas would not fit, even with preemption.")
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def target(self, request: Request, name: str | None = None) -> Response:
        data = TargetSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = self.get_object()
        if data.validated_data.get("min") is not None:
            room = headroom(model)
            running = model.replicas.exclude(state="stopping").exclude(state="pending").count()
            need = data.validated_data["min"] - running
            if need > room["with_preemption"]:
                return Response(
                    {
                        "detail": gettext(
                            "Only %(fit)s more replicas of %(name)s fit (%(now)s without preemption); "
                            "%(min)s always-running would need %(need)s more."
                        )
                        % {
                            "fit": room["with_preemption"],
                            "name": model.name,
                            "now": room["without_preemption"],
                            "min": data.validated_data["min"],
                            "need": need,
                        }
                    },
                    status=status.HTTP_409_CONFLICT,
                )
        try:
            services.set_target(
                model,
                min_replicas=data.validated_data.get("min"),
                max_replicas=data.validated_data.get("max"),
                actor=request.user,  # type: ignore[arg-type]
            )
        except ValidationError as exc:
            return Response(
                {"detail": gettext("Invalid target."), "errors": _errors(exc)}, status=status.HTTP_400_BAD_REQUEST
            )
        return Response(ModelSerializer(self.get_queryset().get(pk=model.pk)).data)

    # The changed profiles, all of them: a plain list, never a page.
    @extend_schema(request=ResourcesSerializer, responses=ProfileSerializer(many=True))
    @action(detail=True, methods=["post"], pagination_class=None)
    def resources(self, request: Request, name: str | None = None) -> Response:
        data = ResourcesSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        memory = None
        if data.validated_data.get("memory") is not None:
            try:
                memory = services.parse_memory(data.validated_data["memory"])
            except ValueError:
                return Response(
                    {
                        "detail": gettext("Invalid input."),
                        "errors": {
                            "memory": [
                                gettext(
                                    "Expected a size such as 24GB, 512MiB or a number of gigabytes; got “%(value)s”."
                                )
                                % {"value": data.validated_data["memory"]}
                            ]
                        },
                    },
                    status=400,
                )
        try:
            profiles = services.set_resources(
                self.get_object(),
                memory_bytes=memory,
                cpu_cores=data.validated_data.get("cores"),
                profile_name=data.validated_data.get("profile"),
                actor=request.user,  # type: ignore[arg-type]
            )
        except ValidationError as exc:
            # named as this endpoint's fields, not the profile's columns
            names = {"memory_bytes": "memory", "cpu_cores": "cores"}
            errors = {names.get(field, field): messages for field, messages in _errors(exc).items()}
            return Response({"detail": gettext("Invalid resources."), "errors": errors}, status=400)
        return Response(ProfileSerializer(profiles, many=True).data)

    @extend_schema(request=ClassSerializer, responses=ModelSerializer)
    @action(detail=True, methods=["post"], url_path="class")
    def capacity_class(self, request: Request, name: str | None = None) -> Response:
        data = ClassSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        model = services.set_class(self.get_object(), data.validated_data["class"], actor=request.user)  # type: ignore[arg-type]
        return Response(ModelSerializer(self.get_queryset().get(pk=model.pk)).data)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "nodes",
                str,
                description="nodes spelled out per profile (the others counted), or all; default 200",
            )
        ],
        responses=inline_serializer(
            "Explain",
            {
                "model": serializers.CharField(),
                # Where each placed replica runs and why, its own claims not counted against it.
                "placed": serializers.ListField(child=serializers.DictField()),
                "more_placed": serializers.IntegerField(),
                # Where one more replica would go, every placed replica's claims counted.
                "profiles": serializers.ListField(child=serializers.DictField()),
                "replicas": serializers.ListField(child=serializers.DictField()),
            },
        ),
    )
    @action(detail=True, methods=["get"])
    def explain(self, request: Request, name: str | None = None) -> Response:
        model = self.get_object()
        try:
            limit = explain_nodes(request.query_params.get("nodes"))
        except ValidationError as exc:
            return Response({"detail": exc.messages[0], "errors": {"nodes": exc.messages}}, status=400)
        replicas = [
            {
                "id": r.pk,
                "state": r.state,
                "message": r.message,
                "rejections": [
                    {"profile": x.get("profile"), "node": x.get("node"), "reason": selectors.translate_reason(x)}
                    for x in r.rejections
                ],
            }
            for r in model.replicas.all()
        ]
        placed, more_placed = explain_placed(model)
        return Response(
            {
                "model": model.name,
                "placed": placed,
                "more_placed": more_placed,
                "profiles": explain_model(model, limit),
                "replicas": replicas,
            }
        )

    @extend_schema(
        responses=inline_serializer(
            "Headroom",
            {"without_preemption": serializers.IntegerField(), "with_preemption": serializers.IntegerField()},
        )
    )
    @action(detail=True, methods=["get"])
    def headroom(self, request: Request, name: str | None = None) -> Response:
        return Response(headroom(self.get_object()))


class ReplicaViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[Replica]):
    permission_classes = [IsOperator]
    serializer_class = ReplicaSerializer

    def get_queryset(self) -> QuerySet[Replica]:
        return Replica.objects.select_related("model", "profile").prefetch_related("shards__node")
