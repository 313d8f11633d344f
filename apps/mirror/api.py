"""The mirror over the REST API: what it holds with each file's progress, fetching from the Hub,
manifests, and the explorer (search, a repository's files grouped into what can be fetched)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404
from django.utils.translation import gettext_lazy as _
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsOperator, public
from apps.mirror import hub, services
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorFile, MirrorVersion
from llmgw.api import ErrorSerializer, refusal
from llmgw.http import client_address
from llmgw.ids import parse_id

__all__ = [
    "MirrorEstimateView",
    "MirrorManifestView",
    "MirrorRepoView",
    "MirrorSearchView",
    "MirrorVersionView",
    "MirrorView",
]


class MirrorFileSerializer(serializers.ModelSerializer[MirrorFile]):
    seconds_left = serializers.FloatField(
        read_only=True, allow_null=True, help_text=_("Time left at the current rate; null when unknown.")
    )

    class Meta:
        model = MirrorFile
        fields = ["path", "size", "sha256", "state", "bytes_done", "rate", "seconds_left", "error", "attempts"]


class MirrorVersionSerializer(serializers.ModelSerializer[MirrorVersion]):
    files = MirrorFileSerializer(many=True, read_only=True)
    state = serializers.SerializerMethodField(help_text=_("held, downloading, queued or failed."))

    class Meta:
        model = MirrorVersion
        fields = ["id", "repo", "revision", "commit", "name", "kind", "state", "created_at", "files"]

    def get_state(self, version: MirrorVersion) -> str:
        return services.version_state(version)


class MirrorOverviewSerializer(serializers.Serializer[Any]):
    free_bytes = serializers.IntegerField(allow_null=True, help_text=_("Free space on the mirror's disk."))
    used_bytes = serializers.IntegerField(help_text=_("What the held files take."))
    reserve_bytes = serializers.IntegerField(help_text=_("The space fetches leave free."))
    versions = MirrorVersionSerializer(many=True)


class MirrorAddSerializer(serializers.Serializer[Any]):
    urls = serializers.ListField(
        child=serializers.CharField(max_length=2000),
        min_length=1,
        max_length=64,
        help_text=_("Hub file URLs (…/owner/name/resolve/main/FILE) or hf://owner/name/FILE."),
    )


def overview() -> dict[str, Any]:
    room = services.space()
    versions = MirrorVersion.objects.prefetch_related("files")
    return {
        "free_bytes": room.free,
        "used_bytes": room.used,
        "reserve_bytes": room.reserve,
        "versions": MirrorVersionSerializer(versions, many=True).data,
    }


def _version(pk: str, *related: str) -> MirrorVersion:
    """The version named in the URL; 404 (as JSON) for an id that is not one."""
    from rest_framework.exceptions import NotFound

    number = parse_id(pk, MirrorVersion)
    if number is None:
        raise NotFound(_("No mirrored version has the id %(pk)s.") % {"pk": str(pk)[:40]})
    query = MirrorVersion.objects.prefetch_related(*related) if related else MirrorVersion.objects.all()
    return get_object_or_404(query, pk=number)


def inline_freed() -> Any:
    from drf_spectacular.utils import inline_serializer

    return inline_serializer("MirrorFreed", {"freed_bytes": serializers.IntegerField()})


class MirrorView(APIView):
    """What the mirror holds and is fetching (GET); fetch more from the Hub (POST)."""

    permission_classes = [IsOperator]

    @extend_schema(operation_id="mirror_overview", responses=MirrorOverviewSerializer)
    def get(self, request: Request) -> Response:
        return Response(overview())

    @extend_schema(
        request=MirrorAddSerializer,
        responses={
            201: MirrorOverviewSerializer,
            400: OpenApiResponse(ErrorSerializer, description=_("A source that cannot be fetched, and why.")),
        },
    )
    def post(self, request: Request) -> Response:
        data = MirrorAddSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            services.add_sources(data.validated_data["urls"], actor=request.user, address=client_address(request))
        except MirrorError as exc:  # the Hub's answers too (a repository it lacks): the source is refused
            return refusal(exc, status=status.HTTP_400_BAD_REQUEST)
        return Response(overview(), status=status.HTTP_201_CREATED)


class MirrorVersionView(APIView):
    permission_classes = [IsOperator]

    @extend_schema(responses={200: MirrorVersionSerializer, 404: ErrorSerializer})
    def get(self, request: Request, pk: str) -> Response:
        version = _version(pk, "files")
        return Response(MirrorVersionSerializer(version).data)

    @extend_schema(
        responses={
            200: inline_freed(),
            404: ErrorSerializer,
            409: OpenApiResponse(ErrorSerializer, description=_("It is downloading.")),
        }
    )
    def delete(self, request: Request, pk: str) -> Response:
        version = _version(pk)
        try:
            freed = services.remove_version(version, actor=request.user, address=client_address(request))
        except MirrorError as exc:
            return refusal(exc, status=status.HTTP_409_CONFLICT)
        return Response({"freed_bytes": freed})


class MirrorManifestView(APIView):
    """Each file of a version with its sha256 and size, once every file is held (409 until then)."""

    permission_classes = [IsOperator]

    @extend_schema(
        responses={
            200: OpenApiResponse(description=_("The manifest.")),
            404: ErrorSerializer,
            409: OpenApiResponse(ErrorSerializer, description=_("Files are still missing, and how many.")),
        }
    )
    def get(self, request: Request, pk: str) -> Response:
        version = _version(pk, "files")
        try:
            return Response(services.manifest(version))
        except MirrorError as exc:
            return refusal(exc, status=status.HTTP_409_CONFLICT)


class MirrorEstimateView(APIView):
    """A held GGUF version's shape and the memory llama.cpp allocates to serve it, part by part."""

    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[
            OpenApiParameter("ctx_size", int, description=_("Tokens of context the slots share (default 4096).")),
            OpenApiParameter("parallel", int, description=_("Parallel requests (default 1).")),
        ],
        responses={
            200: OpenApiResponse(description=_("The estimate's parts.")),
            404: ErrorSerializer,
            409: ErrorSerializer,
        },
    )
    def get(self, request: Request, pk: str) -> Response:
        version = _version(pk, "files")
        try:
            ctx = int(request.query_params.get("ctx_size", 4096))
            parallel = int(request.query_params.get("parallel", 1))
        except ValueError:
            return Response({"detail": str(_("ctx_size and parallel must be whole numbers"))}, status=400)
        if not (1 <= ctx <= 10**8 and 1 <= parallel <= 1024):
            return Response({"detail": str(_("ctx_size must be 1 to 100,000,000 and parallel 1 to 1,024"))}, status=400)
        try:
            found = services.summary(version, ctx_size=ctx, parallel=parallel)
        except MirrorError as exc:
            return refusal(exc, status=status.HTTP_409_CONFLICT)
        if found is None:
            return Response(
                {"detail": str(_("only a held GGUF version has a header to read"))}, status=status.HTTP_409_CONFLICT
            )
        body: dict[str, Any] = {
            "architecture": found.architecture,
            "kind": found.kind,
            "adapter_type": found.adapter_type,
            "block_count": found.block_count,
            "context_length": found.context_length,
            "ctx_size": ctx,
            "parallel": parallel,
            "estimate": None,
        }
        if found.estimate is not None:
            body["estimate"] = {**found.estimate.parts(), "total": found.estimate.total}
        return Response(body)


class MirrorSearchView(APIView):
    """Search the Hub (the configured endpoint)."""

    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[OpenApiParameter("q", str, description=_("Words to search for."))],
        responses={200: OpenApiResponse(description=_("Repositories found.")), 502: ErrorSerializer},
    )
    def get(self, request: Request) -> Response:
        try:
            return Response({"results": hub.search(str(request.query_params.get("q", ""))[:200])})
        except MirrorError as exc:
            return refusal(exc, status=status.HTTP_502_BAD_GATEWAY)


class MirrorRepoView(APIView):
    """A repository's files, grouped into what can be fetched."""

    permission_classes = [IsOperator]

    @extend_schema(
        parameters=[OpenApiParameter("revision", str, description=_("A branch, tag or commit (default main)."))],
        responses={
            200: OpenApiResponse(description=_("The files.")),
            400: ErrorSerializer,
            404: OpenApiResponse(ErrorSerializer, description=_("The Hub has no such repository or revision.")),
            502: ErrorSerializer,
        },
    )
    def get(self, request: Request, owner: str, name: str) -> Response:
        repo = f"{owner}/{name}"
        revision = str(request.query_params.get("revision", "") or "main")[:200]
        # What the caller named is checked before the Hub is asked: a 400, not the Hub's 502.
        hub.check_repo(repo)
        hub.check_revision(revision)
        try:
            commit, files = hub.repo_files(repo, revision)
        except hub.HubNotFound as exc:
            return refusal(exc)
        except MirrorError as exc:  # the Hub did not answer
            return refusal(exc, status=status.HTTP_502_BAD_GATEWAY)
        groups = [
            {
                "kind": g.kind,
                "name": g.name,
                "size": g.size,
                "files": [f.path for f in g.files],
                "source": f"hf://{repo}@{commit}/{g.files[0].path}",
            }
            for g in hub.group_files(files)
        ]
        return Response(
            {
                "repo": repo,
                "commit": commit,
                "groups": groups,
                "files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files],
            }
        )


@public
def mirror_file(request: HttpRequest, pk: str, path: str) -> HttpResponseBase:
    """A held file of the mirror, for the nodes (their credential as a Bearer token) and staff,
    with Range (206) so a node resumes where it stopped; it checks the file against the manifest."""
    from django.http import HttpResponse, JsonResponse, StreamingHttpResponse

    from apps.cluster.enrolment import node_or_staff

    if not node_or_staff(request):
        return JsonResponse({"detail": str(_("A node credential is needed to fetch mirror files."))}, status=401)
    if request.method not in ("GET", "HEAD"):
        return JsonResponse({"detail": str(_("Only GET and HEAD."))}, status=405)
    version_id = parse_id(pk, MirrorVersion)
    file = (
        MirrorFile.objects.select_related("version").filter(version_id=version_id, path=path).first()
        if version_id is not None
        else None
    )
    if file is None or file.state != MirrorFile.State.HELD or not file.local_path.is_file():
        return JsonResponse({"detail": str(_("The mirror holds no such file."))}, status=404)
    size = file.local_path.stat().st_size
    start, end, code = 0, size - 1, 200
    wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
    if wanted:
        start = int(wanted.group(1))
        end = min(int(wanted.group(2)) if wanted.group(2) else size - 1, size - 1)
        if start >= size:
            refused = HttpResponse(status=416)
            refused["Content-Range"] = f"bytes */{size}"
            return refused
        code = 206

    def chunks() -> Iterator[bytes]:
        with open(file.local_path, "rb") as handle:
            handle.seek(start)
            left = end - start + 1
            while left > 0 and (chunk := handle.read(min(left, 2**20))):
                left -= len(chunk)
                yield chunk

    answer = StreamingHttpResponse(chunks() if request.method == "GET" else iter(()), status=code)
    answer["Content-Type"] = "application/octet-stream"
    answer["Content-Length"] = str(end - start + 1)
    answer["Accept-Ranges"] = "bytes"
    answer["ETag"] = f'"{file.sha256}"'
    if code == 206:
        answer["Content-Range"] = f"bytes {start}-{end}/{size}"
    return answer
