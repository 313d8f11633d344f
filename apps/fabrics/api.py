"""/api/v1/fabrics: every physical fabric with its nodes, names and subnet managers, and what is wrong."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiTypes, extend_schema
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.access import IsStaffReader
from apps.fabrics.services import fabrics_overview


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
