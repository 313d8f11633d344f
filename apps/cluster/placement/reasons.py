"""Why a node or a profile was refused: a code, an English msgid and the numbers.

Every template below is wrapped in `gettext_noop` with a string literal, so Django's
makemessages extracts it; the Django side translates `template` and applies `params`.
`Reason.message()` is the English text (`template % params`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

# A refusal's type and its helpers are llmgw's (llmgw.reasons: the catalogue's profile fields
# refuse with them too); placement's modules keep importing them from here.
from llmgw.reasons import GIB as GIB
from llmgw.reasons import Reason as Reason
from llmgw.reasons import gb as gb
from llmgw.reasons import gettext_noop as gettext_noop
from llmgw.reasons import number as number


def listing(values: Iterable[str]) -> str:
    # Kept per set: nodes repeat the same few sets of GPU classes and engines over and over.
    return _listing(values if isinstance(values, frozenset) else frozenset(values))


@functools.lru_cache(maxsize=256)
def _listing(values: frozenset[str]) -> str:
    items = sorted(values)
    return ", ".join(items) if items else gettext_noop("none")


# Node-level reasons, one per built-in filter.


def not_ready(node: str, status: str) -> Reason:
    return Reason(
        "not_ready", gettext_noop("node %(node)s is not ready (%(status)s)"), {"node": node, "status": status}
    )


def source_missing(node: str, source: str) -> Reason:
    return Reason(
        "source_missing", gettext_noop("%(source)s is not on node %(node)s"), {"node": node, "source": source}
    )


def weights_refused(node: str, source: str, reason: str) -> Reason:
    return Reason(
        "weights_refused",
        gettext_noop("node %(node)s refused to fetch %(source)s: %(reason)s"),
        {"node": node, "source": source, "reason": reason},
    )


def weights_failed(node: str, source: str, reason: str) -> Reason:
    return Reason(
        "weights_failed",
        gettext_noop("node %(node)s could not fetch %(source)s: %(reason)s"),
        {"node": node, "source": source, "reason": reason},
    )


def weights_fetching(node: str, source: str, file: str) -> Reason:
    return Reason(
        "weights_fetching",
        gettext_noop("%(source)s is not on node %(node)s yet: it is fetching %(file)s"),
        {"node": node, "source": source, "file": file},
    )


def weights_outside(node: str, source: str, dirs: str) -> Reason:
    return Reason(
        "weights_outside",
        gettext_noop(
            "node %(node)s would refuse to fetch %(source)s: it keeps models only in %(dirs)s "
            "(its agent.yaml's model_dirs)"
        ),
        {"node": node, "source": source, "dirs": dirs},
    )


def cordoned(node: str, reason: str) -> Reason:
    return Reason("cordoned", gettext_noop("node %(node)s is cordoned: %(reason)s"), {"node": node, "reason": reason})


def missing_label(node: str, key: str, value: str, actual: str | None) -> Reason:
    return Reason(
        "label",
        gettext_noop("node %(node)s lacks label %(key)s=%(value)s"),
        {"node": node, "key": key, "value": value, "actual": actual},
    )


CODE_GPU_CLASS = "gpu_class"
CODE_FREE_GPUS = "gpus"


def no_gpu_class(node: str, gpu_class: str, classes: Iterable[str]) -> Reason:
    return Reason(
        CODE_GPU_CLASS,
        gettext_noop("node %(node)s has no %(gpu_class)s GPUs (it has %(classes)s)"),
        {"node": node, "gpu_class": gpu_class, "classes": listing(classes)},
    )


def too_few_gpus(node: str, gpu_class: str, free: int, need: int, total: int, unhealthy: int) -> Reason:
    return Reason(
        CODE_FREE_GPUS,
        gettext_noop("node %(node)s has %(free)s free healthy %(gpu_class)s GPUs, needs %(need)s"),
        {"node": node, "gpu_class": gpu_class, "free": free, "need": need, "total": total, "unhealthy": unhealthy},
    )


def gpus_split(node: str, gpu_class: str, free: int, need: int, split: int, slices: Iterable[str]) -> Reason:
    """Cards of the class are cut into slices (MIG, compute partitions): never offered whole."""
    return Reason(
        CODE_FREE_GPUS,
        gettext_noop(
            "node %(node)s has %(free)s free %(gpu_class)s GPUs, needs %(need)s: %(split)s of them are split "
            "into slices, which are placed as their own classes (%(slices)s)"
        ),
        {"node": node, "gpu_class": gpu_class, "free": free, "need": need, "split": split, "slices": listing(slices)},
    )


def gpus_untrusted(node: str, gpu_class: str, free: int, need: int, device: str, fault: str) -> Reason:
    """A device of the class cannot be trusted now (its agent's words)."""
    return Reason(
        CODE_FREE_GPUS,
        gettext_noop(
            "node %(node)s has %(free)s free healthy %(gpu_class)s GPUs, needs %(need)s: %(device)s "
            "cannot be trusted now: %(fault)s"
        ),
        {"node": node, "gpu_class": gpu_class, "free": free, "need": need, "device": device, "fault": fault[:500]},
    )


def gpus_overlap(node: str, gpu_class: str, free: int, usable: int, need: int) -> Reason:
    """Free slices that share memory (or a card) cannot be held by one shard together."""
    return Reason(
        CODE_FREE_GPUS,
        gettext_noop(
            "node %(node)s has %(free)s free %(gpu_class)s slices and %(usable)s of them can be held together "
            "(the others share memory with them), needs %(need)s"
        ),
        {"node": node, "gpu_class": gpu_class, "free": free, "usable": usable, "need": need},
    )


def mig_one_per_process(node: str, gpu_class: str, need: int) -> Reason:
    return Reason(
        "mig_per_process",
        gettext_noop(
            "node %(node)s: %(gpu_class)s are MIG slices and a CUDA process uses one MIG device, so a shard "
            "cannot take %(need)s of them"
        ),
        {"node": node, "gpu_class": gpu_class, "need": need},
    )


def engine_cannot_drive(node: str, engine: str, build: str, gpu_class: str, devices: str) -> Reason:
    """The engine build the node runs cannot drive the profile's GPUs (a CPU or CUDA build and AMD
    cards, a Vulkan build and MIG slices)."""
    return Reason(
        "engine_build",
        gettext_noop(
            "node %(node)s runs the %(build)s build of %(engine)s, which cannot drive %(gpu_class)s (%(devices)s)"
        ),
        {"node": node, "engine": engine, "build": build, "gpu_class": gpu_class, "devices": devices},
    )


def too_little_memory(node: str, free: int, total: int, need: int) -> Reason:
    return Reason(
        "memory",
        gettext_noop("node %(node)s has %(free_gb)s GB of memory free of %(total_gb)s, needs %(need_gb)s"),
        {
            "node": node,
            "free_gb": gb(free),
            "total_gb": gb(total),
            "need_gb": gb(need),
            "free_bytes": free,
            "total_bytes": total,
            "need_bytes": need,
        },
    )


def too_few_cores(node: str, free: float, total: int, need: float) -> Reason:
    return Reason(
        "cpu",
        gettext_noop("node %(node)s has %(free)s of %(total)s CPU cores free, needs %(need)s"),
        {"node": node, "free": number(free), "total": total, "need": number(need)},
    )


def no_engine(node: str, engine: str, engines: Iterable[str]) -> Reason:
    return Reason(
        "engine",
        gettext_noop("node %(node)s does not run the %(engine)s engine"),
        {"node": node, "engine": engine, "engines": listing(engines)},
    )


def engine_not_yet(node: str, engine: str, status: str) -> Reason:
    """The node is installing the engine, or could not: its own words say which."""
    return Reason(
        "engine",
        gettext_noop("node %(node)s does not run the %(engine)s engine yet: %(status)s"),
        {"node": node, "engine": engine, "status": status[:500]},
    )


def no_fabric(node: str, nodes: int) -> Reason:
    return Reason(
        "fabric",
        gettext_noop("node %(node)s is on no fabric, and a replica across %(nodes)s nodes needs one"),
        {"node": node, "nodes": nodes},
    )


# Profile-level reasons (Rejection.node_id is None).


def quota_gpus(owner: str, used: float, limit: int, need: float) -> Reason:
    """GPUs counted in cards: a slice by its share of its card (0.14 for a 1g of 7)."""
    return Reason(
        "quota_gpus",
        gettext_noop("quota of %(owner)s: %(used)s of %(limit)s GPUs in use, needs %(need)s more"),
        {"owner": owner, "used": number(used), "limit": limit, "need": number(need)},
    )


def quota_cores(owner: str, used: float, limit: float, need: float) -> Reason:
    return Reason(
        "quota_cores",
        gettext_noop("quota of %(owner)s: %(used)s of %(limit)s CPU cores in use, needs %(need)s more"),
        {"owner": owner, "used": number(used), "limit": number(limit), "need": number(need)},
    )


def quota_memory(owner: str, used: int, limit: int, need: int) -> Reason:
    return Reason(
        "quota_memory",
        gettext_noop("quota of %(owner)s: %(used_gb)s of %(limit_gb)s GB of memory in use, needs %(need_gb)s more"),
        {
            "owner": owner,
            "used_gb": gb(used),
            "limit_gb": gb(limit),
            "need_gb": gb(need),
            "used_bytes": used,
            "limit_bytes": limit,
            "need_bytes": need,
        },
    )


def quota_replicas(owner: str, used: int, limit: int) -> Reason:
    return Reason(
        "quota_replicas",
        gettext_noop("quota of %(owner)s: %(used)s of %(limit)s replicas in use, needs 1 more"),
        {"owner": owner, "used": used, "limit": limit, "need": 1},
    )


def left_out(node: str, plugin: str) -> Reason:
    return Reason(
        "left_out",
        gettext_noop("node %(node)s is left out by %(plugin)s"),
        {"node": node, "plugin": plugin},
    )


def fabric_count(fabric: str, count: int, need: int) -> Reason:
    return Reason(
        "fabric_count",
        gettext_noop("only %(count)s nodes of fabric %(fabric)s can take a shard, needs %(need)s"),
        {"fabric": fabric, "count": count, "need": need},
    )


def no_fit(profile: str, refused: int, nodes: int) -> Reason:
    return Reason(
        "no_fit",
        gettext_noop("no node can take profile %(profile)s: %(refused)s of %(nodes)s nodes refused it"),
        {"profile": profile, "refused": refused, "nodes": nodes},
    )


def no_fabric_fits(profile: str, need: int, fabrics: int) -> Reason:
    return Reason(
        "no_fabric",
        gettext_noop(
            "no fabric has %(need)s nodes that can take a shard of profile %(profile)s (%(fabrics)s fabrics tried)"
        ),
        {"profile": profile, "need": need, "fabrics": fabrics},
    )
