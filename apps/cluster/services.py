"""Every change to nodes goes through here: enrollment, registration, heartbeats, cordons."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts import audit
from apps.accounts.models import User
from apps.cluster.choices import NodeStatus
from apps.cluster.models import EnrollmentToken, Gpu, Node

__all__ = [
    "EnrollmentRefused",
    "NewEnrollment",
    "append_histories",
    "authenticate_node",
    "cordon_node",
    "create_enrollment",
    "desired_version",
    "drain_node",
    "drain_status",
    "enroll_node",
    "gpu_fault",
    "gpu_health",
    "issue_credential",
    "mark_unreachable_nodes",
    "node_group",
    "record_doctor",
    "record_engines",
    "oldest_points",
    "record_heartbeats",
    "write_heartbeats",
    "record_report",
    "register_node",
    "request_doctor",
    "revoke_node",
    "set_disabled_engines",
    "sample_health",
    "sample_history",
    "set_connection",
    "uncordon_node",
    "validate_node_name",
    "write_gpu_health",
]

log = logging.getLogger(__name__)

CREDENTIAL_PREFIX = "llmgwn_"
TOKEN_PREFIX = "llmgwe_"
RESERVED_NODE_NAMES = frozenset({"add"})  # /nodes/add/ is the console's form
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
HISTORY_SECONDS = 3600
HISTORY_POINTS = 400  # an hour of 10-second heartbeats, with room for a faster interval


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def node_group(node_id: int) -> str:
    return f"agent.node.{node_id}"


# Enrollment ----------------------------------------------------------------------------


class EnrollmentRefused(Exception):
    pass


@dataclass(frozen=True)
class NewEnrollment:
    token: EnrollmentToken
    secret: str


def validate_node_name(name: str) -> str:
    name = name.strip().lower()
    if not NODE_NAME.match(name) or name in RESERVED_NODE_NAMES:
        raise ValueError(
            _(
                "A node name is 1 to 63 lower-case letters, digits, dots and dashes, "
                "starting and ending with a letter or digit; got “%(name)s”."
            )
            % {"name": name}
        )
    return name


@transaction.atomic
def create_enrollment(
    name: str,
    *,
    labels: dict[str, str] | None = None,
    expires_in: timedelta = timedelta(hours=1),
    disabled_engines: list[str] | None = None,
    actor: User | None,
) -> NewEnrollment:
    name = validate_node_name(name)
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = EnrollmentToken.objects.create(
        node_name=name,
        labels=dict(labels or {}),
        disabled_engines=sorted(set(disabled_engines or [])),
        token_hash=_hash(secret),
        created_by=actor,
        expires_at=timezone.now() + expires_in,
    )
    audit.record(
        actor,
        "node.enrollment_create",
        token,
        node=name,
        labels=labels or {},
        disabled_engines=token.disabled_engines or None,
        expires_at=token.expires_at.isoformat(),
    )
    return NewEnrollment(token=token, secret=secret)


def node_or_staff(request: Any) -> bool:
    """Whether a file the control plane serves its nodes may go to this caller: a node's credential
    as a Bearer token (agents have no account), or a staff member's session."""
    header = request.headers.get("Authorization", "")
    bearer = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if bearer and authenticate_node(bearer) is not None:
        return True
    return bool(request.user.is_authenticated and request.user.is_staff)


@transaction.atomic
def enroll_node(secret: str, *, address: str | None = None) -> tuple[Node, str]:
    """Trade a one-time enrollment token for a node credential (returned once, stored hashed)."""
    now = timezone.now()
    token = EnrollmentToken.objects.select_for_update().filter(token_hash=_hash(secret)).first()
    if token is None or not hmac.compare_digest(token.token_hash, _hash(secret)):
        raise EnrollmentRefused(_("Unknown enrollment token."))
    if token.used_at is not None:
        raise EnrollmentRefused(
            _("This enrollment token was already used at %(when)s; make a new one with `llmgw ctl node add`.")
            % {"when": token.used_at.isoformat(timespec="seconds")}
        )
    if token.expires_at <= now:
        minutes = int((now - token.expires_at).total_seconds() // 60)
        raise EnrollmentRefused(
            _(
                "This enrollment token expired at %(when)s (%(minutes)s minutes ago); make a new "
                "one with `llmgw ctl node add`."
            )
            % {"when": token.expires_at.isoformat(timespec="seconds"), "minutes": minutes}
        )
    if EnrollmentToken.objects.filter(pk=token.pk, used_at__isnull=True).update(used_at=now) != 1:
        raise EnrollmentRefused(_("This enrollment token was already used."))
    credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
    node, created = Node.objects.get_or_create(name=token.node_name, defaults={"labels": token.labels})
    node.credential_hash = _hash(credential)
    node.revoked_at = None
    node.status = NodeStatus.PENDING
    node.labels = {**node.labels, **token.labels}
    fields = ["credential_hash", "revoked_at", "status", "labels"]
    if token.disabled_engines:
        node.disabled_engines = sorted(set(node.disabled_engines or []) | set(token.disabled_engines))
        fields.append("disabled_engines")
    node.save(update_fields=fields)
    EnrollmentToken.objects.filter(pk=token.pk).update(node=node)
    audit.record(None, "node.enroll", node, address=address, token=token.pk, created=created)
    if not created:
        transaction.on_commit(lambda: _tell_agent(node.pk, {"type": "agent.revoke", "reason": "re-enrolled"}))
    return node, credential


def issue_credential(name: str, *, labels: dict[str, str] | None = None) -> tuple[Node, str]:
    """A credential without a token, for the agent `llmgw up` starts on its own machine."""
    token = create_enrollment(name, labels=labels, expires_in=timedelta(minutes=5), actor=None)
    return enroll_node(token.secret)


def authenticate_node(secret: str) -> Node | None:
    if not secret.startswith(CREDENTIAL_PREFIX):
        return None
    digest = _hash(secret)
    node = Node.objects.filter(credential_hash=digest, revoked_at__isnull=True).first()
    if node is None or not hmac.compare_digest(node.credential_hash or "", digest):
        return None
    return node


# Registration and heartbeats -------------------------------------------------------------


def gpu_fault(gpu: dict[str, Any]) -> str:
    """Why the device cannot be trusted now, in its agent's words; "" when it can."""
    fault = gpu.get("fault")
    return fault[:1000] if isinstance(fault, str) else ""


def gpu_health(gpu: dict[str, Any]) -> tuple[bool, int]:
    """(ECC fault, processes not started by llmgw) for one GPU of a sample or registration."""
    ecc = gpu.get("ecc_uncorrected_volatile")
    fault = bool(ecc) or gpu.get("remapped_rows_failure") is True or gpu.get("remapped_rows_pending") is True
    foreign = gpu.get("foreign_processes")
    if foreign is None:
        foreign = len(gpu.get("processes") or [])
    return fault, int(foreign)


@transaction.atomic
def register_node(node_id: int, body: dict[str, Any], *, address: str | None = None) -> Node:
    """Record what the agent says it is. A registration never clears an operator's cordon."""
    node = Node.objects.select_for_update().get(pk=node_id)
    hardware = dict(body["hardware"])
    gpus = hardware.pop("gpus", []) or []
    hardware["labels"] = body.get("labels") or {}
    # Cards: a MIG slice or compute partition (a device with a parent) is not one more.
    hardware["gpu_count"] = sum(1 for g in gpus if not isinstance(g, dict) or g.get("parent") is None)
    before = {
        "agent_version": node.agent_version,
        "gpus": len(node.hardware.get("gpus_summary", []) or []),
        "memory": node.hardware.get("memory_total_bytes"),
    }
    hardware["gpus_summary"] = [g.get("gpu_class") or g.get("name") for g in gpus]
    # The multi-node NVLink domain the cards name now, else the one they named before (a tray that
    # registers while its fabric manager restarts is still shown in its rack, out of it).
    from apps.fabrics.nvlink import registered_domain

    domain = registered_domain(gpus) or node.hardware.get("nvlink_domain")
    if domain:
        hardware["nvlink_domain"] = domain
    now = timezone.now()
    node.hardware = hardware
    node.agent_version = body["agent_version"]
    node.features = sorted(set(body.get("features") or []))
    node.warnings = list(body.get("warnings") or [])
    node.status = NodeStatus.READY
    node.registered_at = now
    node.last_seen_at = now
    node.address = str(hardware.get("advertise_address") or address or "")[:255]
    fields = ["hardware", "agent_version", "features", "warnings", "status", "registered_at", "last_seen_at", "address"]
    sample = body.get("sample")
    if sample:
        node.sample = sample
        node.sampled_at = now
        fields += ["sample", "sampled_at"]
    node.save(update_fields=fields)
    _sync_gpus(node, gpus, (sample or {}).get("gpus") or [])
    after = {"agent_version": node.agent_version, "gpus": len(gpus), "memory": hardware.get("memory_total_bytes")}
    if before != after:
        audit.record(None, "node.register", node, changes=audit.diff(before, after))
    if sample:
        append_histories({node.pk: sample})
    return node


def request_doctor(node: Node, *, actor: User | None, address: str | None = None) -> bool:
    """Ask the node's agent to run `llmgw doctor` now; its answer lands in `node.doctor`.
    False when the request could not be sent (no channel layer reaches the agent)."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from agent import protocol

    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(doctor_requested_at=now)
    node.doctor_requested_at = now
    audit.record(actor, "node.doctor", node, address=address)
    layer = get_channel_layer()
    if layer is None:
        return False
    text = protocol.encode("request", {"request_id": f"doctor-{secrets.token_hex(8)}", "kind": "doctor"})
    try:
        async_to_sync(layer.group_send)(node_group(node.pk), {"type": "agent.send", "text": text})
    except Exception:
        log.warning("could not ask node %s to run its checks", node.name, exc_info=True)
        return False
    return True


def record_doctor(node_id: int, body: dict[str, Any]) -> None:
    """The agent's answer to a doctor request: its checks, kept on the node."""
    result = body.get("result") if body.get("ok") else None
    checks = result.get("checks") if isinstance(result, dict) else None
    if not isinstance(checks, list):
        checks = [{"name": "doctor", "status": "fail", "detail": str(body.get("error") or "no answer"), "fix": ""}]
    clean = [
        {k: str(item.get(k) or "")[:2000] for k in ("name", "status", "detail", "fix")}
        for item in checks[:200]
        if isinstance(item, dict)
    ]
    Node.objects.filter(pk=node_id).update(doctor=clean, doctor_at=timezone.now())


ENGINE_KEYS = ("engines", "engine_versions", "engines_probed", "engine_status", "engine_sources", "engine_builds")


def record_engines(node_id: int, report: dict[str, Any]) -> bool:
    """Take the agent's word for its engines (usable ones, versions, installs in progress or
    failed). A node that gained an engine gets a reconciler pass: its pending models may fit now.
    Returns whether anything changed."""
    from apps.cluster.reconciler import request_reconcile

    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None:
            return False
        before = {key: node.hardware.get(key) for key in ENGINE_KEYS}
        after = {key: report.get(key) for key in ENGINE_KEYS if key in report}
        if all(before.get(k) == v for k, v in after.items()):
            return False
        node.hardware = {**node.hardware, **after}
        node.save(update_fields=["hardware"])
        gained = set(after.get("engines") or []) - set(before.get("engines") or [])
        lost = set(before.get("engines") or []) - set(after.get("engines") or [])
        if gained or lost:
            audit.record(
                None,
                "node.engines",
                node,
                changes={"engines": [sorted(before.get("engines") or []), sorted(after.get("engines") or [])]},
            )
        if gained:
            request_reconcile()
    return True


GPU_FIELDS = (
    "uuid",
    "name",
    "gpu_class",
    "pci_bus_id",
    "memory_total_mib",
    "mig_mode",
    "mig_pending",
    "vendor",
    "kind",
    "parent_index",
    "profile",
    "device_id",
    "share",
    "split",
    "memory_group",
    "compute_partition",
    "memory_partition",
    "ecc_fault",
    "foreign_processes",
    "fault",
)

_KINDS = {choice.value for choice in Gpu.Kind}


def _gpu_values(gpu: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The row of one device as its agent registered it, its health from the sample taken with it."""
    fault, foreign = gpu_health({**gpu, **live})
    kind = gpu.get("kind")
    parent = gpu.get("parent")
    return {
        "uuid": gpu.get("uuid") or "",
        "name": gpu.get("name") or "",
        "gpu_class": gpu.get("gpu_class") or "",
        "pci_bus_id": gpu.get("pci_bus_id") or "",
        "memory_total_mib": gpu.get("memory_total_mib"),
        "mig_mode": gpu.get("mig_mode") or "",
        "mig_pending": gpu.get("mig_pending") or "",
        "vendor": gpu.get("vendor") or "nvidia",
        "kind": kind if kind in _KINDS else Gpu.Kind.GPU,
        "parent_index": parent if isinstance(parent, int) and parent != gpu.get("index") else None,
        "profile": gpu.get("profile") or "",
        "device_id": gpu.get("device_id") or "",
        "share": gpu.get("share"),
        "split": gpu.get("split") is True,
        "memory_group": gpu.get("memory_group") or "",
        "compute_partition": gpu.get("compute_partition") or "",
        "memory_partition": gpu.get("memory_partition") or "",
        "ecc_fault": fault,
        "foreign_processes": foreign,
        "fault": gpu_fault({**gpu, **live}),
    }


def _sync_gpus(node: Node, gpus: list[dict[str, Any]], sampled: list[dict[str, Any]]) -> None:
    """Make the node's GPU rows match what its agent registered, writing only what changed
    (an agent reconnecting with the same cards writes nothing here)."""
    live = {g.get("index"): g for g in sampled}
    existing = {g.index: g for g in Gpu.objects.filter(node=node)}
    create, update = [], []
    for gpu in gpus:
        index = int(gpu["index"])
        values = _gpu_values(gpu, live.get(index, {}))
        row = existing.pop(index, None)
        if row is None:
            create.append(Gpu(node=node, index=index, **values))
        elif any(getattr(row, k) != v for k, v in values.items()):
            for key, value in values.items():
                setattr(row, key, value)
            update.append(row)
    if create:
        Gpu.objects.bulk_create(create)
    if update:
        Gpu.objects.bulk_update(update, list(GPU_FIELDS))
    if existing:
        Gpu.objects.filter(pk__in=[g.pk for g in existing.values()]).delete()


def set_connection(node_id: int, channel_name: str) -> None:
    """Name the node's newest agent connection (older ones close when they see another named)."""
    Node.objects.filter(pk=node_id).update(connection=channel_name[:200])


def desired_version(node_id: int) -> int | None:
    return Node.objects.filter(pk=node_id).values_list("desired_version", flat=True).first()


def _history_key(node_id: int) -> str:
    return f"{settings.REDIS_PREFIX}:cluster:history:{node_id}"


def _history_point(sample: dict[str, Any], models: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """One point of a node's hour. `models`, when the node's claims were read for it, is per model
    name: [cores claimed, memory bytes claimed, cores used, memory bytes used, requests queued],
    each None when unknown (a point without "models" knows none of them)."""
    total = sample.get("memory_total_bytes")
    used = sample.get("memory_used_bytes")
    load = sample.get("load") or [None]
    point = {
        "t": sample.get("taken_at") or timezone.now().timestamp(),
        "cpu": sample.get("cpu_utilization_pct"),
        "mem": (used / total * 100) if used is not None and total else None,
        "load": load[0],
        "gpus": {
            str(g["index"]): [
                g.get("utilization_gpu_pct"),
                g.get("temperature_gpu_c"),
                g.get("power_draw_w"),
                (g["memory_used_mib"] / g["memory_total_mib"] * 100)
                if g.get("memory_used_mib") is not None and g.get("memory_total_mib")
                else None,
            ]
            for g in sample.get("gpus") or []
            if g.get("parent") is None  # a slice's figures are its card's, or none of its own
        },
        "rapl": sample.get("cpu_package_power_w"),
    }
    if models is not None:
        point["models"] = models
    return point


# KEYS: the gateway's waiting sets (apps.gateway.slots.SharedSlots). The tickets not yet expired in each.
QUEUE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS do out[i] = redis.call('ZCOUNT', KEYS[i], '(' .. now, '+inf') end
return out
"""


def _figure(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _total(values: list[float | None]) -> float | None:
    """The sum, or None when one of the parts is unknown."""
    return None if not values or None in values else sum(v or 0.0 for v in values)


def _queue_depths(names: set[str]) -> dict[str, int | None]:
    """Requests waiting in the gateway for each model: from Redis, where every web process counts
    them, or without Redis from this process's gateway (then the only one). None where unknown."""
    import sys

    client = _redis()
    if client is not None:
        ordered = sorted(names)
        from apps.gateway.slots import shared_key

        keys = [shared_key(settings.REDIS_PREFIX, "waiting", name) for name in ordered]
        try:
            counts = client.eval(QUEUE_SCRIPT, len(keys), *keys)
        except Exception:
            log.warning("could not read the gateway's queues", exc_info=True)
            return dict.fromkeys(names)
        return {name: int(count) for name, count in zip(ordered, counts, strict=True)}
    gateway = sys.modules.get("apps.gateway.asgi")
    if gateway is None:  # no gateway in this process: its queues are not known here
        return dict.fromkeys(names)
    queue = gateway.gateway_app.admission.queue
    return {name: queue.waiting(name) for name in names}


def _model_figures(
    samples: dict[int, dict[str, Any]], last: dict[int, dict[str, Any] | None]
) -> dict[int, dict[str, list[Any]]]:
    """Per node and model: what its shards there claim, what their engines use (from the sample),
    and the model's queue. Read for the nodes whose sample lists running engines, or whose `last`
    point found claims (a failed engine's claim is held until its replica is replaced): a heartbeat
    from a node that runs nothing costs no query."""
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    ask = [
        node_id
        for node_id, sample in samples.items()
        if sample.get("shards") or (last.get(node_id) or {}).get("models")
    ]
    if not ask:
        return {}
    try:
        # In a savepoint: a registration calls this inside its transaction, which a failed read
        # must not take down with it.
        with transaction.atomic():
            rows = list(
                Shard.objects.filter(node_id__in=ask, replica__state__in=CLAIMING_STATES).values_list(
                    "node_id", "replica_id", "rank", "replica__model__name", "cpu_cores", "memory_bytes"
                )
            )
    except Exception:
        log.warning("could not read the claims of %s nodes for their history", len(ask), exc_info=True)
        return {}
    parts: dict[int, dict[str, list[tuple[float, int, float | None, float | None]]]] = {}
    for node_id, replica_id, rank, model, cores, memory in rows:
        entries = {str(e.get("shard")): e for e in samples[node_id].get("shards") or [] if isinstance(e, dict)}
        entry = entries.get(f"r{replica_id}s{rank}", {})
        parts.setdefault(node_id, {}).setdefault(model, []).append(
            (float(cores), int(memory), _figure(entry.get("cpu_cores")), _figure(entry.get("memory_bytes")))
        )
    queues = _queue_depths({model for by_model in parts.values() for model in by_model})
    figures: dict[int, dict[str, list[Any]]] = {node_id: {} for node_id in ask}
    for node_id, by_model in parts.items():
        for model, shards in by_model.items():
            memory_used = _total([s[3] for s in shards])
            figures[node_id][model] = [
                sum(s[0] for s in shards),
                sum(s[1] for s in shards),
                _total([s[2] for s in shards]),
                int(memory_used) if memory_used is not None else None,
                queues.get(model),
            ]
    return figures


_redis_client: Any = None


def _redis() -> Any:
    """A Redis client when one is configured (shared by every web process), else None."""
    global _redis_client
    if not settings.REDIS_URL:
        return None
    if _redis_client is None:
        import redis

        _redis_client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=2, socket_connect_timeout=2)
    return _redis_client


def oldest_points(node_ids: Iterable[int]) -> dict[int, float]:
    """The time of each node's oldest point still kept, for the nodes that have one: one round trip."""
    ids = list(node_ids)
    if not ids:
        return {}
    found: dict[int, float] = {}
    try:
        client = _redis()
        if client is None:
            firsts = [(list(cache.get(_history_key(i)) or []) or [None])[0] for i in ids]
        else:
            pipe = client.pipeline(transaction=False)
            for node_id in ids:
                pipe.lindex(_history_key(node_id), 0)
            firsts = [json.loads(raw) if raw else None for raw in pipe.execute()]
    except Exception:
        log.warning("could not read the sample history of %s nodes", len(ids), exc_info=True)
        return {}
    for node_id, point in zip(ids, firsts, strict=True):
        t = point.get("t") if isinstance(point, dict) else None
        if isinstance(t, int | float) and not isinstance(t, bool):
            found[node_id] = float(t)
    return found


def sample_history(node_id: int) -> list[dict[str, Any]]:
    """Points of the last hour, oldest first."""
    key = _history_key(node_id)
    try:
        client = _redis()
        if client is not None:
            points = [json.loads(raw) for raw in client.lrange(key, 0, -1)]
        else:
            points = list(cache.get(key) or [])
    except Exception:
        log.warning("could not read the sample history of node %s", node_id, exc_info=True)
        return []
    cutoff = timezone.now().timestamp() - HISTORY_SECONDS
    return [p for p in points if (p.get("t") or 0) >= cutoff]


RECENT_POINTS = 60  # what recent_history reads of each node: ten minutes of 10-second heartbeats


def recent_history(node_ids: Iterable[int], seconds: float) -> dict[int, list[dict[str, Any]]]:
    """Each node's points of the last `seconds` (at most its last RECENT_POINTS), oldest first:
    one round trip for them all. A node without history, or a cache that does not answer, gives []."""
    ids = list(node_ids)
    cutoff = timezone.now().timestamp() - seconds
    found: dict[int, list[dict[str, Any]]] = dict.fromkeys(ids, [])
    if not ids:
        return found
    try:
        client = _redis()
        if client is None:
            raw = {node_id: list(cache.get(_history_key(node_id)) or [])[-RECENT_POINTS:] for node_id in ids}
        else:
            pipe = client.pipeline(transaction=False)
            for node_id in ids:
                pipe.lrange(_history_key(node_id), -RECENT_POINTS, -1)
            raw = {
                node_id: [json.loads(item) for item in items]
                for node_id, items in zip(ids, pipe.execute(), strict=True)
            }
    except Exception:
        log.warning("could not read the recent history of %s nodes", len(ids), exc_info=True)
        return found
    for node_id, points in raw.items():
        found[node_id] = [p for p in points if isinstance(p, dict) and (p.get("t") or 0) >= cutoff]
    return found


def mark_unreachable_nodes(grace: timedelta) -> int:
    """Nodes whose agent missed its heartbeats for longer than the grace become unreachable."""
    cutoff = timezone.now() - grace
    return Node.objects.filter(status=NodeStatus.READY, last_seen_at__lt=cutoff).update(status=NodeStatus.UNREACHABLE)


# Operator actions --------------------------------------------------------------------------


@transaction.atomic
def cordon_node(node: Node, *, reason: str, actor: User | None, address: str | None = None) -> Node:
    before = {"cordoned": node.cordoned, "reason": node.cordon_reason}
    node.cordoned = True
    node.cordon_reason = reason.strip()[:500]
    node.save(update_fields=["cordoned", "cordon_reason"])
    after = {"cordoned": True, "reason": node.cordon_reason}
    audit.record(actor, "node.cordon", node, changes=audit.diff(before, after), address=address)
    return node


@transaction.atomic
def set_disabled_engines(
    node: Node, *, disable: list[str], enable: list[str], actor: User | None, address: str | None = None
) -> Node:
    """Keep engines off a node, or let them back; the node hears at once (its desired state)."""
    from apps.cluster.engines import nodes_changed

    node = Node.objects.select_for_update().get(pk=node.pk)
    before = sorted(node.disabled_engines or [])
    after = sorted((set(before) | set(disable)) - set(enable))
    if after != before:
        node.disabled_engines = after
        node.save(update_fields=["disabled_engines"])
        audit.record(actor, "node.engines", node, changes={"disabled_engines": [before, after]}, address=address)
        pk = node.pk
        transaction.on_commit(lambda: nodes_changed({pk}))
    return node


@transaction.atomic
def set_engine_build(node: Node, build: str, *, actor: User | None, address: str | None = None) -> Node:
    """Choose which CUDA build of vLLM and SGLang the node installs (auto, cu13, cu129, none);
    the node hears at once and installs that build (the one it has stays until the new one works)."""
    from apps.cluster.engines import EngineConfigError, nodes_changed

    if build not in Node.EngineBuild.values:
        raise EngineConfigError(
            _("build: expected one of %(known)s, got %(value)r")
            % {"known": ", ".join(Node.EngineBuild.values), "value": build}
        )
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.engine_build
    if build != before:
        node.engine_build = build
        node.save(update_fields=["engine_build"])
        audit.record(actor, "node.engine_build", node, changes={"engine_build": [before, build]}, address=address)
        pk = node.pk
        transaction.on_commit(lambda: nodes_changed({pk}))
    return node


@transaction.atomic
def uncordon_node(node: Node, *, actor: User | None, address: str | None = None) -> Node:
    """Let replicas be placed on the node again; a drain under way ends (what moved stays moved)."""
    before = {"cordoned": node.cordoned, "reason": node.cordon_reason, "draining": node.drain_requested_at is not None}
    node.cordoned = False
    node.cordon_reason = ""
    node.drain_requested_at = node.drain_grace = None
    node.drain_force = False
    node.save(update_fields=["cordoned", "cordon_reason", "drain_requested_at", "drain_grace", "drain_force"])
    audit.record(
        actor,
        "node.uncordon",
        node,
        changes=audit.diff(before, {"cordoned": False, "reason": "", "draining": False}),
        address=address,
    )
    return node


@transaction.atomic
def set_labels(
    node: Node, *, set_labels: dict[str, str], remove: list[str], actor: User | None, address: str | None = None
) -> Node:
    """Keep labels on the node over what its agent says (a rack it was moved to), or drop kept ones."""
    from apps.cluster.reconciler import request_reconcile

    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        before = dict(node.labels or {})
        after = {k: v for k, v in before.items() if k not in set(remove)}
        after.update({str(k): str(v) for k, v in set_labels.items()})
        if after == before:
            return node
        node.labels = after
        node.save(update_fields=["labels"])
        changed = sorted(set(before) ^ set(after) | {k for k in after if before.get(k) != after[k]})
        audit.record(
            actor,
            "node.labels",
            node,
            changes={k: [before.get(k), after.get(k)] for k in changed},
            address=address,
        )
    request_reconcile()
    return node


def drain_node(
    node: Node, *, grace: int | None = None, force: bool = False, actor: User | None, address: str | None = None
) -> Node:
    """Cordon the node and move its replicas away: each is replaced elsewhere first (the model's
    minimum kept), then stopped: its engines run on for the requests in flight, `grace` seconds at
    most (LLMGW_DRAIN_GRACE_SECONDS when None), each stopped as soon as it is idle. A replica that
    cannot be placed elsewhere is waited for (its reasons shown) unless `force`, which stops it anyway."""
    from apps.cluster.reconciler import request_reconcile

    before = {"cordoned": node.cordoned, "draining": node.drain_requested_at is not None}
    node.cordoned = True
    node.cordon_reason = node.cordon_reason or str(_("draining"))
    node.drain_requested_at = node.drain_requested_at or timezone.now()
    node.drain_grace = grace
    node.drain_force = force
    node.save(update_fields=["cordoned", "cordon_reason", "drain_requested_at", "drain_grace", "drain_force"])
    audit.record(
        actor,
        "node.drain",
        node,
        changes=audit.diff(before, {"cordoned": True, "draining": True}),
        grace=grace,
        force=force or None,
        address=address,
    )
    request_reconcile()
    return node


def drain_status(node: Node) -> dict[str, Any] | None:
    """A drain under way: the replicas left on the node, and why each that cannot move waits."""
    from apps.catalog.selectors import translate_reason
    from apps.cluster.choices import ReplicaState
    from apps.cluster.models import Replica

    if node.drain_requested_at is None:
        return None
    left = (
        Replica.objects.filter(shards__node=node)
        .exclude(state=ReplicaState.STOPPING)
        .select_related("model")
        .distinct()
        .order_by("pk")
    )
    waiting = []
    for replica in left:
        replacement = Replica.objects.filter(replaces=replica).first()
        reasons = [
            translate_reason(r) for r in (replacement.rejections if replacement else []) or [] if isinstance(r, dict)
        ][:3]
        waiting.append(
            {
                "replica": replica.pk,
                "model": replica.model.name,
                "state": "moving" if replacement else "queued",
                "reasons": reasons,
            }
        )
    return {
        "requested_at": node.drain_requested_at,
        "grace": node.drain_grace,
        "force": node.drain_force,
        "left": len(waiting),
        "replicas": waiting,
    }


@transaction.atomic
def revoke_node(node: Node, *, actor: User | None, address: str | None = None) -> Node:
    """Cut a node off: its credential stops working and its websocket is closed at once."""
    node.credential_hash = None
    node.revoked_at = timezone.now()
    node.status = NodeStatus.REVOKED
    node.save(update_fields=["credential_hash", "revoked_at", "status"])
    audit.record(actor, "node.revoke", node, address=address)
    node_id = node.pk
    transaction.on_commit(lambda: _tell_agent(node_id, {"type": "agent.revoke", "reason": "revoked"}))
    return node


def _tell_agent(node_id: int, message: dict[str, Any]) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(node_group(node_id), message)
    except Exception:
        log.warning("could not reach the connection of node %s", node_id, exc_info=True)


# Reports of what the engines are doing -----------------------------------------------------------

SHARD_ID = re.compile(r"^r(\d+)s(\d+)$")


def _save_reported(shard: Any, fields: list[str]) -> bool:
    """Save what the agent said of a shard; False when the shard is gone: the reconciler released
    its replica (every shard of it had stopped) since this report read it. In a savepoint, so the
    rest of the report is still recorded."""
    try:
        with transaction.atomic():
            shard.save(update_fields=fields)
    except type(shard).NotUpdated:
        return False
    return True


@transaction.atomic
def record_report(node_id: int, states: list[dict[str, Any]]) -> set[int]:
    """Take the agent's word for its shards and move their replicas on: ready when every shard
    is, failed (with backoff) when one failed, released when a stopping one has stopped.
    Returns the ids of replicas whose state changed."""
    from apps.cluster.choices import ReplicaState, ShardState
    from apps.cluster.models import Replica, Shard
    from apps.cluster.reconciler import backoff, request_reconcile

    now = timezone.now()
    reported: dict[tuple[int, int], dict[str, Any]] = {}
    for entry in states:
        match = SHARD_ID.match(str(entry.get("shard", "")))
        if match:
            reported[(int(match.group(1)), int(match.group(2)))] = entry
    shards = {(s.replica_id, s.rank): s for s in Shard.objects.filter(node_id=node_id).select_related("replica")}
    touched: set[int] = set()
    for key, shard in shards.items():
        state = reported.get(key)
        if state is None:
            # Not running there. For a stopping replica that is what we wanted.
            if shard.replica.state == ReplicaState.STOPPING and shard.state != ShardState.STOPPED:
                shard.state = ShardState.STOPPED
                if _save_reported(shard, ["state"]):
                    touched.add(shard.replica_id)
            continue
        new_state = state.get("state") if state.get("state") in ShardState.values else shard.state
        fields = {
            "state": new_state,
            "pid": state.get("pid"),
            "exit_code": state.get("exit_code"),
            "log_tail": list(state.get("log_tail") or [])[-50:],
            "message": str(state.get("message") or ""),
            "context_tokens": state.get("context_tokens"),
        }
        if any(getattr(shard, k) != v for k, v in fields.items()):
            for k, v in fields.items():
                setattr(shard, k, v)
            shard.reported_at = now
            if _save_reported(shard, [*fields, "reported_at"]):
                touched.add(shard.replica_id)
    for replica in Replica.objects.filter(pk__in=touched).prefetch_related("shards"):
        parts = list(replica.shards.all())
        if replica.state == ReplicaState.STOPPING:
            done = (ShardState.STOPPED, ShardState.FAILED)
            if all(s.state in done for s in parts):
                request_reconcile()
            elif any(s.rank == 0 and s.state in done for s in parts):
                # Its other ranks ran on while rank 0 drained (reconciler.desired_shards): their nodes'
                # agents are told to stop them now.
                waiting = {s.node_id for s in parts if s.rank > 0 and s.state not in done}
                Node.objects.filter(pk__in=waiting).update(desired_version=F("desired_version") + 1)
            continue
        failed = [s for s in parts if s.state == ShardState.FAILED]
        if failed:
            if replica.state != ReplicaState.FAILED:
                replica.state = ReplicaState.FAILED
                replica.failures += 1
                replica.next_attempt_at = now + backoff(replica.failures)
                first = failed[0]
                replica.message = _("An engine exited with code %(code)s: %(message)s") % {
                    "code": first.exit_code if first.exit_code is not None else "-",
                    "message": first.message or (first.log_tail[-1] if first.log_tail else ""),
                }
                replica.ready_at = None
                replica.save(update_fields=["state", "failures", "next_attempt_at", "message", "ready_at"])
                audit.record(
                    None,
                    "replica.failed",
                    replica,
                    changes={"failures": replica.failures, "exit_code": first.exit_code},
                )
        elif all(s.state == ShardState.READY for s in parts) and replica.state != ReplicaState.READY:
            replica.state = ReplicaState.READY
            replica.ready_at = now
            replica.failures = 0
            replica.message = ""
            replica.save(update_fields=["state", "ready_at", "failures", "message"])
            request_reconcile()  # a replacement ready: the replica it replaces may stop now, not at the next beat
    return touched


def record_heartbeats(samples: dict[int, tuple[dict[str, Any], Any]]) -> int:
    """Store the latest sample of many nodes at once; returns how many rows were written."""
    return len(write_heartbeats(samples))


# The rows locked in id order first, as every writer of node rows does (a registration locks one),
# so two writers never hold one row each while waiting for the other's; then one UPDATE from the
# arrays. A node revoked meanwhile stays revoked. One statement, one round trip, one row write
# per node, and the desired state versions come back with it.
HEARTBEATS_SQL = """
WITH v AS (
    SELECT * FROM unnest(%s::bigint[], %s::text[], %s::timestamptz[]) AS v(id, sample, at)
), locked AS (
    SELECT n.id FROM {table} n JOIN v ON v.id = n.id ORDER BY n.id FOR UPDATE OF n
)
UPDATE {table} n
SET sample = v.sample::jsonb, sampled_at = v.at, last_seen_at = v.at,
    status = CASE WHEN n.revoked_at IS NULL THEN %s ELSE %s END
FROM v, locked
WHERE n.id = v.id AND locked.id = n.id
RETURNING n.id, n.desired_version
"""


def write_heartbeats(samples: dict[int, tuple[dict[str, Any], Any]]) -> dict[int, int]:
    """Store the latest sample of many nodes at once and return {node id: desired state version}
    of the rows written. `samples` maps node id to (sample, time received). On PostgreSQL one
    statement per 500 nodes; elsewhere a bulk update. The samples also go to the nodes'
    histories and the fleet rollup."""
    if not samples:
        return {}
    from django.db import connection

    ids = sorted(samples)
    versions: dict[int, int] = {}
    if connection.vendor == "postgresql":
        sql = HEARTBEATS_SQL.format(table=connection.ops.quote_name(Node._meta.db_table))
        with transaction.atomic(), connection.cursor() as cursor:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor.execute(
                    sql,
                    [
                        chunk,
                        [json.dumps(samples[i][0], separators=(",", ":")) for i in chunk],
                        [samples[i][1] for i in chunk],
                        NodeStatus.READY,
                        NodeStatus.REVOKED,
                    ],
                )
                versions.update(cursor.fetchall())
    else:
        rows = [
            Node(
                pk=node_id,
                sample=samples[node_id][0],
                sampled_at=samples[node_id][1],
                last_seen_at=samples[node_id][1],
                status=NodeStatus.READY,
            )
            for node_id in ids
        ]
        with transaction.atomic():
            list(Node.objects.select_for_update().filter(pk__in=ids).order_by("pk").values_list("pk", flat=True))
            Node.objects.bulk_update(rows, ["sample", "sampled_at", "last_seen_at", "status"], batch_size=500)
            Node.objects.filter(pk__in=ids, revoked_at__isnull=False).update(status=NodeStatus.REVOKED)
            versions = dict(Node.objects.filter(pk__in=ids).values_list("pk", "desired_version"))
    append_histories({node_id: sample for node_id, (sample, _at) in samples.items() if node_id in versions})
    return versions


Health = tuple[bool, int, str]  # (uncorrected ECC errors, foreign processes, why it cannot be trusted)


def sample_health(sample: dict[str, Any]) -> dict[int, Health]:
    return {int(g["index"]): (*gpu_health(g), gpu_fault(g)) for g in sample.get("gpus") or []}


def write_gpu_health(node_id: int, health: dict[int, Health], known: dict[int, Health] | None) -> None:
    """Write the health rows of the devices whose health changed (rare: an ECC fault, a foreign
    process, a MIG or partition layout that changed under the agent)."""
    for index, (fault, foreign, untrusted) in health.items():
        if known is None or known.get(index) != (fault, foreign, untrusted):
            Gpu.objects.filter(node_id=node_id, index=index).update(
                ecc_fault=fault, foreign_processes=foreign, fault=untrusted
            )


def append_histories(samples: dict[int, dict[str, Any]]) -> None:
    """Add one history point per node: the last hour of points, kept outside the database in a
    capped Redis list per node (one round trip for them all), or in the local cache without Redis.
    Each point carries its node's per-model claims, use and queues where they were read. The
    engines' own figures in the samples go to their models' histories (apps.cluster.engine_history)."""
    from apps.cluster import engine_history, rollup

    engine_history.record(samples)
    try:
        rollup.record(samples, _redis())
    except Exception:  # the page's figures are a convenience too
        log.warning("could not fold the samples of %s nodes into the fleet rollup", len(samples), exc_info=True)
    try:
        client = _redis()
        if client is None:
            stored = {node_id: list(cache.get(_history_key(node_id)) or []) for node_id in samples}
            models = _model_figures(
                samples, {node_id: points[-1] if points else None for node_id, points in stored.items()}
            )
            for node_id, sample in samples.items():
                points = stored[node_id]
                points.append(_history_point(sample, models.get(node_id)))
                cache.set(_history_key(node_id), points[-HISTORY_POINTS:], timeout=HISTORY_SECONDS)
            return
        quiet = [node_id for node_id, sample in samples.items() if not sample.get("shards")]
        last: dict[int, dict[str, Any] | None] = {}
        if quiet:
            pipe = client.pipeline(transaction=False)
            for node_id in quiet:
                pipe.lindex(_history_key(node_id), -1)
            last = {
                node_id: json.loads(raw) if raw else None for node_id, raw in zip(quiet, pipe.execute(), strict=True)
            }
        models = _model_figures(samples, last)
        pipe = client.pipeline(transaction=False)
        for node_id, sample in samples.items():
            key = _history_key(node_id)
            pipe.rpush(key, json.dumps(_history_point(sample, models.get(node_id)), separators=(",", ":")))
            pipe.ltrim(key, -HISTORY_POINTS, -1)
            pipe.expire(key, HISTORY_SECONDS)
        pipe.execute()
    except Exception:  # the history is a convenience; a cache outage must not lose the heartbeats
        log.warning("could not keep the sample history of %s nodes", len(samples), exc_info=True)
