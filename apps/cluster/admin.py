"""The Django admin for nodes, their GPUs, enrollment tokens and replicas.

An operator's changes go through apps.cluster.actions (cordon, uncordon, revoke), which
audit them as the console and `llmgw ctl` do; the rest is audited by AuditedAdmin. What the
agents, heartbeats and the reconciler write is read-only here.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db import transaction
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from apps.accounts.admin import AuditedAdmin, ReadOnlyAdmin, ReadOnlyInline, actor_of
from apps.cluster.actions import cordon_node, revoke_node, uncordon_node
from apps.cluster.models import (
    AgentRequest,
    ControlLock,
    EngineChoice,
    EngineRelease,
    EnrollmentToken,
    Gpu,
    Node,
    Replica,
    Shard,
)
from llmgw.http import client_address


class GpuInline(ReadOnlyInline):
    model = Gpu
    fields = readonly_fields = ("index", "gpu_class", "name", "memory_total_mib", "ecc_fault", "foreign_processes")


@admin.register(Node)
class NodeAdmin(AuditedAdmin):
    # Nodes join with `llmgw ctl node add` or the console's form, which make the enrollment
    # token: no adding here. Cordoning goes through cordon_node and uncordon_node (the
    # reason is kept only while cordoned); revoking through revoke_node (the action
    # below), and a node is revoked before it is deleted (node.delete), so its agent is cut off.
    # Its status is written by heartbeats, what it is (agent, hardware, address, samples) by its
    # agent, drains by actions.drain_node and its credential by enrollment: all read-only, as
    # is its name, which its agent and `llmgw ctl` know it by. Its disabled engines change with
    # `ctl node engines` (actions.set_disabled_engines, which tells the node). Its labels are
    # audited here (node.update).
    list_display = ["name", "status", "cordoned", "agent_version", "address", "last_seen_at", "registered_at"]
    list_filter = ["status", "cordoned"]
    search_fields = ["name", "address"]
    readonly_fields = [
        "name",
        "status",
        "drain_requested_at",
        "drain_grace",
        "drain_force",
        "agent_version",
        "features",
        "hardware",
        "warnings",
        "sample",
        "sampled_at",
        "credential_hash",
        "created_at",
        "registered_at",
        "last_seen_at",
        "revoked_at",
        "address",
        "desired_version",
        "disabled_engines",
    ]
    audit_exclude = ("cordoned", "cordon_reason")
    inlines = [GpuInline]
    actions = ["revoke_nodes"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Node, form: Any, change: bool) -> None:
        cordon, reason = obj.cordoned, obj.cordon_reason
        obj.cordoned = form.initial.get("cordoned", obj.cordoned)
        obj.cordon_reason = form.initial.get("cordon_reason", obj.cordon_reason)
        super().save_model(request, obj, form, change)
        if not {"cordoned", "cordon_reason"} & set(form.changed_data):
            return
        actor, address = actor_of(request), client_address(request)
        if cordon:
            cordon_node(obj, reason=reason, actor=actor, address=address)
        elif obj.cordoned:
            uncordon_node(obj, actor=actor, address=address)
        else:
            self.message_user(
                request,
                _("A cordon reason is kept only while the node is cordoned; it was not saved."),
                level=messages.WARNING,
            )

    @admin.action(description=_("Revoke the selected nodes"), permissions=["change"])
    def revoke_nodes(self, request: HttpRequest, queryset: Any) -> None:
        nodes = [node for node in queryset if node.revoked_at is None]
        for node in nodes:
            revoke_node(node, actor=actor_of(request), address=client_address(request))
        self.message_user(
            request,
            ngettext("%(count)d node revoked.", "%(count)d nodes revoked.", len(nodes)) % {"count": len(nodes)},
            level=messages.SUCCESS,
        )

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, Any, Any, Any]:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # Its GPU rows go with it; they are never deleted on their own.
        gpus = str(Gpu._meta.verbose_name)
        return deleted, counts, {name for name in perms_needed if str(name) != gpus}, protected

    def delete_model(self, request: HttpRequest, obj: Node) -> None:
        with transaction.atomic():
            if obj.revoked_at is None:
                revoke_node(obj, actor=actor_of(request), address=client_address(request))
            super().delete_model(request, obj)


@admin.register(Gpu)
class GpuAdmin(ReadOnlyAdmin):
    # Written by the node's registration and heartbeats only.
    list_display = ["node", "index", "gpu_class", "memory_total_mib", "ecc_fault", "foreign_processes"]
    list_filter = ["gpu_class", "ecc_fault"]
    search_fields = ["node__name", "uuid"]


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(AuditedAdmin):
    # Made by `ctl node add` or the console, which show the token once, and used up by the agent
    # that enrolls with it: nothing about one changes here. Deleting one withdraws it, audited as
    # node.enrollment_delete.
    list_display = ["node_name", "created_by", "created_at", "expires_at", "used_at"]
    search_fields = ["node_name"]
    readonly_fields = ["token_hash"]

    def audit_action(self, verb: str) -> str:
        return f"node.enrollment_{verb}"  # as enrolment.create_enrollment names its event

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ShardInline(ReadOnlyInline):
    model = Shard
    fields = readonly_fields = (
        "rank",
        "node",
        "gpu_indices",
        "memory_bytes",
        "cpu_cores",
        "port",
        "state",
        "pid",
        "exit_code",
    )


@admin.register(Replica)
class ReplicaAdmin(ReadOnlyAdmin):
    # Placed, rolled, stopped and removed by the reconciler; the agents report their shards.
    # To change how many run, change the model's replicas.
    list_display = ["__str__", "model", "profile", "state", "failures", "created_at", "ready_at"]
    list_filter = ["state", "model"]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(ReadOnlyAdmin):
    # As its replica; the engine key is never shown.
    list_display = ["__str__", "node", "port", "state", "pid", "exit_code", "reported_at"]
    list_filter = ["state", "node"]
    exclude = ["secret"]


@admin.register(ControlLock)
class ControlLockAdmin(ReadOnlyAdmin):
    # The reconciler's lock row.
    list_display = ["name"]


@admin.register(EngineChoice)
class EngineChoiceAdmin(ReadOnlyAdmin):
    # Set by server.yaml's `engines:`, `llmgw ctl engine set|unset` and the API
    # (apps.cluster.engines, which audits each change and tells the nodes).
    list_display = ["engine", "version", "scope", "match", "updated_at"]
    list_filter = ["engine", "scope"]


@admin.register(EngineRelease)
class EngineReleaseAdmin(ReadOnlyAdmin):
    # Read from the releases API by the worker (apps.cluster.engines.fetch_release).
    list_display = ["engine", "version", "fetched_at", "tried_at", "error"]
    list_filter = ["engine"]


@admin.register(AgentRequest)
class AgentRequestAdmin(ReadOnlyAdmin):
    # Made by beat (fabric maps) and ctl fabric-test (apps.cluster.agent_requests), answered by agents.
    list_display = ["pk", "node", "kind", "state", "created_at", "answered_at", "error"]
    list_filter = ["kind", "state"]
    search_fields = ["node__name", "kind", "group"]
