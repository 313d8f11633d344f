from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.fabrics.models import FabricMap, FabricTest, MasterChange, NodeFabrics


@admin.register(NodeFabrics)
class NodeFabricsAdmin(ReadOnlyAdmin):
    # Written from each agent's "fabrics" message (apps.fabrics.services.record_fabrics).
    list_display = ["node", "declared", "changes", "changed_at"]
    search_fields = ["node__name"]


@admin.register(MasterChange)
class MasterChangeAdmin(ReadOnlyAdmin):
    # Kept when a port reports another master subnet manager than before.
    list_display = ["at", "node", "port", "previous", "master"]
    search_fields = ["node__name", "previous", "master"]


@admin.register(FabricMap)
class FabricMapAdmin(ReadOnlyAdmin):
    # Parsed from an ibnetdiscover answer (apps.fabrics.maps.record_map); the newest 12 per fabric.
    list_display = ["fabric", "taken_at", "node", "device"]
    list_filter = ["fabric"]
    exclude = ["data"]


@admin.register(FabricTest)
class FabricTestAdmin(ReadOnlyAdmin):
    # Started by ctl fabric-test (apps.fabrics.perf), run rail by rail by the worker.
    list_display = ["pk", "client", "server", "fabric", "state", "created_at", "finished_at"]
    list_filter = ["state"]
