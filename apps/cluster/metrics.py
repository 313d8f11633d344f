"""Prometheus figures for nodes, read from their latest samples at scrape time.

No scrape target on the nodes: the control plane exports what agents send. A sample
older than a minute is left out rather than repeated, and a figure the agent did not
measure is absent, never 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import orjson
from django.db.models import TextField
from django.db.models.functions import Cast
from django.utils import timezone
from prometheus_client import Counter, Histogram

from agent.messages import GpuFigures, HeartbeatSample, ShardFigures, StoragePoolFigures
from agent.probes.mig import SLICE_BASE, slice_parent
from apps.cluster.samples import read_sample
from llmgw.metrics import Exposition, escape_label, label_text, number_text, per_scrape

__all__ = [
    "MESSAGE_SECONDS",
    "NodeCollector",
    "NodeRow",
    "PROTOCOL_ERRORS",
    "PROTOCOL_MESSAGES",
    "owner_label",
    "scrape_nodes",
]

PROTOCOL_MESSAGES = Counter("llmgw_agent_messages", "Agent messages handled, by type", ["type"])
MESSAGE_SECONDS = Histogram(
    "llmgw_agent_message_seconds",
    "Time the control plane took to handle one agent message, by type",
    ["type"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PROTOCOL_ERRORS = Counter("llmgw_agent_protocol_errors", "Agent messages refused or failed, by reason", ["code"])
JOINS_DEFERRED = Counter(
    "llmgw_agent_joins_deferred",
    "Agent connections told to come back later because the process was taking in as many as it takes at once",
)

FRESH = timedelta(minutes=1)


NUMBERS = (int, float)  # what a sample's figure must be to be exported (not a bool, not a string)
MIB = 1024 * 1024
#: A card's figures: (metric, help, the sample's key, the factor to the metric's unit).
GPU_GAUGES = (
    ("llmgw_gpu_utilization_percent", "GPU busy", "utilization_gpu_pct", 1),
    ("llmgw_gpu_memory_bandwidth_percent", "GPU memory controller busy", "utilization_memory_pct", 1),
    ("llmgw_gpu_memory_used_bytes", "GPU memory in use", "memory_used_mib", MIB),
    ("llmgw_gpu_memory_total_bytes", "GPU memory", "memory_total_mib", MIB),
    (
        "llmgw_gpu_temperature_celsius",
        "GPU temperature (an AMD card's junction, else its edge)",
        "temperature_gpu_c",
        1,
    ),
    ("llmgw_gpu_edge_temperature_celsius", "GPU edge temperature (AMD)", "temperature_edge_c", 1),
    ("llmgw_gpu_junction_temperature_celsius", "GPU junction (hotspot) temperature (AMD)", "temperature_junction_c", 1),
    ("llmgw_gpu_memory_temperature_celsius", "HBM temperature", "temperature_memory_c", 1),
    ("llmgw_gpu_power_draw_watts", "GPU power draw", "power_draw_w", 1),
    ("llmgw_gpu_power_limit_watts", "Enforced GPU power limit", "power_limit_w", 1),
    ("llmgw_gpu_sm_clock_mhz", "SM clock", "sm_clock_mhz", 1),
    (
        "llmgw_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors since the driver loaded",
        "ecc_uncorrected_volatile",
        1,
    ),
    (
        "llmgw_gpu_remapped_rows_uncorrectable",
        "Rows remapped for uncorrectable errors",
        "remapped_rows_uncorrectable",
        1,
    ),
    ("llmgw_gpu_pcie_replays", "PCIe replay counter", "pcie_replay_count", 1),
    ("llmgw_gpu_ecc_corrected_errors", "Corrected ECC errors the card reports (AMD)", "ecc_corrected", 1),
)

#: A slice's figures (a MIG device, an AMD compute partition), in families of their own so that a
#: count of the cards' series counts cards: (metric, help, the sample's key, the factor to the unit).
SLICE_GAUGES = (
    ("llmgw_gpu_slice_utilization_percent", "Slice busy", "utilization_gpu_pct", 1),
    ("llmgw_gpu_slice_memory_used_bytes", "Slice memory in use", "memory_used_mib", MIB),
    ("llmgw_gpu_slice_memory_total_bytes", "Slice memory", "memory_total_mib", MIB),
    (
        "llmgw_gpu_slice_ecc_uncorrected_errors",
        "Uncorrected ECC errors of the slice since the driver loaded",
        "ecc_uncorrected_volatile",
        1,
    ),
)


#: A node's plain figures: (metric, help, the sample's key).
NODE_GAUGES = (
    ("llmgw_node_cpus", "Logical CPUs", "cpus"),
    ("llmgw_node_cpu_utilization_percent", "CPU busy across all cores", "cpu_utilization_pct"),
    ("llmgw_node_memory_bytes", "Memory installed", "memory_total_bytes"),
    ("llmgw_node_memory_used_bytes", "Memory in use", "memory_used_bytes"),
    ("llmgw_node_memory_available_bytes", "Memory available to new work", "memory_available_bytes"),
    ("llmgw_node_cpu_package_temperature_celsius", "Hottest CPU package", "cpu_package_temp_c"),
    ("llmgw_node_inlet_temperature_celsius", "Board inlet temperature", "inlet_temp_c"),
    ("llmgw_node_cpu_package_power_watts", "CPU package power from RAPL", "cpu_package_power_w"),
)


class NodeRow(NamedTuple):
    """A node as a scrape reads it: `sample` is its latest sample if fresh (else None), and
    `nvlink_domain` the NVLink domain it registered in (hardware["nvlink_domain"])."""

    pk: int
    name: str
    up: bool
    cordoned: bool
    sample: HeartbeatSample | None
    nvlink_domain: str | None


def scrape_nodes() -> list[NodeRow]:
    """The fleet's nodes (revoked ones left out) as plain rows, read once for every collector of
    a scrape (llmgw.metrics.per_scrape): a model object per node costs more than its series."""
    return per_scrape("cluster.nodes", _read_nodes)


def _read_nodes() -> list[NodeRow]:
    from django.conf import settings

    from apps.cluster.choices import NodeStatus
    from apps.cluster.models import Node

    now = timezone.now()
    # A node marked ready whose heartbeats stopped is down at once (Node.live_status).
    grace = timedelta(seconds=settings.AGENT_HEARTBEAT_INTERVAL * settings.AGENT_MISSED_HEARTBEATS)
    # The samples are read as text and decoded here, and only the fresh ones: decoding is most of
    # what reading 2,000 nodes costs, and orjson does it in half the time of the json module.
    rows = (
        Node.objects.exclude(status=NodeStatus.REVOKED)
        .annotate(sample_text=Cast("sample", TextField()))
        .values_list(
            "pk", "name", "status", "cordoned", "sample_text", "sampled_at", "last_seen_at", "hardware__nvlink_domain"
        )
    )
    out = []
    # Only the one key of the registered hardware (a large document) is read.
    for pk, name, status, cordoned, text, sampled_at, last_seen, domain in rows:
        up = status == NodeStatus.READY and (last_seen is None or now - last_seen <= grace)
        fresh = _decoded(text) if text and sampled_at is not None and now - sampled_at <= FRESH else None
        out.append(NodeRow(pk, name, up, bool(cordoned), fresh, str(domain) if domain else None))
    return out


def _decoded(text: str) -> HeartbeatSample | None:
    """A stored sample's document, checked (apps.cluster.samples), or None where it is not an
    object (or not JSON at all).

    orjson refuses what the json module reads (an integer past 64 bits, NaN written by an older
    agent to SQLite): such a document is read by the json module instead."""
    try:
        sample = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            sample = json.loads(text)
        except ValueError:
            return None
    return read_sample(sample)


class NodeCollector:
    """The nodes', GPUs', shards', quotas' and replicas' series, written as text (llmgw.metrics.Exposition)."""

    def text(self) -> str:
        out = Exposition()

        def put(name: str, doc: str, labels: dict[str, str] | str, value: float | int | None) -> None:
            if value is None or isinstance(value, bool) or not isinstance(value, int | float):
                return
            out.add(name, doc, labels if isinstance(labels, str) else label_text(labels), value)

        nodes = scrape_nodes()
        lines = NodeLines(out, put)
        for node in nodes:
            lines.node(node)
        engines = EngineFamilies(out)
        held = _shards(out, put, {node.pk: node.sample for node in nodes}, engines, {n.pk: n.name for n in nodes})
        _quotas(put, held)
        _replicas(put)
        return out.text()


class NodeLines:
    """A node's and its cards' plain figures, written straight into their families' lines (labels
    escaped and in prometheus_client's order, by name): 2,000 nodes of 8 cards are some 300,000
    of them, so each family's `append` and the start of its line are looked up once."""

    def __init__(self, out: Exposition, put: Put) -> None:
        from apps.cluster.inventory import slot_share

        self.put = put
        self.share_of = slot_share
        self.up = out.family("llmgw_node_up", "1 when the node's agent is connected and heartbeating").append
        self.cordoned = out.family("llmgw_node_cordoned", "1 when an operator cordoned the node").append
        self.node_gauges = [(out.family(name, doc).append, name, key) for name, doc, key in NODE_GAUGES]
        self.load = out.family("llmgw_node_load", "Load average").append
        self.gpu_gauges = [
            (out.family(name, doc).append, f"{name}{{", key, scale) for name, doc, key, scale in GPU_GAUGES
        ]
        self.clock_events = out.family(
            "llmgw_gpu_clock_event",
            "1 for each reason the card's clocks are held down now (heat, power cap, idle, ...)",
        ).append
        self.slice_gauges = [
            (out.family(name, doc).append, f"{name}{{", key, scale) for name, doc, key, scale in SLICE_GAUGES
        ]
        self.slice_info = out.family(
            "llmgw_gpu_slice_info",
            "1 for each slice of a card (a MIG device, an AMD compute partition): its card, kind and profile",
        ).append
        self.slice_share = out.family(
            "llmgw_gpu_slice_share",
            "The part of its card a slice is (a 1g of 7: 1/7), as GPU quotas and GPU time count it",
        ).append
        self.counted = [
            (out.family(metric, doc).append, metric, key, label)
            for metric, doc, key, label in (
                ("llmgw_gpu_xid_errors", "Kernel XID events seen, by code", "xids", "xid"),
                ("llmgw_gpu_nvlink_errors", "NVLink error counters summed over links", "nvlink_errors", "counter"),
            )
        ]

    def node(self, node: NodeRow) -> None:
        n = f'node="{escape_label(node.name)}"'
        self.up(f"llmgw_node_up{{{n}}} {'1.0' if node.up else '0.0'}\n")
        self.cordoned(f"llmgw_node_cordoned{{{n}}} {'1.0' if node.cordoned else '0.0'}\n")
        sample = node.sample
        if sample is None:
            return
        for append, metric, key in self.node_gauges:
            value = sample.get(key)
            if value.__class__ in NUMBERS:
                append(f"{metric}{{{n}}} {number_text(value)}\n")
        load = sample.get("load")
        for period, value in zip(("1m", "5m", "15m"), load if isinstance(load, list) else (), strict=False):
            if value.__class__ in NUMBERS:
                self.load(f'llmgw_node_load{{{n},period="{period}"}} {number_text(value)}\n')
        for pool in sample.get("storage") or ():
            if isinstance(pool, dict):
                self.storage(node.name, pool)
        for gpu in sample.get("gpus") or ():
            if isinstance(gpu, dict):
                if gpu.get("parent") is None:
                    self.gpu(n, gpu)
                else:
                    self.slice(n, gpu)

    def storage(self, node: str, pool: StoragePoolFigures) -> None:
        labels = label_text(
            {
                "node": node,
                "mountpoint": str(pool.get("mount_point", "")),
                "fstype": str(pool.get("fstype") or ""),
                "kind": "shared" if pool.get("shared") else "local",
            }
        )
        doc = "Free space on a filesystem holding model directories"
        self.put("llmgw_node_storage_free_bytes", doc, labels, pool.get("free_bytes"))
        doc = "Size of a filesystem holding model directories"
        self.put("llmgw_node_storage_total_bytes", doc, labels, pool.get("total_bytes"))

    def gpu(self, n: str, gpu: GpuFigures) -> None:
        get = gpu.get
        index, uuid, gpu_class = get("index"), get("uuid") or "", get("gpu_class") or ""
        # Labels in label_text's order (class, counter, gpu, node, reason, uuid, xid).
        head = f'class="{escape_label(str(gpu_class))}"'
        tail = f'gpu="{escape_label(str(index))}",{n}'
        # A sample of an agent older than AMD support names no vendor: its cards are NVIDIA's.
        who = f'uuid="{escape_label(str(uuid))}",vendor="{escape_label(str(get("vendor") or "nvidia"))}"'
        labels = f"{head},{tail},{who}}} "
        for append, start, key, scale in self.gpu_gauges:
            value = get(key)
            if value.__class__ in NUMBERS:
                # number_text() inline for a finite figure (x - x is 0 for no infinity, no NaN).
                number = float(value * scale)
                append(f"{start}{labels}{repr(number) if number - number == 0 else number_text(number)}\n")
        for reason in gpu.get("throttle_reasons") or ():
            self.clock_events(
                f'llmgw_gpu_clock_event{{{head},{tail},reason="{escape_label(str(reason))}",{who}}} 1.0\n'
            )
        # Counts by code or counter: the extra label takes its place in label_text's order.
        for append, metric, key, label in self.counted:
            counts = get(key)
            for name, count in counts.items() if isinstance(counts, dict) else ():
                if count.__class__ in NUMBERS:
                    extra = f'{label}="{escape_label(str(name))}"'
                    append(f"{metric}{{{','.join(sorted((head, tail, who, extra)))}}} {number_text(count)}\n")

    def slice(self, n: str, gpu: GpuFigures) -> None:
        """A slice: its own families, labelled with its card (`card`, the card's `gpu` index) and
        itself (`slice`, its device index), never as one more card."""
        get = gpu.get
        card, index, gpu_class = get("parent"), get("index"), str(get("gpu_class") or "")
        vendor = escape_label(str(get("vendor") or "nvidia"))
        # Labels in label_text's order (card, class, kind, node, profile, slice, uuid, vendor).
        head = f'card="{escape_label(str(card))}",class="{escape_label(gpu_class)}"'
        tail = f'slice="{escape_label(str(index))}",uuid="{escape_label(str(get("uuid") or ""))}",vendor="{vendor}"'
        labels = f"{head},{n},{tail}}} "
        kind, profile = escape_label(str(get("kind") or "")), escape_label(str(get("profile") or ""))
        self.slice_info(f'llmgw_gpu_slice_info{{{head},kind="{kind}",{n},profile="{profile}",{tail}}} 1.0\n')
        share = get("share")
        parent = card if isinstance(card, int) else None
        share = self.share_of(share if share.__class__ in NUMBERS else None, parent, gpu_class)
        self.slice_share(f"llmgw_gpu_slice_share{{{labels}{number_text(share)}\n")
        for append, start, key, scale in self.slice_gauges:
            value = get(key)
            if value.__class__ in NUMBERS:
                append(f"{start}{labels}{number_text(value * scale)}\n")


Put = Callable[[str, str, dict[str, str] | str, float | int | None], None]


def owner_label(model: Any) -> str:
    """The model's organisation and team by slug ("acme/search", "acme"), or "-" for nobody's."""
    org, team, _project = model.owners()
    parts = [o.slug for o in (org, team) if o is not None]
    return "/".join(parts) or "-"


class EngineFamilies:
    """`llmgw_engine_*`: what each replica's engine says of itself (read by its node's agent from
    the engine's own /metrics, agent.engine_metrics), under one set of names whatever the engine.
    A figure the engine does not publish is absent (llama.cpp has no time to first token)."""

    GAUGES = (
        ("requests_running", "llmgw_engine_requests_running", "Requests the engine is working on"),
        ("requests_waiting", "llmgw_engine_requests_waiting", "Requests waiting inside the engine"),
        ("kv_cache_usage_ratio", "llmgw_engine_kv_cache_usage_ratio", "Share of the engine's KV cache in use (0-1)"),
    )
    COUNTERS = (
        ("prompt_tokens", "llmgw_engine_prompt_tokens", "Prompt tokens the engine took in, cached ones too"),
        ("generation_tokens", "llmgw_engine_generation_tokens", "Tokens the engine generated"),
        ("prefix_cache_queries", "llmgw_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
        ("prefix_cache_hits", "llmgw_engine_prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    )
    SUMMARIES = (
        ("ttft", "llmgw_engine_time_to_first_token_seconds", "Time to first token inside the engine"),
        ("tpot", "llmgw_engine_time_per_output_token_seconds", "Time per output token after the first"),
    )

    def __init__(self, out: Exposition) -> None:
        # Each family's `append` and the start of its lines, looked up once for all the replicas.
        self.gauges = [(out.family(name, doc).append, f"{name}{{", key) for key, name, doc in self.GAUGES]
        self.counters = [
            (out.family(name, doc, kind="counter").append, f"{name}_total{{", key) for key, name, doc in self.COUNTERS
        ]
        self.summaries = [
            (out.family(name, doc, kind="summary").append, name, f"{key}_sum", f"{key}_count")
            for key, name, doc in self.SUMMARIES
        ]

    def add(self, model: str, replica: str, engine: str, figures: dict[str, Any]) -> None:
        labels = f'engine="{escape_label(engine)}",model="{escape_label(model)}",replica="{escape_label(replica)}"}} '
        get = figures.get
        # A figure is a finite number (x - x is 0 for no infinity, no NaN); a bool is not one.
        for append, start, key in self.gauges:
            value = get(key)
            if value.__class__ in NUMBERS and value - value == 0:
                append(f"{start}{labels}{float(value)!r}\n")
        for append, start, key in self.counters:
            value = get(key)
            if value.__class__ in NUMBERS and value - value == 0 and value >= 0:
                append(f"{start}{labels}{float(value)!r}\n")
        for append, name, sum_key, count_key in self.summaries:
            total, count = get(sum_key), get(count_key)
            if (
                total.__class__ in NUMBERS
                and count.__class__ in NUMBERS
                and total - total == 0
                and count - count == 0
                and count >= 0
            ):
                append(f"{name}_count{{{labels}{float(count)!r}\n")
                append(f"{name}_sum{{{labels}{float(total)!r}\n")


def _claiming_shards(
    names: dict[int, str] | None,
) -> tuple[list[tuple[Any, ...]], dict[int, tuple[str, tuple[str, ...], str]], dict[int, str]]:
    """The shards of live models that claim resources, as plain rows ordered by node, replica and
    rank; each of their models once, as (name, owner keys, owner label); and the name of every node
    they are on: ``names`` as given, with the nodes it lacks read."""
    from apps.catalog.models import Model
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    # The shards as plain rows and each model once: a model object per shard, with its owners,
    # cost more than the rest of a 2,000-node scrape. No list of ids as query parameters either:
    # 2,000 of them cost more to send than the rows to read.
    claiming = Shard.objects.filter(replica__state__in=CLAIMING_STATES, replica__model__deleted_at__isnull=True)
    rows = list(
        claiming.order_by("node__name", "replica_id", "rank").values_list(
            "node_id",
            "replica_id",
            "rank",
            "cpu_cores",
            "memory_bytes",
            "gpu_indices",
            "replica__model_id",
            "replica__spec__engine",
        )
    )
    models = Model.objects.filter(pk__in=claiming.values("replica__model_id")).select_related(
        "organization", "team__organization", "project__team__organization"
    )
    owners = {m.pk: (m.name, m.owner_keys(), owner_label(m)) for m in models}
    names = dict(names or {})
    missing = {row[0] for row in rows} - set(names)
    if missing:  # a revoked node's shards, still claiming until they are replaced
        from apps.cluster.models import Node

        names.update(Node.objects.filter(pk__in=missing).values_list("pk", "name"))
    return rows, owners, names


def _shards(
    out: Exposition,
    put: Put,
    samples: dict[int, HeartbeatSample | None],
    engines: EngineFamilies | None = None,
    names: dict[int, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """What each shard of a live model claims, what its engine uses (from a fresh sample), and the
    GPUs it holds. A deleted model's shards are left out, so its series end with it. Returns what
    the shards hold per capacity-quota owner key, as placement counts it against a quota."""
    rows, owners, names = _claiming_shards(names)
    slices = _slices()
    held: dict[str, dict[str, Any]] = {}
    assigned = out.family(
        "llmgw_gpu_assigned",
        "1 for each GPU a replica holds; a slice its share of its card, `gpu` naming the card and `slice` the slice",
    )
    for node_id, replica_id, rank, cpu_cores, memory_bytes, gpu_indices, model_id, engine in rows:
        if model_id not in owners:  # deleted between the two reads
            continue
        model_name, keys, owner = owners[model_id]
        gpus = [i for i in gpu_indices or () if isinstance(i, int) and not isinstance(i, bool)]
        cards = sum(slices.get((node_id, i), _WHOLE)[1] for i in gpus) if slices else len(gpus)
        for key in keys:
            found = held.setdefault(key, {"gpus": 0, "cpu_cores": 0.0, "memory_bytes": 0, "replicas": set()})
            found["gpus"] += cards
            found["cpu_cores"] += cpu_cores or 0
            found["memory_bytes"] += memory_bytes or 0
            found["replicas"].add(replica_id)
        node_name = names.get(node_id) or ""
        labels = label_text({"node": node_name, "model": model_name, "replica": str(replica_id)})
        put(
            "llmgw_shard_cpu_cores",
            "CPU cores the shard claims on its node (0: its profile claims none)",
            labels,
            cpu_cores,
        )
        put(
            "llmgw_shard_memory_bytes",
            "Memory the shard claims on its node (0: its profile claims none)",
            labels,
            memory_bytes,
        )
        sample = samples.get(node_id)
        if sample is not None:
            shard_id = f"r{replica_id}s{rank}"
            none: ShardFigures = {"shard": shard_id}
            entry = next((e for e in sample.get("shards") or [] if e.get("shard") == shard_id), none)
            put("llmgw_shard_cpu_cores_used", "CPU cores the shard's engine uses", labels, entry.get("cpu_cores"))
            put(
                "llmgw_shard_memory_used_bytes",
                "Resident memory of the shard's engine",
                labels,
                entry.get("memory_bytes"),
            )
            figures = entry.get("engine")
            if engines is not None and isinstance(figures, dict):
                engines.add(model_name, str(replica_id), str(engine or ""), figures)
        if gpus:
            # label_text's order (gpu, model, node, owner, replica, slice), written once per shard.
            rest = (
                f'model="{escape_label(model_name)}",node="{escape_label(node_name)}",'
                f'owner="{escape_label(owner)}",replica="{replica_id}"'
            )
            for index in gpus:
                if index < SLICE_BASE:
                    assigned.append(f'llmgw_gpu_assigned{{gpu="{index}",{rest}}} 1.0\n')
                else:
                    card, share = slices.get((node_id, index)) or (slice_parent(index), 1.0)
                    line = f'llmgw_gpu_assigned{{gpu="{card}",{rest},slice="{index}"}} {number_text(share)}\n'
                    assigned.append(line)
    return held


_WHOLE = (None, 1.0)


def _slices() -> dict[tuple[int, int], tuple[int | None, float]]:
    """(node, device index) -> (its card, its share of it) for every slice the nodes registered, as
    placement counts it against a quota (the share its class names where its agent gave none)."""
    from apps.cluster.inventory import slot_share
    from apps.cluster.models import Gpu

    rows = Gpu.objects.filter(parent_index__isnull=False).values_list(
        "node_id", "index", "parent_index", "share", "gpu_class"
    )
    return {
        (node_id, index): (parent, slot_share(share, parent, gpu_class))
        for node_id, index, parent, share, gpu_class in rows
    }


def _quotas(put: Put, held: dict[str, dict[str, Any]]) -> None:
    """Each capacity quota's limits that are set, and what its owner's replicas hold of them."""
    from apps.quotas.models import CapacityQuota

    levels = {"org": "organization", "team": "team", "project": "project"}
    rows = CapacityQuota.objects.select_related("organization", "team__organization", "project__team__organization")
    for row in rows:
        key = row.owner_key
        if row.project is not None:
            project = row.project
            owner = f"{project.team.organization.slug}/{project.team.slug}/{project.slug}"
        elif row.team is not None:
            owner = f"{row.team.organization.slug}/{row.team.slug}"
        else:
            owner = row.organization.slug if row.organization is not None else "-"
        # By slug, as llmgw_gpu_assigned's owner: unique, and the same after a rename.
        labels = {"owner": owner, "level": levels[key.split(":")[0]]}
        found = held.get(key, {})
        for resource in ("gpus", "cpu_cores", "memory_bytes", "replicas"):
            limit = getattr(row, resource)
            if limit is None:
                continue
            used = found.get(resource, 0)
            if resource == "gpus":
                used = round(used, 9)  # seven 1/7 slices are one card
            put("llmgw_capacity_quota_limit", "A capacity quota's limit", {**labels, "resource": resource}, limit)
            put(
                "llmgw_capacity_quota_used",
                "What the owner's replicas hold of a capacity quota, as placement counts it",
                {**labels, "resource": resource},
                len(used) if isinstance(used, set) else used,
            )


def _replicas(put: Put) -> None:
    """Replicas of every live model that runs on the cluster, by state (0 where it has none in one)."""
    from django.db.models import Count

    from apps.catalog.models import Model
    from apps.cluster.choices import ReplicaState
    from apps.cluster.models import Replica

    counts = {
        (name, state): n
        for name, state, n in Replica.objects.filter(model__deleted_at__isnull=True)
        .values_list("model__name", "state")
        .annotate(n=Count("pk"))
        .order_by()
    }
    names = set(Model.objects.live().filter(external_url="").values_list("name", flat=True))
    names |= {name for name, _state in counts}
    for name in sorted(names):
        for state in ReplicaState.values:
            put(
                "llmgw_replicas",
                "Replicas of a model, by state",
                {"model": name, "state": state},
                counts.get((name, state), 0),
            )
    failing = (
        Replica.objects.filter(model__deleted_at__isnull=True)
        .exclude(state=ReplicaState.STOPPING)
        .values_list("pk", "model__name", "failures")
        .order_by("model__name", "pk")
    )
    for pk, name, failures in failing:
        put(
            "llmgw_replica_failures",
            "Times in a row the replica's engines failed",
            {"model": name, "replica": str(pk)},
            failures,
        )
