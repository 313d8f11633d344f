"""/api/v1/fabrics: every physical fabric with its nodes, names and subnet managers, and what is wrong."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from drf_spectacular.utils import OpenApiResponse, OpenApiTypes, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsOperator, IsStaffReader
from apps.fabrics import perf
from apps.fabrics.maps import ask_for_map
from apps.fabrics.models import FabricTest
from apps.fabrics.serializers import FabricTestInput
from apps.fabrics.services import fabrics_overview, topology_view
from llmgw.api import ErrorSerializer
from llmgw.api_serializers import read_body
from llmgw.http import client_address
from llmgw.ids import parse_id


def _error(text: Any) -> OpenApiResponse:
    return OpenApiResponse(ErrorSerializer, description=text)


class FabricsView(APIView):
    """The physical fabrics: one per InfiniBand subnet (named by the lowest GUID of its subnet
    managers) or RoCE IP network, each with the names nodes declare it by, its nodes, subnet managers
    and the last day's changes of master; `problems` says when one name covers two fabrics, two names
    one, an adapter is up but undeclared, a port cannot be checked, a fabric has no standby, its
    ports disagree on the master, a port has a link but no subnet manager, or the master changed in
    the last hour."""

    permission_classes = [IsStaffReader]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        return Response(fabrics_overview())


class NVLinkView(APIView):
    """The multi-node NVLink domains (`<ClusterUUID>.<CliqueId>`): each node (tray) with every card's
    fabric state, status, health and bandwidth, whether it is joined, its IMEX daemon and channels,
    whether the node is ready to take a shard across the domain and what keeps it out; `at_risk`:
    running replicas formed over NVLink with a shard on a node that is now out. `standalone`: nodes
    whose cards are on a single machine's NVSwitch (no domain); `stale`: domain nodes whose sample
    is too old to say."""

    permission_classes = [IsStaffReader]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        from apps.fabrics.nvlink import domains_overview

        return Response(domains_overview())


class FabricTopologyView(APIView):
    """The fabric's newest ibnetdiscover map (switch tiers, adapters and their leaves, cables with
    their rates and the degraded ones, rails) with the cluster's own adapters live on it (`live`:
    port GUID -> node, state and data counters), and its last map requests. POST asks one of its
    nodes to map it now."""

    permission_classes = [IsOperator]

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 404: _error(gettext_lazy("No such fabric."))})
    def get(self, request: Request, fabric: str) -> Response:
        view = topology_view(fabric)
        if view is None:
            return Response({"detail": _("No such fabric.")}, status=404)
        return Response(view)

    @extend_schema(
        request=None,
        responses={202: OpenApiTypes.OBJECT, 409: _error(gettext_lazy("No ready node on the fabric can map it."))},
    )
    def post(self, request: Request, fabric: str) -> Response:
        row = ask_for_map(fabric, actor=request.user, address=client_address(request))  # type: ignore[arg-type]
        if row is None:
            return Response(
                {"detail": _("No ready node on fabric %(fabric)s can map it.") % {"fabric": fabric}}, status=409
            )
        return Response({"request": row.pk, "node": row.node.name, "state": row.state}, status=202)


class FabricTestsView(APIView):
    """POST {"a": client node, "b": server node, "duration": seconds per rail}: measure the fabric the
    two nodes share with ib_write_bw, rail by rail (refused at once, with the reason, when they share
    none or an agent cannot run it). GET lists the last tests."""

    permission_classes = [IsOperator]

    @extend_schema(operation_id="fabric_tests_list", responses=OpenApiTypes.OBJECT)
    def get(self, request: Request) -> Response:
        tests = FabricTest.objects.select_related("client", "server")[:50]
        return Response({"results": [perf.as_dict(t) for t in tests]})

    @extend_schema(
        request=FabricTestInput,
        responses={
            202: OpenApiTypes.OBJECT,
            400: _error(gettext_lazy("Two different nodes and a duration of 1 to 60 s are needed.")),
            409: _error(gettext_lazy("The nodes share no fabric, or an agent cannot run the test.")),
        },
    )
    def post(self, request: Request) -> Response:
        data = read_body(FabricTestInput, request)
        test = perf.start_test(
            data["client"],
            data["server"],
            duration_s=data["duration"],
            actor=request.user,  # type: ignore[arg-type]
            address=client_address(request),
        )
        return Response(perf.as_dict(test), status=202)


class FabricTestView(APIView):
    """One fabric test: each rail's adapters, link rate, measured bandwidth, share and grade."""

    permission_classes = [IsOperator]

    @extend_schema(responses={200: OpenApiTypes.OBJECT, 404: _error(gettext_lazy("No such test."))})
    def get(self, request: Request, pk: str) -> Response:
        number = parse_id(pk, FabricTest)
        test = FabricTest.objects.select_related("client", "server").filter(pk=number).first() if number else None
        if test is None:
            return Response({"detail": _("No such test.")}, status=404)
        return Response(perf.as_dict(test))
