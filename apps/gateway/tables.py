"""What the gateway knows, in memory: API keys, and where each model's requests can go.

Words used across the gateway, one meaning each:

- a *route* (`ModelRoute`) is a model's entry: its upstreams, fallbacks and scaling;
- an *upstream* (`Upstream`) is one place a request is forwarded to: a ready replica's rank-0
  engine, or an external provider;
- a *replica* is the database's row for one running copy of a model (apps.cluster);
- an *endpoint* is one of the gateway's own API paths as the client calls it (apps.gateway.intake).

Built from the database in a worker thread (never on the request path) and swapped in whole,
so a request sees one consistent picture. Nothing here counts requests: an upstream's load
lives in its `InFlight` (apps.gateway.slots), one object per upstream id for the life of the
process, which each new table is bound to; a table reload therefore never touches a count.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from django.db.models import QuerySet

    from apps.catalog.models import Model as CatalogModel
    from apps.gateway.slots import InFlight
    from apps.quotas.limiter import Limit

__all__ = [
    "KeyEntry",
    "ModelRoute",
    "Stopped",
    "Tables",
    "Upstream",
    "current_version",
    "key_hash",
    "load_tables",
    "tables_channel",
    "unplaceable_reason",
]


@dataclass(eq=False, slots=True)
class Upstream:
    """One ready engine (a replica's rank-0 shard) or an external provider."""

    id: str  # replica id, or "external:<model>"
    url: str  # base URL without /v1
    secret: str | None
    capacity: int  # requests it serves at once (the profile's parallel slots)
    hardware: str  # GPU class, "cpu" or "external"
    node: str
    model: str
    upstream_model: str
    engine: str = "llama.cpp"  # "llama.cpp", "vllm", "sglang" or "external"
    key_file: str = ""
    context_size: int | None = None  # tokens one request may hold (prompt and answer), when known
    # This process's count of requests on it, shared by every table that lists this upstream id.
    inflight: InFlight | None = None

    def api_key(self) -> str | None:
        if self.key_file:
            return _key_file.read(self.key_file)
        return self.secret


class _KeyFiles:
    """Provider keys read from their files, read again whenever the file changed (a stat per
    request, not a read), so rotating a key takes effect at once."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, int, str | None]] = {}

    def read(self, path: str) -> str | None:
        try:
            info = os.stat(path)
        except OSError:
            self._cache.pop(path, None)
            return None
        cached = self._cache.get(path)
        if cached is not None and cached[0] == info.st_mtime and cached[1] == info.st_size:
            return cached[2]
        try:
            with open(path, encoding="utf-8") as handle:
                value = handle.read().strip() or None
        except OSError:
            return None
        self._cache[path] = (info.st_mtime, info.st_size, value)
        return value


_key_file = _KeyFiles()


@dataclass
class ModelRoute:
    name: str
    upstreams: list[Upstream]
    fallbacks: list[str]
    min_replicas: int
    hardware: list[str]
    max_replicas: int = 1
    owner_keys: tuple[str, ...] = ()
    external: bool = False
    #: Replicas placed and still starting: a request may wait for them.
    starting: int = 0
    #: Why no replica can be placed now (placement's first refusal), when every wanted replica is
    #: pending with refusals and none is starting; None while one is coming or none is wanted.
    unplaceable: str | None = None


@dataclass(frozen=True)
class KeyEntry:
    key_id: int
    user_id: int
    project_id: int | None
    team_id: int | None
    org_id: int | None
    allowed_models: frozenset[str] | None
    expires_at: float | None
    limits: tuple[Any, ...] = ()
    # The weights of its organisation, team, project and itself when a model is contended, and the
    # highest band its requests may ask for (0 interactive, 1 batch; apps.gateway.fairness).
    weights: tuple[int, int, int, int] = (1, 1, 1, 1)
    ceiling: int = 0

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models


@dataclass
class Guards:
    """The enabled policies' rules by where they are attached, and the rule sets made of them."""

    everyone: list[Any] = field(default_factory=list)
    organizations: dict[int, list[Any]] = field(default_factory=dict)
    teams: dict[int, list[Any]] = field(default_factory=dict)
    projects: dict[int, list[Any]] = field(default_factory=dict)
    models: dict[str, list[Any]] = field(default_factory=dict)
    compiled: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.everyone or self.organizations or self.teams or self.projects or self.models)

    def for_call(self, entry: KeyEntry, model: str) -> Any:
        """The PolicySet in force for a key and a model (compiled once per combination), or None."""
        from apps.guardrails.engine import PolicySet

        key = (entry.org_id, entry.team_id, entry.project_id, model)
        found = self.compiled.get(key)
        if found is None:
            rules = [
                *self.everyone,
                *self.organizations.get(entry.org_id or 0, ()),
                *self.teams.get(entry.team_id or 0, ()),
                *self.projects.get(entry.project_id or 0, ()),
                *self.models.get(model, ()),
            ]
            found = self.compiled[key] = PolicySet(rules) if rules else False
        return found or None


def load_guards() -> Guards:
    from django.db.models import Prefetch

    from apps.guardrails.models import Policy, Rule

    guards = Guards()
    policies = (
        Policy.objects.filter(enabled=True)
        .select_related("model")
        .prefetch_related(Prefetch("rules", queryset=Rule.objects.filter(enabled=True).order_by("order", "pk")))
        .order_by("name")
    )
    for policy in policies:
        specs = [rule.spec() for rule in policy.rules.all()]
        if not specs:
            continue
        if policy.model is not None:
            guards.models.setdefault(policy.model.name, []).extend(specs)
        elif policy.project_id:
            guards.projects.setdefault(policy.project_id, []).extend(specs)
        elif policy.team_id:
            guards.teams.setdefault(policy.team_id, []).extend(specs)
        elif policy.organization_id:
            guards.organizations.setdefault(policy.organization_id, []).extend(specs)
        else:
            guards.everyone.extend(specs)
    return guards


@dataclass(frozen=True, slots=True)
class Stopped:
    """A replica being stopped: no request is routed to it, and its engine runs on for those in
    flight, `grace` seconds at most. Said to a client whose request it still held when it went."""

    replica: str  # as Upstream.id
    reason: str  # why, in English as the API's errors are ("a profile change replaced it")
    grace: int

    def message(self) -> str:
        return f"the replica r{self.replica} was stopped: its drain grace of {self.grace} s ran out ({self.reason})"


@dataclass
class Tables:
    keys: dict[str, KeyEntry] = field(default_factory=dict)
    models: dict[str, ModelRoute] = field(default_factory=dict)
    version: int = -1
    guards: Guards = field(default_factory=Guards)
    #: Replicas being stopped, by id.
    stopping: dict[str, Stopped] = field(default_factory=dict)

    def upstreams(self) -> list[Upstream]:
        return [upstream for route in self.models.values() for upstream in route.upstreams]


def key_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def unplaceable_reason(rejections: list[Any]) -> str | None:
    """Placement's refusals of a pending replica in one line: the first refusal, and how many more."""
    found = [r for r in rejections if isinstance(r, dict) and r.get("message")]
    if not found:
        return None
    first = found[0]
    where = " on ".join(str(part) for part in (first.get("profile"), first.get("node")) if part)
    line = f"{where}: {first['message']}" if where else str(first["message"])
    if len(found) > 1:
        line += f" (and {len(found) - 1} more refusal{'s' if len(found) > 2 else ''}; see explain)"
    return line


def load_tables() -> Tables:
    """Read keys, limits and ready replicas (in a worker thread: this is ORM work)."""
    from apps.quotas.limiter import load_all_limits

    version = current_version()
    all_limits = load_all_limits()
    return Tables(
        keys=_load_keys(all_limits),
        models=_load_models(),
        version=version,
        guards=load_guards(),
        stopping=load_stopping(),
    )


def _load_keys(all_limits: dict[str, Limit]) -> dict[str, KeyEntry]:
    """Every active key of an active user, by its hash, with its limits and fair-share weights."""
    from apps.accounts.choices import Band
    from apps.accounts.models import ApiKey
    from apps.quotas.limiter import pick_limits

    keys: dict[str, KeyEntry] = {}
    for key in ApiKey.objects.active().filter(user__is_active=True).select_related("project__team__organization"):
        project = key.project
        team_id = project.team_id if project else None
        org_id = project.team.organization_id if project else None
        weights = (
            (project.team.organization.weight, project.team.weight, project.weight, key.weight)
            if project
            else (1, 1, 1, key.weight)
        )
        bands = {key.band, project.band if project else Band.INTERACTIVE}
        keys[key.key_hash] = KeyEntry(
            key_id=key.pk,
            user_id=key.user_id,
            project_id=key.project_id,
            team_id=team_id,
            org_id=org_id,
            allowed_models=frozenset(key.allowed_models) if key.allowed_models else None,
            expires_at=key.expires_at.timestamp() if key.expires_at else None,
            limits=tuple(
                pick_limits(all_limits, key_id=key.pk, project_id=key.project_id, team_id=team_id, org_id=org_id)
            ),
            weights=weights,
            ceiling=1 if Band.BATCH in bands else 0,
        )
    return keys


def _live_models() -> QuerySet[CatalogModel]:
    """The live models with all that their routes read, in a fixed number of queries: profiles,
    owners, and the replicas not being stopped with their rank-0 shard and its node."""
    from django.db.models import Prefetch

    from apps.catalog.models import Model
    from apps.cluster.choices import ReplicaState
    from apps.cluster.models import Replica, Shard

    replicas = (
        Replica.objects.exclude(state=ReplicaState.STOPPING)
        .select_related("profile")
        .prefetch_related(Prefetch("shards", queryset=Shard.objects.filter(rank=0).select_related("node")))
    )
    catalog = Model.objects.live().prefetch_related("profiles", Prefetch("replicas", queryset=replicas))
    return catalog.select_related("organization", "team__organization", "project__team__organization")


def _load_models() -> dict[str, ModelRoute]:
    """Every live model's route, by name: its external provider and ready replicas as upstreams,
    and, while none is ready or starting, why placement refused its pending ones."""
    from apps.cluster.choices import ReplicaState

    models: dict[str, ModelRoute] = {}
    for model in _live_models():
        upstreams: list[Upstream] = []
        if model.is_external:
            upstreams.append(
                Upstream(
                    id=f"external:{model.name}",
                    url=model.external_url.rstrip("/").removesuffix("/v1"),
                    secret=None,
                    capacity=1_000_000,
                    hardware="external",
                    node="",
                    model=model.name,
                    upstream_model=model.external_model,
                    engine="external",
                    key_file=model.external_api_key_file,
                )
            )
        starting = 0
        refusals: list[Any] = []
        for replica in model.replicas.all():
            if replica.state == ReplicaState.STARTING:
                starting += 1
                continue
            if replica.state == ReplicaState.PENDING:
                refusals = refusals or list(replica.rejections or [])
                continue
            if replica.state != ReplicaState.READY:
                continue
            shard = next(iter(replica.shards.all()), None)
            if shard is None or replica.profile is None:
                continue
            address = shard.node.address or "127.0.0.1"
            host = f"[{address}]" if ":" in address else address
            upstreams.append(
                Upstream(
                    id=str(replica.pk),
                    url=f"http://{host}:{shard.port}",
                    secret=shard.secret,
                    capacity=max(1, replica.profile.parallel),
                    hardware=replica.profile.accelerator,
                    node=shard.node.name,
                    model=model.name,
                    upstream_model=model.name,
                    engine=replica.profile.engine,
                    # What the profile states, else what the engine said of itself once ready.
                    context_size=replica.profile.context_size or shard.context_tokens,
                )
            )
        profiles = list(model.profiles.all())
        hardware = sorted({p.accelerator for p in profiles}) or (["external"] if model.is_external else [])
        unplaceable = None
        if not upstreams and not starting and refusals:
            unplaceable = unplaceable_reason(refusals)
        models[model.name] = ModelRoute(
            name=model.name,
            upstreams=upstreams,
            fallbacks=list(model.fallbacks or []),
            min_replicas=model.min_replicas,
            max_replicas=max(model.max_replicas, model.load_replicas),
            hardware=hardware,
            owner_keys=model.owner_keys(),
            external=model.is_external,
            starting=starting,
            unplaceable=unplaceable,
        )
    return models


def load_stopping() -> dict[str, Stopped]:
    """The replicas being stopped, with why (in English) and their drain grace."""
    from django.utils import translation

    from apps.cluster.choices import ReplicaState, StopReason
    from apps.cluster.models import Replica

    out: dict[str, Stopped] = {}
    rows = Replica.objects.filter(state=ReplicaState.STOPPING).values_list("pk", "stop_reason", "drain_grace")
    with translation.override("en"):
        for pk, reason, grace in rows:
            said = str(StopReason(reason).label) if reason in StopReason.values else "it was stopped"
            out[str(pk)] = Stopped(replica=str(pk), reason=said, grace=grace or 0)
    return out


def tables_channel() -> str:
    """Where a change to the gateway's tables is announced to every gateway process (with Redis)."""
    from django.conf import settings

    return f"{settings.REDIS_PREFIX}:{{gw}}:tables"


def current_version() -> int:
    """The table version, read every second by every gateway process: one plain query (the ORM
    spent ~0.2 ms of Python building it, holding the interpreter lock the requests wait on)."""
    from django.db import connection

    from apps.gateway.models import TableVersion

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT version FROM {connection.ops.quote_name(TableVersion._meta.db_table)} WHERE id = 1")
        row = cursor.fetchone()
    return int(row[0]) if row is not None and row[0] is not None else 0
