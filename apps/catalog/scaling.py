"""How many replicas a model wants and how it ranks for capacity, from its fields alone.

Shared by the catalog's Model rows and the simulator's models, so both scale and rank the same.
"""

from __future__ import annotations

from typing import Any

from apps.catalog.choices import CLASS_RANK, CapacityClass

__all__ = ["Scaling"]


class Scaling:
    """Mixed into a class with min_replicas, max_replicas, load_replicas, demand_until and
    capacity_class attributes."""

    min_replicas: int
    max_replicas: int
    load_replicas: int
    demand_until: Any
    capacity_class: str

    def wanted_replicas(self, now: Any) -> int:
        """Always-running replicas, one while requests for an idle model keep coming, more under load."""
        wanted = self.min_replicas
        if self.demand_until and self.demand_until > now:
            wanted = max(wanted, 1)
        return max(wanted, min(self.load_replicas, self.max_replicas))

    @property
    def effective_class(self) -> str:
        """Unset follows its scaling: a model kept running is standard, one started on demand opportunistic."""
        if self.capacity_class:
            return str(self.capacity_class)
        return CapacityClass.STANDARD if self.min_replicas > 0 else CapacityClass.OPPORTUNISTIC

    @property
    def class_rank(self) -> int:
        return CLASS_RANK[CapacityClass(self.effective_class)]
