"""Placement: which nodes and GPUs a replica gets, and why every other node was refused.

Pure Python (no Django): the caller builds an `Inventory` snapshot, asks `place`, `explain`,
`headroom` or `plan_preemption`, and stores what it decides. Importing this package registers
the built-in filters, scorers and checks; other apps add theirs with the register_* functions.
"""

from __future__ import annotations

from llmgw.fields import FieldError, ProfileField

from . import filters as filters
from . import scorers as scorers
from .context import PlacementContext
from .dryrun import DEFAULT_CAPACITY_RANK, headroom, plan_preemption, preemption_candidates
from .filters import NODE_STATUS
from .gpus import choose_gpus
from .model import (
    CPU,
    CapacityQuota,
    Claim,
    GpuSlot,
    Group,
    Inventory,
    NodeSnapshot,
    NodeVerdict,
    Placement,
    PlacementConflict,
    PlacementResult,
    PreemptionPlan,
    PreFilterResult,
    ProfileExplain,
    ProfileSpec,
    Rejection,
    ReplicaRequest,
    ShardPlan,
    Usage,
)
from .pipeline import EXPLAIN_NODES, explain, judge, ordered_profiles, place, usable_nodes
from .reasons import Reason, gettext_noop
from .registry import (
    REGISTRY,
    Registry,
    SnapshotField,
    profile_field,
    register_check,
    register_filter,
    register_prefilter,
    register_profile_field,
    register_scorer,
    register_snapshot_field,
    snapshot_field,
)


def builtin_registry() -> Registry:
    """A registry of the built-in filters, scorers, checks and pre-filter only (no app's plugins)."""
    registry = Registry()
    filters.register(registry)
    scorers.register(registry)
    return registry


__all__ = [
    "CPU",
    "DEFAULT_CAPACITY_RANK",
    "EXPLAIN_NODES",
    "FieldError",
    "NODE_STATUS",
    "REGISTRY",
    "CapacityQuota",
    "Claim",
    "GpuSlot",
    "Group",
    "Inventory",
    "NodeSnapshot",
    "NodeVerdict",
    "Placement",
    "PlacementConflict",
    "PlacementContext",
    "PlacementResult",
    "PreFilterResult",
    "PreemptionPlan",
    "ProfileExplain",
    "ProfileField",
    "ProfileSpec",
    "Reason",
    "Registry",
    "Rejection",
    "ReplicaRequest",
    "ShardPlan",
    "SnapshotField",
    "Usage",
    "builtin_registry",
    "choose_gpus",
    "explain",
    "filters",
    "gettext_noop",
    "headroom",
    "judge",
    "ordered_profiles",
    "place",
    "plan_preemption",
    "preemption_candidates",
    "profile_field",
    "register_check",
    "register_filter",
    "register_prefilter",
    "register_profile_field",
    "register_scorer",
    "register_snapshot_field",
    "scorers",
    "snapshot_field",
    "usable_nodes",
]
