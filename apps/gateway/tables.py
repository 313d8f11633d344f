"""What the gateway knows, in memory: API keys and where each model is served.

Built from the database in a worker thread (never on the request path) and swapped in
whole, so a request sees one consistent picture.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Endpoint", "KeyEntry", "ModelRoute", "Tables", "load_tables"]


@dataclass(eq=False)
class Endpoint:
    """One ready engine (a replica's rank-0 shard) or an external provider."""

    id: str  # replica id, or "external:<model>"
    url: str  # base URL without /v1
    secret: str | None
    slots: int
    hardware: str  # GPU class, "cpu" or "external"
    node: str
    model: str
    upstream_model: str
    key_file: str = ""
    # Mutable, process-local: requests in flight right now.
    outstanding: int = 0
    failed_until: float = 0.0

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
    endpoints: list[Endpoint]
    fallbacks: list[str]
    min_replicas: int
    hardware: list[str]
    max_replicas: int = 1
    owner_keys: tuple[str, ...] = ()
    external: bool = False


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


@dataclass
class Tables:
    keys: dict[str, KeyEntry] = field(default_factory=dict)
    models: dict[str, ModelRoute] = field(default_factory=dict)
    version: int = -1


def key_hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def load_tables(previous: Tables | None = None) -> Tables:
    """Read keys, limits and ready replicas. Keeps in-flight counts of endpoints that remain."""
    from django.db.models import Prefetch

    from apps.accounts.models import ApiKey
    from apps.catalog.models import Model
    from apps.cluster.choices import ReplicaState
    from apps.cluster.models import Replica, Shard
    from apps.gateway.models import TableVersion

    version = TableVersion.objects.filter(pk=1).values_list("version", flat=True).first() or 0
    from apps.quotas.limiter import load_all_limits, pick_limits

    all_limits = load_all_limits()

    keys: dict[str, KeyEntry] = {}
    for key in ApiKey.objects.active().filter(user__is_active=True).select_related("project__team"):
        project = key.project
        team_id = project.team_id if project else None
        org_id = project.team.organization_id if project else None
        keys[key.key_hash] = KeyEntry(
            key_id=key.pk, user_id=key.user_id, project_id=key.project_id, team_id=team_id, org_id=org_id,
            allowed_models=frozenset(key.allowed_models) if key.allowed_models else None,
            expires_at=key.expires_at.timestamp() if key.expires_at else None,
            limits=tuple(pick_limits(all_limits, key_id=key.pk, project_id=key.project_id, team_id=team_id,
                                     org_id=org_id)),
        )

    old: dict[str, Endpoint] = {}
    if previous is not None:
        for route in previous.models.values():
            for endpoint in route.endpoints:
                old[endpoint.id] = endpoint
    models: dict[str, ModelRoute] = {}
    ready = Replica.objects.filter(state=ReplicaState.READY).select_related("profile").prefetch_related(
        Prefetch("shards", queryset=Shard.objects.filter(rank=0).select_related("node")))
    for model in Model.objects.prefetch_related(Prefetch("replicas", queryset=ready)).select_related(
            "organization", "team__organization", "project__team__organization"):
        endpoints: list[Endpoint] = []
        if model.is_external:
            endpoint = Endpoint(id=f"external:{model.name}", url=model.external_url.rstrip("/").removesuffix("/v1"),
                                secret=None, slots=1_000_000, hardware="external", node="", model=model.name,
                                upstream_model=model.external_model, key_file=model.external_api_key_file)
            endpoints.append(endpoint)
        for replica in model.replicas.all():
            shard = next(iter(replica.shards.all()), None)
            if shard is None or replica.profile is None:
                continue
            address = shard.node.address or "127.0.0.1"
            host = f"[{address}]" if ":" in address else address
            endpoint = Endpoint(
                id=str(replica.pk), url=f"http://{host}:{shard.port}", secret=shard.secret,
                slots=max(1, replica.profile.parallel), hardware=replica.profile.accelerator,
                node=shard.node.name, model=model.name, upstream_model=model.name,
            )
            if endpoint.id in old:
                endpoint.outstanding = old[endpoint.id].outstanding
                endpoint.failed_until = old[endpoint.id].failed_until
            endpoints.append(endpoint)
        hardware = sorted({p.accelerator for p in model.profiles.all()}) or (["external"] if model.is_external else [])
        models[model.name] = ModelRoute(
            name=model.name, endpoints=endpoints, fallbacks=list(model.fallbacks or []),
            min_replicas=model.min_replicas, max_replicas=max(model.max_replicas, model.load_replicas),
            hardware=hardware, owner_keys=model.owner_keys(),
            external=model.is_external,
        )
    return Tables(keys=keys, models=models, version=version)


def current_version() -> int:
    from apps.gateway.models import TableVersion

    return TableVersion.objects.filter(pk=1).values_list("version", flat=True).first() or 0
