"""REST endpoints for the signed-in person, their API keys, and the organisation tree."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import Q, QuerySet
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts import people_services, services
from apps.accounts.access import CanChangeShares, IsSignedIn, IsStaffReader, StaffReadOnly, is_administrator
from apps.accounts.authentication import request_api_key
from apps.accounts.filters import AuditFilterForm, audit_events
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User
from apps.accounts.people_selectors import Branch, scope_for
from llmgw.http import client_address

__all__ = ["ApiKeyViewSet", "AuditEventViewSet", "MeView", "OrganizationViewSet", "ProjectViewSet", "TeamViewSet"]


# The signed-in person ------------------------------------------------------------------


class MembershipSerializer(serializers.ModelSerializer[Membership]):
    organization = serializers.CharField(source="organization.slug")
    team = serializers.CharField(source="team.slug", default=None, allow_null=True)
    project = serializers.CharField(source="project.slug", default=None, allow_null=True)

    class Meta:
        model = Membership
        fields = ["organization", "team", "project", "role"]


class MeSerializer(serializers.ModelSerializer[User]):
    memberships = MembershipSerializer(many=True, read_only=True)
    auth = serializers.SerializerMethodField()

    class Meta:
        model = User
        fields = ["id", "email", "name", "staff_role", "is_superuser", "memberships", "auth"]

    def get_auth(self, user: User) -> dict[str, Any]:
        key = request_api_key(self.context["request"])
        if key is None:
            return {"method": "session"}
        return {"method": "api_key", "key_id": key.pk, "key_name": key.name, "key_prefix": key.prefix}


class MeView(APIView):
    """Who the caller is: account, staff role, memberships and how they signed in."""

    permission_classes = [IsSignedIn]

    @extend_schema(responses=MeSerializer)
    def get(self, request: Request) -> Response:
        user = User.objects.prefetch_related(
            "memberships__organization", "memberships__team", "memberships__project"
        ).get(pk=request.user.pk)  # type: ignore[misc]  # IsSignedIn: a user with a primary key
        return Response(MeSerializer(user, context={"request": request}).data)


# Shares of a busy model: weights and bands ----------------------------------------------


def _parsed(parse: Any, name: str, data: Any) -> Any:
    try:
        return parse(data)
    except DjangoValidationError as error:
        raise serializers.ValidationError(error.message_dict[name]) from None


@extend_schema_field({"type": "integer", "minimum": people_services.WEIGHT_MIN, "maximum": people_services.WEIGHT_MAX})
class WeightField(serializers.Field):  # type: ignore[type-arg]
    """A weight from 1 to 1000, refused with the range (people_services.parse_weight) otherwise."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is None:  # refused in the same words as any other value that is not a weight
            _parsed(people_services.parse_weight, "weight", "null")
        return super().validate_empty_values(data)  # type: ignore[no-any-return]

    def to_internal_value(self, data: Any) -> int:
        return int(_parsed(people_services.parse_weight, "weight", data))

    def to_representation(self, value: Any) -> Any:
        return value


@extend_schema_field({"type": "string", "enum": ["interactive", "batch"]})
class BandField(serializers.Field):  # type: ignore[type-arg]
    """A band's name, refused with the names of the bands (people_services.parse_band) otherwise."""

    def validate_empty_values(self, data: Any) -> tuple[bool, Any]:
        if data is None:
            _parsed(people_services.parse_band, "band", "null")
        return super().validate_empty_values(data)  # type: ignore[no-any-return]

    def to_internal_value(self, data: Any) -> str:
        return str(_parsed(people_services.parse_band, "band", data))

    def to_representation(self, value: Any) -> Any:
        return value


class ShareSerializer(serializers.Serializer[Any]):
    """What a PATCH of …/share may set: the weight, and for a project or a key the highest band."""

    weight = WeightField(required=False, help_text="its share of a busy model against its siblings', 1 to 1000")
    band = BandField(required=False, help_text="the highest band its requests may use (projects and keys)")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if not attrs:
            raise serializers.ValidationError(_("Give a weight, a band or both."))
        return attrs


def _set_share(request: Request, target: Any) -> Any:
    """Apply a PATCH of …/share through people_services.set_share: 400 naming the field, 403 saying
    who may (DRF answers Django's PermissionDenied with 403)."""
    body = ShareSerializer(data=request.data)
    body.is_valid(raise_exception=True)
    try:
        return people_services.set_share(
            target,
            **body.validated_data,
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
    except DjangoValidationError as error:
        raise _as_field_errors(error) from None


def _within_reach(request: Request, kind: str, obj: Organization | Team | Project) -> None:
    """A branch outside everything the caller manages is not theirs to know of: 404, as for a missing one."""
    user = request.user
    if not is_administrator(user) and not scope_for(user).covers(Branch(kind, obj)):  # type: ignore[arg-type]
        raise NotFound()


# API keys ------------------------------------------------------------------------------


@extend_schema_field({"type": "array", "items": {"type": "string"}})
class ModelNamesField(serializers.JSONField):
    """A list of model names, checked by the serializer's validate_allowed_models (the JSON as sent,
    so that a number in it is refused rather than turned into a name)."""


class ApiKeySerializer(serializers.ModelSerializer[ApiKey]):
    state = serializers.SerializerMethodField()
    allowed_models = ModelNamesField(
        required=False, help_text=_("The models the key may use, by name; empty for every model.")
    )
    project = serializers.PrimaryKeyRelatedField(queryset=Project.objects.all(), required=False, allow_null=True)

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "project",
            "allowed_models",
            "created_at",
            "expires_at",
            "revoked_at",
            "last_used_at",
            "state",
            "weight",
            "band",
        ]
        read_only_fields = [
            "id",
            "prefix",
            "created_at",
            "revoked_at",
            "last_used_at",
            "state",
            "weight",
            "band",
        ]

    def get_state(self, key: ApiKey) -> str:
        return key.state()

    def validate_project(self, project: Project | None) -> Project | None:
        from apps.accounts.selectors import projects_for_user

        if project is not None and not projects_for_user(self.context["request"].user).filter(pk=project.pk).exists():
            raise serializers.ValidationError(_("You are not a member of this project."))
        return project

    def validate_allowed_models(self, value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            raise serializers.ValidationError(_("Expected a list of model names."))
        return value


def _managed_keys(user: Any) -> Q:
    """The keys whose weights `user` may set: every key for an administrator, else those of the
    projects under a branch they manage."""
    if is_administrator(user):
        return Q(pk__isnull=False)
    scope = scope_for(user)
    return (
        Q(project__team__organization_id__in=scope.org_ids)
        | Q(project__team_id__in=scope.team_ids)
        | Q(project_id__in=scope.project_ids)
    )


class NewApiKeySerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The whole key. Shown once; only its hash is stored.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet[ApiKey]):
    """Your own API keys: create (the key is shown once), list, revoke."""

    serializer_class = ApiKeySerializer
    # Anyone signed in, viewers too: the queryset holds only the caller's own keys.
    permission_classes = [IsSignedIn]

    def get_queryset(self) -> QuerySet[ApiKey]:
        if getattr(self, "swagger_fake_view", False):  # the schema, built without a caller
            return ApiKey.objects.none()
        user = self.request.user
        mine = Q(user=user)
        if self.action == "share":  # and the keys of the projects the caller manages, all for administrators
            mine |= _managed_keys(user)
        return ApiKey.objects.filter(mine, is_session_key=False).select_related("project__team__organization")

    @extend_schema(request=ShareSerializer, responses=ApiKeySerializer)
    @action(detail=True, methods=["patch"])
    def share(self, request: Request, pk: str | None = None) -> Response:
        """Set a key's weight and highest band: its owner may lower its band; administrators and the
        managers of its project, team or organisation may set either, never its band above its project's."""
        key = _set_share(request, self.get_object())
        return Response(ApiKeySerializer(key, context={"request": request}).data)

    @extend_schema(request=ApiKeySerializer, responses={201: NewApiKeySerializer})
    def create(self, request: Request) -> Response:
        serializer = ApiKeySerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        new = services.create_api_key(
            request.user,  # type: ignore[arg-type]
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
            **serializer.validated_data,
        )
        data = NewApiKeySerializer(new.key, context={"request": request}).data
        data["key"] = new.secret
        return Response(data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiKeySerializer)
    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, pk: str | None = None) -> Response:
        key = services.revoke_api_key(
            self.get_object(),
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
        return Response(ApiKeySerializer(key, context={"request": request}).data)

    @extend_schema(request=None, responses={204: None})
    def destroy(self, request: Request, pk: str | None = None) -> Response:
        services.revoke_api_key(
            self.get_object(),
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
        return Response(status=status.HTTP_204_NO_CONTENT)


# The organisation tree (staff) ----------------------------------------------------------


def _as_field_errors(error: DjangoValidationError) -> serializers.ValidationError:
    """A refusal from accounts.services (a name's rules) as the API's 400 naming the field."""
    if hasattr(error, "error_dict"):
        return serializers.ValidationError(error.message_dict)
    return serializers.ValidationError({"name": error.messages})


class OrganizationSerializer(serializers.ModelSerializer[Organization]):
    slug = serializers.SlugField(required=False, allow_blank=True, max_length=100)

    class Meta:
        model = Organization
        fields = ["id", "name", "slug", "created_at", "weight"]
        read_only_fields = ["id", "created_at", "weight"]


class TeamSerializer(serializers.ModelSerializer[Team]):
    slug = serializers.SlugField(required=False, allow_blank=True, max_length=100)

    class Meta:
        model = Team
        fields = ["id", "organization", "name", "slug", "created_at", "weight"]
        read_only_fields = ["id", "created_at", "weight"]
        validators: list[Any] = []


class ProjectSerializer(serializers.ModelSerializer[Project]):
    slug = serializers.SlugField(required=False, allow_blank=True, max_length=100)

    class Meta:
        model = Project
        fields = ["id", "team", "name", "slug", "created_at", "weight", "band"]
        read_only_fields = ["id", "created_at", "weight", "band"]
        validators: list[Any] = []


class OrganizationViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet[Organization]):
    queryset = Organization.objects.all()
    serializer_class = OrganizationSerializer
    permission_classes = [IsStaffReader]

    def perform_create(self, serializer: serializers.BaseSerializer[Organization]) -> None:
        data = serializer.validated_data
        if data.get("slug") and Organization.objects.filter(slug=data["slug"]).exists():
            raise serializers.ValidationError({"slug": [_("An organisation with this slug exists.")]})
        try:
            serializer.instance = services.create_organization(
                name=data["name"],
                slug=data.get("slug", ""),
                actor=self.request.user,  # type: ignore[arg-type]
            )
        except DjangoValidationError as error:
            raise _as_field_errors(error) from None

    @extend_schema(request=ShareSerializer, responses=OrganizationSerializer)
    @action(detail=True, methods=["patch"], permission_classes=[CanChangeShares])
    def share(self, request: Request, pk: str | None = None) -> Response:
        """Set an organisation's weight (administrators)."""
        obj = self.get_object()
        _within_reach(request, "org", obj)
        return Response(OrganizationSerializer(_set_share(request, obj)).data)


class TeamViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet[Team]):
    queryset = Team.objects.select_related("organization")
    serializer_class = TeamSerializer
    permission_classes = [IsStaffReader]

    def perform_create(self, serializer: serializers.BaseSerializer[Team]) -> None:
        data = serializer.validated_data
        if data.get("slug") and Team.objects.filter(organization=data["organization"], slug=data["slug"]).exists():
            raise serializers.ValidationError({"slug": [_("A team with this slug exists in the organisation.")]})
        try:
            serializer.instance = services.create_team(
                data["organization"],
                name=data["name"],
                slug=data.get("slug", ""),
                actor=self.request.user,  # type: ignore[arg-type]
            )
        except DjangoValidationError as error:
            raise _as_field_errors(error) from None

    @extend_schema(request=ShareSerializer, responses=TeamSerializer)
    @action(detail=True, methods=["patch"], permission_classes=[CanChangeShares])
    def share(self, request: Request, pk: str | None = None) -> Response:
        """Set a team's weight (administrators and its organisation's managers)."""
        obj = self.get_object()
        _within_reach(request, "team", obj)
        return Response(TeamSerializer(_set_share(request, obj)).data)


class ProjectViewSet(mixins.CreateModelMixin, viewsets.ReadOnlyModelViewSet[Project]):
    queryset = Project.objects.select_related("team__organization")
    serializer_class = ProjectSerializer
    permission_classes = [IsStaffReader]

    def perform_create(self, serializer: serializers.BaseSerializer[Project]) -> None:
        data = serializer.validated_data
        if data.get("slug") and Project.objects.filter(team=data["team"], slug=data["slug"]).exists():
            raise serializers.ValidationError({"slug": [_("A project with this slug exists in the team.")]})
        try:
            serializer.instance = services.create_project(
                data["team"],
                name=data["name"],
                slug=data.get("slug", ""),
                actor=self.request.user,  # type: ignore[arg-type]
            )
        except DjangoValidationError as error:
            raise _as_field_errors(error) from None

    @extend_schema(request=ShareSerializer, responses=ProjectSerializer)
    @action(detail=True, methods=["patch"], permission_classes=[CanChangeShares])
    def share(self, request: Request, pk: str | None = None) -> Response:
        """Set a project's weight and highest band (administrators and the managers of its team or organisation)."""
        obj = self.get_object()
        _within_reach(request, "project", obj)
        return Response(ProjectSerializer(_set_share(request, obj)).data)


# The audit log (staff, read only) ----------------------------------------------------------


class AuditEventSerializer(serializers.ModelSerializer[AuditEvent]):
    actor = serializers.CharField(source="actor_label", help_text="The actor's email at the time, or “system”.")
    target = serializers.CharField(source="target_label")

    class Meta:
        model = AuditEvent
        fields = [
            "id",
            "created_at",
            "actor_id",
            "actor",
            "action",
            "target_type",
            "target_id",
            "target",
            "changes",
            "address",
        ]
        read_only_fields = fields


class AuditEventViewSet(viewsets.ReadOnlyModelViewSet[AuditEvent]):
    """Who changed what, newest first. Staff who read everything may read it; nobody may change
    or delete an event (every other method is refused)."""

    serializer_class = AuditEventSerializer
    permission_classes = [StaffReadOnly]

    def get_queryset(self) -> QuerySet[AuditEvent]:
        if self.action != "list":
            return audit_events()
        form = AuditFilterForm(self.request.query_params)
        if not form.is_valid():
            raise serializers.ValidationError({name: [str(e) for e in errors] for name, errors in form.errors.items()})
        return form.filter(audit_events())

    @extend_schema(
        parameters=[
            OpenApiParameter("actor", str, description="part of the actor's email, or “system”"),
            OpenApiParameter("action", str, description="an action exactly, such as node.cordon"),
            OpenApiParameter("target_type", str, description="such as cluster.node"),
            OpenApiParameter("target", str, description="part of the target's name, or its id"),
            OpenApiParameter("since", str, description="ISO 8601"),
            OpenApiParameter("until", str, description="ISO 8601"),
        ]
    )
    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return super().list(request, *args, **kwargs)
