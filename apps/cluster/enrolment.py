"""How a node joins: enrolment tokens traded for a credential, and the registration of its agent.

An operator makes a one-time enrolment token for a node name (`create_enrollment`, `llmgw ctl
node add`); the node's agent trades it for its own credential (`enroll_node`), which is returned
once and stored hashed, and presents that credential on every connection (`authenticate_node`).
A node enrolled again gets a new credential, and its old connection is told to go.

Each time its agent connects it registers (`register_node`): its hardware and GPUs as the agent
sees them, written over what the node row said, except what an operator decided (a cordon, kept
labels, disabled engines). The node's GPU rows follow its registration, and only the rows that
changed are written. The multi-node NVLink domain its cards name comes from the app registered for
it (apps.cluster.extensions), none when no such app is installed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import Field
from django.utils import timezone
from django.utils.translation import gettext as _

from agent.messages import GpuFigures
from apps.accounts import audit
from apps.accounts.models import User
from apps.cluster.actions import tell_agent
from apps.cluster.choices import NodeStatus
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.history import append_histories
from apps.cluster.models import EnrollmentToken, Gpu, Node
from apps.cluster.reports import gpu_fault, gpu_health
from llmgw.errors import ServiceError

__all__ = [
    "CREDENTIAL_PREFIX",
    "EnrollmentRefused",
    "NewEnrollment",
    "authenticate_node",
    "connect_node",
    "connect_nodes",
    "create_enrollment",
    "desired_version",
    "enroll_node",
    "issue_credential",
    "node_or_staff",
    "register_node",
    "register_nodes",
    "set_connection",
    "validate_node_name",
]

CREDENTIAL_PREFIX = "llmgwn_"
TOKEN_PREFIX = "llmgwe_"
log = logging.getLogger(__name__)

RESERVED_NODE_NAMES = frozenset({"add"})  # /nodes/add/ is the console's form
NODE_NAME = re.compile(r"^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# Enrollment ----------------------------------------------------------------------------


class EnrollmentRefused(ServiceError):
    """An enrollment token that is unknown, used or expired: the agent may not join with it."""

    status = 403
    code = "enrollment_refused"


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
        transaction.on_commit(lambda: tell_agent(node.pk, {"type": "agent.revoke", "reason": "re-enrolled"}))
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


# Registration ---------------------------------------------------------------------------


@transaction.atomic
def register_node(node_id: int, body: dict[str, Any], *, address: str | None = None) -> Node:
    """Record what the agent says it is. A registration never clears an operator's cordon."""
    node = Node.objects.select_for_update().get(pk=node_id)
    now = timezone.now()
    fields, changes = _take_registration(node, body, address, now)
    node.save(update_fields=fields)
    gpus = body["hardware"].get("gpus", []) or []
    _sync_gpus({node.pk: (gpus, (body.get("sample") or {}).get("gpus") or [])})
    if changes:
        audit.record(None, "node.register", node, changes=changes)
    if body.get("sample"):
        append_histories({node.pk: body["sample"]})
    return node


def register_nodes(joins: list[tuple[int, dict[str, Any], str | None]]) -> list[Node | Exception]:
    """register_node for many agents at once (node id, registration body, address each), in one
    transaction: one read and one write of their node rows, one of their GPU rows. A batch the
    database refuses is registered again one agent at a time, so one agent's bad registration
    fails only its own; the same node twice in a batch (two connections at once) is registered in
    turn. Each answer is the node, or the exception its registration raised."""
    first: dict[int, int] = {}
    for i, (node_id, _body, _address) in enumerate(joins):
        first.setdefault(node_id, i)
    together = sorted(first.values(), key=lambda i: joins[i][0])  # rows locked in id order: no deadlock
    out: list[Node | Exception | None] = [None] * len(joins)
    if len(together) > 1:
        try:
            for i, node in zip(together, _register_together([joins[i] for i in together]), strict=True):
                out[i] = node
        except Exception as exc:
            log.warning(
                "%s registrations refused together (%s: %s); registering them one by one",
                len(together),
                type(exc).__name__,
                exc,
            )
            out = [None] * len(joins)
    for i, (node_id, body, address) in enumerate(joins):
        if out[i] is None:
            try:
                out[i] = register_node(node_id, body, address=address)
            except Exception as exc:
                out[i] = exc
    return [answer for answer in out if answer is not None]


@transaction.atomic
def _register_together(joins: list[tuple[int, dict[str, Any], str | None]]) -> list[Node]:
    """register_node for agents of different nodes, in id order, in one transaction."""
    rows = Node.objects.select_for_update().in_bulk([node_id for node_id, _b, _a in joins])
    missing = [node_id for node_id, _b, _a in joins if node_id not in rows]
    if missing:
        raise Node.DoesNotExist(f"no node {missing[0]}")
    now = timezone.now()
    nodes, changed, samples = [], [], {}
    written: dict[tuple[str, ...], list[Node]] = {}
    for node_id, body, address in joins:
        node = rows[node_id]
        taken, changes = _take_registration(node, body, address, now)
        nodes.append(node)
        written.setdefault(tuple(taken), []).append(node)
        if changes:
            changed.append((node, changes))
        if body.get("sample"):
            samples[node_id] = body["sample"]
    for fields, group in written.items():
        _write_rows(group, fields)
    _sync_gpus(
        {
            node_id: (body["hardware"].get("gpus", []) or [], (body.get("sample") or {}).get("gpus") or [])
            for node_id, body, _address in joins
        }
    )
    for node, changes in changed:
        audit.record(None, "node.register", node, changes=changes)
    if samples:
        append_histories(samples)
    return nodes


def _write_rows(nodes: list[Node], fields: tuple[str, ...]) -> None:
    """Save these fields of the nodes' rows: one UPDATE by id, its parameters sent at once
    (executemany). Django's bulk_update writes the same in one statement of CASE ... WHEN per field
    and row, which took half a batched registration's CPU to build."""
    columns = [field for name in fields if isinstance(field := Node._meta.get_field(name), Field)]
    quote = connection.ops.quote_name
    sql = (
        f"UPDATE {quote(Node._meta.db_table)} SET "  # noqa: S608
        + ", ".join(f"{quote(str(column.column))} = %s" for column in columns)
        + f" WHERE {quote('id')} = %s"
    )
    with connection.cursor() as cursor:
        cursor.executemany(
            sql,
            [
                [column.get_db_prep_save(getattr(node, column.attname), connection) for column in columns] + [node.pk]
                for node in nodes
            ],
        )


def _take_registration(
    node: Node, body: dict[str, Any], address: str | None, now: Any
) -> tuple[list[str], dict[str, Any] | None]:
    """Set on the node's row what its agent registered; the fields set, and the changes worth an
    audit event (its agent version, card count or memory), None when there are none."""
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
    domain = EXTENSIONS.registered_domain(gpus) or node.hardware.get("nvlink_domain")
    if domain:
        hardware["nvlink_domain"] = domain
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
    after = {"agent_version": node.agent_version, "gpus": len(gpus), "memory": hardware.get("memory_total_bytes")}
    return fields, (audit.diff(before, after) if before != after else None)


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


def _gpu_values(gpu: GpuFigures, live: GpuFigures | None) -> dict[str, Any]:
    """The row of one device as its agent registered it, its health from the sample taken with it."""
    now: GpuFigures = {**gpu, **live} if live is not None else gpu
    fault, foreign = gpu_health(now)
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
        "fault": gpu_fault(now),
    }


def _sync_gpus(registered: dict[int, tuple[list[GpuFigures], list[GpuFigures]]]) -> None:
    """Make the GPU rows of each node match what its agent registered (node id: its devices and the
    sample taken with them), writing only what changed (an agent reconnecting with the same cards
    writes nothing here): one read for all the nodes, and at most one insert, update and delete."""
    existing: dict[int, dict[int, Gpu]] = {node_id: {} for node_id in registered}
    for stored in Gpu.objects.filter(node_id__in=list(registered)):
        existing[stored.node_id][stored.index] = stored
    create: list[Gpu] = []
    update: list[Gpu] = []
    gone: list[int] = []
    for node_id, (gpus, sampled) in registered.items():
        live = {g.get("index"): g for g in sampled}
        rows = existing[node_id]
        for gpu in gpus:
            index = int(gpu["index"])
            values = _gpu_values(gpu, live.get(index))
            row = rows.pop(index) if index in rows else None
            if row is None:
                create.append(Gpu(node_id=node_id, index=index, **values))
            elif any(getattr(row, k) != v for k, v in values.items()):
                for key, value in values.items():
                    setattr(row, key, value)
                update.append(row)
        gone += [g.pk for g in rows.values()]
    if create:
        Gpu.objects.bulk_create(create)
    if update:
        Gpu.objects.bulk_update(update, list(GPU_FIELDS))
    if gone:
        Gpu.objects.filter(pk__in=gone).delete()


def set_connection(node_id: int, channel_name: str) -> None:
    """Name the node's newest agent connection (older ones close when they see another named)."""
    Node.objects.filter(pk=node_id).update(connection=channel_name[:200])


def connect_node(secret: str, channel_name: str) -> tuple[int, str] | None:
    """The node (id, name) this credential names, now served by this connection; None for a bad
    credential."""
    return connect_nodes([(secret, channel_name)])[0]


def connect_nodes(joins: list[tuple[str, str]]) -> list[tuple[int, str] | None]:
    """connect_node for many connections at once (credential, channel name each), in one
    statement: the credentials are checked and the connections named in one UPDATE, which reads
    none of the rows' large values (a fleet joining at once does this thousands of times a minute).
    A bad credential is None in its own place and changes nothing for the others. The same
    credential twice (two connections of a node at once) is checked again in turn, so the later
    connection is the one named."""
    digests = [_hash(secret) if secret.startswith(CREDENTIAL_PREFIX) else None for secret, _channel in joins]
    out: list[tuple[int, str] | None] = [None] * len(joins)
    later: list[int] = []
    batch: dict[str, int] = {}
    for i, digest in enumerate(digests):
        if digest is None:
            continue
        if digest in batch:
            later.append(i)
        else:
            batch[digest] = i
    if batch:
        found = _connect_rows([(digest, joins[i][1][:200]) for digest, i in batch.items()])
        for digest, i in batch.items():
            out[i] = found.get(digest)
    for i in later:
        out[i] = _connect_rows([(str(digests[i]), joins[i][1][:200])]).get(str(digests[i]))
    return out


def _connect_rows(pairs: list[tuple[str, str]]) -> dict[str, tuple[int, str]]:
    """Name the connection of each node whose credential hash is given (hash, channel name, each
    hash once); the (id, name) of the nodes found, by hash."""
    table = connection.ops.quote_name(Node._meta.db_table)
    values = ", ".join(["(%s, %s)"] * len(pairs))
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {table} SET connection = joining.column2 FROM (VALUES {values}) AS joining "  # noqa: S608
            f"WHERE {table}.credential_hash = joining.column1 AND {table}.revoked_at IS NULL "
            f"RETURNING {table}.id, {table}.name, {table}.credential_hash",
            [value for pair in pairs for value in pair],
        )
        rows = cursor.fetchall()
    wanted = {digest for digest, _channel in pairs}
    return {digest: (int(pk), str(name)) for pk, name, digest in rows if digest in wanted}


def desired_version(node_id: int) -> int | None:
    return Node.objects.filter(pk=node_id).values_list("desired_version", flat=True).first()
