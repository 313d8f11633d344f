"""Built-in scorers (preferences among the nodes every filter let through). Registered on import.

Each returns a value in [0, 1]; a node's score is the sum of value x weight over the
registered scorers, and the highest wins (ties: higher built-in score, then node name).

- binpack (weight 1): a single-node replica goes where the least is left free after it, so
  whole nodes stay free for large models that cannot be split; a multi-node replica, the
  least movable thing in the cluster, goes to the emptiest nodes instead. GPU profiles count
  free GPUs of their class (best fit by GPUs left over); CPU profiles the fraction of memory
  and cores claimed after placement.
- weights (weight 2): prefer a node that already holds the model's weights. A preference,
  never a filter: fetching them is a valid answer.
- spare_gpus (weight 4): a CPU profile keeps off GPU nodes while a node without GPUs can
  take it, so the scarce cards are not walled in by CPU models' memory and cores.

The pipeline knows how these three are computed and walks its capacity index in their
order, so placing one replica looks at a handful of nodes rather than every node; any other
scorer is evaluated on the nodes it reaches, bounded by its weight (see pipeline.py).
"""

from __future__ import annotations

from .context import PlacementContext
from .model import NodeSnapshot
from .registry import REGISTRY, Registry


def _best_fit(leftover: int) -> float:
    return 1.0 / (1 + leftover)


def binpack(ctx: PlacementContext, node: NodeSnapshot) -> float:
    inventory = ctx.inventory
    cls = ctx.gpu_class
    if cls is not None:
        leftover = max(inventory.free_count(node.id, cls) - ctx.gpus, 0)
        fit = _best_fit(leftover)
        return 1.0 - fit if ctx.multi_node else fit
    parts = 0
    used = 0.0
    total = node.memory_total_bytes
    if ctx.memory and total:
        used += min((inventory.memory_claimed(node.id) + ctx.memory) / total, 1.0)
        parts += 1
    cpus = node.cpus
    if ctx.cores and cpus:
        used += min((inventory.cores_claimed(node.id) + ctx.cores) / cpus, 1.0)
        parts += 1
    if not parts:
        return 0.0
    used /= parts
    return 1.0 - used if ctx.multi_node else used


def weights(ctx: PlacementContext, node: NodeSnapshot) -> float:
    source = ctx.request.source
    return 1.0 if source and source in node.weights else 0.0


def spare_gpus(ctx: PlacementContext, node: NodeSnapshot) -> float:
    return 1.0 if ctx.gpu_class is None and not node.gpus else 0.0


BINPACK_WEIGHT = 1.0
WEIGHTS_WEIGHT = 2.0
SPARE_GPUS_WEIGHT = 4.0

# The scorers the pipeline's index can order by (see pipeline._Stream).
INDEXED = frozenset({binpack, weights, spare_gpus})


def register(registry: Registry) -> None:
    """Register the built-ins on a registry (done for REGISTRY on import)."""
    registry.register_scorer(binpack, name="binpack", weight=BINPACK_WEIGHT)
    registry.register_scorer(weights, name="weights", weight=WEIGHTS_WEIGHT)
    registry.register_scorer(spare_gpus, name="spare_gpus", weight=SPARE_GPUS_WEIGHT)


register(REGISTRY)
