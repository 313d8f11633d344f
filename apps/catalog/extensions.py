"""What the cluster app adds to the catalogue, in one place.

The catalogue sits below the cluster app (accounts < quotas < catalog < cluster): a replica's row
points at its model, and the cluster app reads the catalogue to decide what runs where. The
catalogue never imports the cluster app, not even inside a function (an import-linter contract in
pyproject.toml holds it to that); what it needs of it the cluster app registers here from its
AppConfig.ready(), as the apps above the cluster do in apps.cluster.extensions:

- a pass of the reconciler, asked for once a change to a model or a profile commits
  (`reconcile`);
- a deleted model's replicas, stopped (`stop_replicas`: how many stop);
- the profile fields placement's plugins declare (`plugin_fields`: facility's keep_within and
  power_watts), beside those every profile has (apps.catalog.profile_fields);
- the rows that go with a model when it is deleted, and are never deleted on their own
  (`add_owned`: replicas and shards; the admin asks no permission for them).

A slot nobody filled answers as "nothing" (no pass asked for, no replica stopped, no field of a
plugin), so the catalogue runs on its own in tests that leave the cluster app out.

    from apps.catalog.extensions import EXTENSIONS

    EXTENSIONS.reconcile = reconciler.request_reconcile              # in ClusterConfig.ready()

Registering is idempotent: ready() may run more than once in a test process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apps.catalog.models import Model
    from llmgw.fields import ProfileField

__all__ = ["EXTENSIONS", "Extensions", "PluginFields", "Reconcile", "StopReplicas"]

# Kicks a pass of the reconciler once the current transaction commits.
Reconcile = Callable[[], None]
# Stops a deleted model's replicas (pending ones go, the others drain); returns how many stop.
StopReplicas = Callable[["Model"], int]
# The profile fields the placement plugins declared, in the order they registered.
PluginFields = Callable[[], "tuple[ProfileField, ...]"]


@dataclass
class Extensions:
    reconcile: Reconcile | None = None
    stop_replicas: StopReplicas | None = None
    plugin_fields: PluginFields | None = None
    owned: list[type[Any]] = field(default_factory=list)

    # Registering --------------------------------------------------------------------------------

    def add_owned(self, row: type[Any]) -> None:
        if row not in self.owned:
            self.owned.append(row)

    # Asking -------------------------------------------------------------------------------------

    def changed(self) -> None:
        """A model or profile changed: ask for a reconciler pass once it commits (if one runs)."""
        if self.reconcile is not None:
            self.reconcile()

    def stop(self, model: Model) -> int:
        """Stop a deleted model's replicas; 0 when no app runs any."""
        return self.stop_replicas(model) if self.stop_replicas is not None else 0

    def fields(self) -> tuple[ProfileField, ...]:
        return self.plugin_fields() if self.plugin_fields is not None else ()


EXTENSIONS = Extensions()
