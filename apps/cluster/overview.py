"""What the cluster page shows: the node table, a map of every GPU, idle held cards, and the
fleet's utilisation by GPU class.

Unknown figures stay unknown: a card without a fresh sample is drawn grey ("gpu-none"), a
replica with a card whose utilisation is unknown is not called idle, a figure of a card's
tooltip that the sample lacks is "-", and a chart with no points says so.

A card's tooltip also names what wears it out, as its agent last sent it: the XIDs the kernel
log holds for it, by code; its uncorrected ECC errors, volatile (since the driver loaded) and
aggregate (over the card's life); and its remapped rows, as nvidia-smi reports them: rows
remapped for uncorrectable errors, whether a remapping is pending, and whether one failed.
"""

from __future__ import annotations

import functools
import html
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from django.core.cache import cache
from django.core.paginator import Page, Paginator
from django.db.models import Count, Prefetch, QuerySet
from django.urls import reverse
from django.utils import formats, timezone, translation
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _

from agent.messages import GpuFigures
from agent.probes.mig import SLICE_BASE, SLICE_STRIDE
from apps.cluster import history, rollup, selectors
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Gpu, Node, Replica, Shard
from apps.cluster.samples import read_sample
from llmgw.console.charts import line_chart
from llmgw.ids import MAX_ID, whole_number

log = logging.getLogger(__name__)

__all__ = [
    "COLOURS",
    "IDLE_BELOW_PCT",
    "FleetChart",
    "GpuSquare",
    "HeldIdle",
    "NodeGpus",
    "Overview",
    "bucket",
    "cluster_overview",
    "node_prefix",
    "short_name",
]

# The measures the map can be coloured by: ?colour=util|mem|temp.
COLOURS = ("util", "mem", "temp")
IDLE_BELOW_PCT = rollup.IDLE_BELOW_PCT
IDLE_ROWS = 50  # held idle replicas listed, the costliest first; the rest are counted
# The worker works the held idle replicas out this often for the page (apps.cluster.tasks);
# a summary older than the stale limit is not used, and the page works them out itself.
IDLE_SUMMARY_SECONDS = 15.0
IDLE_SUMMARY_STALE_SECONDS = 45.0
IDLE_SUMMARY_KEY = "cluster:idle-summary"
BUCKETS = 10
# Temperatures are spread over 30-90 °C: 6 °C a step, from cool (gpu-0) to hot (gpu-9).
TEMP_LOW_C = 30.0
TEMP_HIGH_C = 90.0
CHART_BUCKET_SECONDS = rollup.CHART_BUCKET_SECONDS  # points of different nodes in one slot are averaged together
SEPARATORS = "-._:"


def node_prefix(names: list[str]) -> str:
    """The start every node name shares, cut back to a separator ("gpu-r1-01", "gpu-r1-02" → "gpu-r1-").

    As the models page does it (apps.cluster.model_views.node_prefix).
    """
    if len(set(names)) < 2:
        return ""
    common = os.path.commonprefix(names)
    return common[: max(common.rfind(sep) for sep in SEPARATORS) + 1]


def fleet_prefix() -> str:
    """node_prefix of every node's name, from the first and the last of them in code point order
    (what every name shares, the first and the last share): one small query, whatever the fleet.

    On PostgreSQL the two are read in byte order (`~<~`, UTF-8's code point order) from the index
    Django keeps on the name for LIKE (varchar_pattern_ops): two index lookups. MIN and MAX under
    COLLATE "C" would read every row of a table that heartbeats keep rewriting, and the database's
    own collation may not keep the names that share a start together."""
    from django.db import connection

    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(Node._meta.db_table)
        column = connection.ops.quote_name(Node._meta.get_field("name").column or "name")
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT (SELECT {column} FROM {table} ORDER BY {column} USING ~<~ LIMIT 1), "
                f"(SELECT {column} FROM {table} ORDER BY {column} USING ~>~ LIMIT 1)"
            )
            first, last = cursor.fetchone() or (None, None)
    else:  # SQLite compares text by its bytes unless told otherwise: the name's index answers both
        from django.db.models import Max, Min

        found = Node.objects.aggregate(first=Min("name"), last=Max("name"))
        first, last = found["first"], found["last"]
    if first is None or last is None:
        return ""
    return node_prefix([first, last])


def node_href(name: str) -> str:
    return reverse("cluster:node", args=[name])


def short_name(name: str, prefix: str) -> str:
    return name[len(prefix) :] if prefix and name.startswith(prefix) and len(name) > len(prefix) else name


def bucket(value: float | None, colour: str) -> int | None:
    """The colour step 0-9 of a figure: 10 % steps of utilisation or memory, 6 °C steps from 30 °C."""
    if value is None or not math.isfinite(value):
        return None
    if colour == "temp":
        share = (value - TEMP_LOW_C) / (TEMP_HIGH_C - TEMP_LOW_C) * 100
    else:
        share = value
    return min(BUCKETS - 1, max(0, int(share // (100 / BUCKETS))))


@functools.lru_cache(maxsize=8)
def _decimal_separator(language: str | None) -> str:
    return str(formats.get_format("DECIMAL_SEPARATOR", language))


def _number(value: float | None, digits: int = 0) -> str:
    """As formats.number_format(round(value, digits), digits) without grouping (llmgw does not
    group thousands), at a fraction of its cost: the map writes a few thousand of these."""
    if value is None:
        return "-"
    text = f"{round(value, digits):.{digits}f}"
    return text.replace(".", _decimal_separator(translation.get_language())) if digits else text


class _Texts:
    """The tooltips' translated phrases and the language's decimal separator, looked up once per
    language rather than once per card."""

    def __init__(self) -> None:
        self.decimal = _decimal_separator(translation.get_language())
        self.memory = _("%(used)s of %(total)s GiB")
        self.card = _("%(node)s GPU %(index)s, %(gpu_class)s")
        self.slice = _("%(node)s %(device)s, %(gpu_class)s")
        self.untrusted = _("cannot be trusted now: %(why)s")
        self.split = _("split into slices: they are given out, not the whole card")
        self.busy = _("%(value)s%% busy")
        self.memory_line = _("memory %(memory)s")
        self.celsius = _("%(value)s °C")
        self.held_by = _("held by %(replica)s")
        self.not_held = _("not held")
        self.none = _("none")
        self.xids = _("XIDs: %(xids)s")
        self.ecc = _("uncorrected ECC errors: volatile %(volatile)s, aggregate %(aggregate)s")
        self.remapped = _("remapped rows: uncorrectable %(uncorrectable)s, pending %(pending)s, failed %(failed)s")
        self.yes = _("yes")
        self.no = _("no")

    def number(self, value: float | None, digits: int = 0) -> str:
        """_number in this language."""
        if value is None:
            return "-"
        text = f"{round(value, digits):.{digits}f}"
        return text.replace(".", self.decimal) if digits else text

    def yes_no(self, value: bool | None) -> str:
        return "-" if value is None else (self.yes if value else self.no)


@functools.lru_cache(maxsize=8)
def _texts_of(language: str | None) -> _Texts:
    return _Texts()


def _texts() -> _Texts:
    return _texts_of(translation.get_language())


def _count(value: Any) -> int | None:
    """A counter as the sample carries it, or None for anything that is not a whole number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)


@dataclass(frozen=True)
class GpuSquare:
    """One card of the map."""

    node: str
    index: int
    gpu_class: str
    utilization: float | None
    memory_pct: float | None
    memory_used_mib: int | None
    memory_total_mib: int | None
    temperature: float | None
    held_by: str  # "model #replica", or "" when no replica holds it
    colour: str
    # What wears the card out, None where the sample does not say: (code, count) of each XID,
    # uncorrected ECC errors, and remapped rows.
    xids: tuple[tuple[str, int], ...] | None = None
    ecc_volatile: int | None = None
    ecc_aggregate: int | None = None
    remapped_uncorrectable: int | None = None
    remapped_pending: bool | None = None
    remapped_failure: bool | None = None
    vendor: str = "nvidia"
    # A slice of a card (a MIG device, a compute partition): its name ("GPU 0 MIG 2 (1g.10gb)").
    slice: str = ""
    split: bool = False  # a card cut into slices: never given out whole
    fault: str = ""  # why its agent says it cannot be trusted now

    @property
    def short(self) -> str:
        """What the square says: its index, a slice's number on its card after a dot ("0.2")."""
        if not self.slice or self.index < SLICE_BASE:
            return str(self.index)
        card, number = divmod(self.index - SLICE_BASE, SLICE_STRIDE)
        return f"{card}.{number}"

    @property
    def value(self) -> float | None:
        return {"util": self.utilization, "mem": self.memory_pct, "temp": self.temperature}[self.colour]

    @property
    def bucket(self) -> int | None:
        return bucket(self.value, self.colour)

    @property
    def css_class(self) -> str:
        step = self.bucket
        return "gpu-none" if step is None else f"gpu-{step}"

    @property
    def title(self) -> str:
        return self.tooltip(_texts())

    def tooltip(self, texts: _Texts) -> str:
        """The title in the language of `texts`: the map asks for some eight hundred at a time."""
        number = texts.number
        memory = "-"
        if self.memory_used_mib is not None and self.memory_total_mib:
            memory = texts.memory % {
                "used": number(self.memory_used_mib / 1024, 1),
                "total": number(self.memory_total_mib / 1024, 1),
            }
        head = (
            texts.slice % {"node": self.node, "device": self.slice, "gpu_class": self.gpu_class}
            if self.slice
            else texts.card % {"node": self.node, "index": self.index, "gpu_class": self.gpu_class}
        )
        parts = [
            f"{head} ({'AMD' if self.vendor == 'amd' else 'NVIDIA'})",
            texts.busy % {"value": number(self.utilization)},
            texts.memory_line % {"memory": memory},
            texts.celsius % {"value": number(self.temperature)},
            texts.held_by % {"replica": self.held_by} if self.held_by else texts.not_held,
        ]
        state = [texts.untrusted % {"why": self.fault}] if self.fault else [texts.split] if self.split else []
        return "\n".join([" · ".join(parts), *state, *self._wear(texts)])

    def label(self, texts: _Texts) -> str:
        """For a slice, a split card or one that cannot be trusted, the square's role and label
        attributes: its state in words, which its stripes, size or hatching show (empty otherwise)."""
        if self.fault:
            state = texts.untrusted % {"why": self.fault}
        elif self.split:
            state = texts.split
        elif self.slice:
            state = self.slice
        else:
            return ""
        return f' role="img" aria-label="{html.escape(f"{self.short}: {state}")}"'

    @property
    def wear(self) -> list[str]:
        """The tooltip's lines on XIDs, ECC errors and remapped rows."""
        return self._wear(_texts())

    def _wear(self, texts: _Texts) -> list[str]:
        number = texts.number
        if self.xids is None:
            xids = "-"
        elif self.xids:
            xids = ", ".join(f"{code}×{number(count)}" for code, count in self.xids)
        else:
            xids = texts.none
        return [
            texts.xids % {"xids": xids},
            texts.ecc % {"volatile": number(self.ecc_volatile), "aggregate": number(self.ecc_aggregate)},
            texts.remapped
            % {
                "uncorrectable": number(self.remapped_uncorrectable),
                "pending": texts.yes_no(self.remapped_pending),
                "failed": texts.yes_no(self.remapped_failure),
            },
        ]


@dataclass(frozen=True)
class NodeGpus:
    """A node's cards on the map."""

    name: str
    short: str
    squares: list[GpuSquare]
    href: str = ""  # the node's page

    @property
    def cells(self) -> SafeString:
        """The node's squares as HTML, written here rather than by a template loop: a page of the map
        is some eight hundred of them, and the template's lookups cost more than the figures."""
        texts = _texts()
        out = []
        for card in self.squares:
            step = card.bucket
            held = " gpu-held" if card.held_by else ""
            kind = " gpu-slice" if card.slice else " gpu-split" if card.split else ""
            kind += " gpu-untrusted" if card.fault else ""
            out.append(
                f'<span class="gpu-cell {card.css_class}{held}{kind}" '
                f'title="{html.escape(card.tooltip(texts))}" data-gpu="{card.index}" '
                f'data-vendor="{html.escape(card.vendor)}" data-bucket="{"" if step is None else step}"'
                f"{card.label(texts)}>{card.short}</span>"
            )
        return mark_safe("".join(out))  # noqa: S308 - every value above is a number, a fixed class or escaped


@dataclass(frozen=True)
class HeldIdle:
    """A replica whose every card is under IDLE_BELOW_PCT busy now; how long they have been, as far
    as its nodes' last hour of samples shows, and what that cost in GPU-hours held."""

    model: str
    replica_id: int
    cards: list[tuple[str, str, list[int]]]  # (short node name, full node name, indices)
    utilization: float  # the busiest of its cards
    owner: str = "-"
    idle_seconds: float | None = None  # None: nothing tells
    at_least: bool = False  # resting already when its nodes were first seen: longer than said

    @property
    def card_count(self) -> int:
        return sum(len(indices) for _short, _full, indices in self.cards)

    @property
    def idle_minutes(self) -> str:
        if self.idle_seconds is None:
            return "-"
        return _number(self.idle_seconds / 60)

    @property
    def gpu_hours(self) -> float | None:
        """Card-hours held idle: its cards times how long they have rested."""
        return None if self.idle_seconds is None else self.card_count * self.idle_seconds / 3600

    @property
    def cards_text(self) -> str:
        return "; ".join(f"{full}: {', '.join(str(i) for i in indices)}" for _short, full, indices in self.cards)


@dataclass(frozen=True)
class FleetChart:
    title: str
    gpu_class: str
    cards: int
    svg: Any


@dataclass(frozen=True)
class Overview:
    rows: list[selectors.NodeRow]
    prefix: str
    columns: set[str]
    colour: str
    nodes: list[NodeGpus]
    idle: list[HeldIdle]  # the costliest IDLE_ROWS held idle replicas
    charts: list[FleetChart]
    legend: list[tuple[str, str]] = field(default_factory=list)
    page: Page[Node] | None = None  # the nodes the table and the map show, of all of them
    gpus_elsewhere: int = 0  # the registered cards of the nodes on other pages
    # The held idle replicas past the first IDLE_ROWS: how many, and the GPU-hours held idle of
    # those whose rest is timed (None when none is).
    idle_more: tuple[int, float | None] | None = None

    hrefs: dict[str, str] = field(default_factory=dict)  # each shown node's page, by name

    @property
    def named_rows(self) -> list[tuple[selectors.NodeRow, str, str]]:
        """Each node's row with its name less the prefix every node shares, and its page."""
        return [
            (row, short_name(row.node.name, self.prefix), self.hrefs.get(row.node.name) or node_href(row.node.name))
            for row in self.rows
        ]

    @property
    def idle_shown(self) -> list[HeldIdle]:
        """The costliest IDLE_ROWS of the held idle replicas: the table a person reads."""
        return self.idle[:IDLE_ROWS]

    @property
    def idle_rest(self) -> tuple[int, str | None] | None:
        """How many held idle replicas the table leaves out, and the GPU-hours held idle of those
        whose rest is timed (None when none is)."""
        if not self.idle_more:
            return None
        count, hours = self.idle_more
        return count, None if hours is None else formats.number_format(hours, 2)

    @property
    def idle_below(self) -> str:
        return _number(IDLE_BELOW_PCT)

    @property
    def gpu_count(self) -> int:
        """Every card of the fleet (slices of a card not counted again): those on the map, and those
        of the nodes on other pages."""
        return sum(1 for n in self.nodes for s in n.squares if not s.slice) + self.gpus_elsewhere


def _columns(rows: list[selectors.NodeRow]) -> set[str]:
    """The optional columns some row has a figure for; the others are left out of the table."""
    shown: set[str] = set()
    for row in rows:
        if row.cpu_pct is not None or row.cpus:
            shown.add("cpu")
        if row.memory_used is not None:
            shown.add("memory")
        if row.gpu_groups:
            shown.add("gpus")
        if row.disk.local_free is not None or row.disk.shared_free is not None:
            shown.add("disk")
        if row.node.agent_version:
            shown.add("agent")
        if row.engines is not None or row.engine_status:
            shown.add("engines")
        if row.warnings:
            shown.add("warnings")
        if row.node.labels:
            shown.add("labels")
    return shown


def _page_holders(nodes: list[Node]) -> dict[tuple[int, int], str]:
    """(node id, card index) -> "model #replica" for the cards of these nodes that a replica holds."""
    held: dict[tuple[int, int], str] = {}
    shards = (
        Shard.objects.filter(node_id__in=[node.pk for node in nodes])
        .exclude(replica__state__in=[ReplicaState.PENDING, ReplicaState.FAILED])
        .values_list("node_id", "gpu_indices", "replica_id", "replica__model__name")
    )
    for node_id, indices, replica_id, model in shards:
        for index in indices or []:
            if isinstance(index, int) and not isinstance(index, bool):
                held[(node_id, index)] = f"{model} #{replica_id}"
    return held


def _live_gpus(node: Node, now: datetime) -> dict[int, GpuFigures]:
    sample = node.fresh_sample(now) or {}
    live: dict[int, GpuFigures] = {}
    for gpu in sample.get("gpus") or []:
        index = gpu.get("index") if isinstance(gpu, dict) else None
        if isinstance(index, int) and not isinstance(index, bool):
            live[index] = gpu
    return live


def _xids(value: Any) -> tuple[tuple[str, int], ...] | None:
    """{code: count} as the agent sends it, by code; None when the sample has none."""
    if not isinstance(value, dict):
        return None
    counts = [(str(code), number) for code, count in value.items() if (number := _count(count)) is not None]
    # 8 before 13 before 79; a code that is not a number (none is sent now) after them.
    numbers = {code: whole_number(code, 0, MAX_ID) for code, _n in counts}
    return tuple(sorted(counts, key=lambda item: (numbers[item[0]] is None, numbers[item[0]] or 0, item[0])))


def _squares(node: Node, live: dict[int, GpuFigures], held: dict[tuple[int, int], str], colour: str) -> list[GpuSquare]:
    rows = {g.index: g for g in node.gpus.all()}
    squares = []
    for index in sorted(set(rows) | set(live), key=lambda i: (selectors.card_of(i), i)):  # a slice after its card
        card = selectors.GpuCard(
            index=index, label="", row=rows.get(index), live=live.get(index) or GpuFigures(index=index)
        )
        row = rows.get(index)
        gpu_class = (
            card.live.get("gpu_class") or card.live.get("name") or (row.gpu_class or row.name if row else "") or "?"
        )
        squares.append(
            GpuSquare(
                node=node.name,
                index=index,
                gpu_class=str(gpu_class),
                utilization=card.utilization,
                memory_pct=card.memory_pct,
                memory_used_mib=card.memory_used_mib,
                memory_total_mib=card.memory_total_mib,
                temperature=card.temperature,
                held_by=held.get((node.pk, index), ""),
                colour=colour,
                xids=_xids(card.live.get("xids")),
                ecc_volatile=_count(card.live.get("ecc_uncorrected_volatile")),
                ecc_aggregate=_count(card.live.get("ecc_uncorrected_aggregate")),
                remapped_uncorrectable=_count(card.live.get("remapped_rows_uncorrectable")),
                remapped_pending=card.remapped_pending,
                remapped_failure=card.remapped_failure,
                vendor=card.vendor,
                slice=card.name if card.parent is not None else "",
                split=card.split,
                fault=card.fault,
            )
        )
    return squares


def owner_name(model: Any) -> str:
    """The model's owner by name, widest first ("Acme / Search"), or "-" for nobody's."""
    names = [o.name for o in model.owners() if o is not None]
    return " / ".join(names) or "-"


def _idle_since(points: list[dict[str, Any]], indices: list[int]) -> tuple[float | None, bool]:
    """When the cards began to rest without a break, from a node's history (oldest first): the time
    of the earliest sample of the run that ends now in which every card was known and under
    IDLE_BELOW_PCT. (None, False) without history; True when the run is all the history holds."""
    since: float | None = None
    timed = [p for p in points if isinstance(p.get("t"), int | float)]
    for point in sorted(timed, key=lambda p: p["t"], reverse=True):
        t = point.get("t")
        cards = point.get("gpus") or {}
        values = [(cards.get(str(i)) or [None])[0] for i in indices]
        if not isinstance(t, int | float) or any(
            not isinstance(v, int | float) or isinstance(v, bool) or v >= IDLE_BELOW_PCT for v in values
        ):
            return since, False
        since = float(t)
    return since, since is not None


@dataclass
class _Resting:
    """A ready replica whose every card rests now, before its owner and node names are read."""

    replica_id: int
    shards: list[tuple[int, list[int]]]  # (node id, card indices), by rank
    since: float | None = None
    at_least: bool = False

    @property
    def cards(self) -> int:
        return sum(len(indices) for _node, indices in self.shards)

    def gpu_hours(self, now: float) -> float | None:
        return None if self.since is None else self.cards * max(0.0, now - self.since) / 3600


def _unrolled(node_ids: set[int], now: datetime) -> dict[int, rollup.Resting]:
    """The resting cards of nodes the rollup has nothing fresh for, from their rows' fresh samples,
    with no start (how long they rested is unknown). Nodes whose figures could not be folded
    in, which is rare: one query for them."""
    found: dict[int, rollup.Resting] = {}
    if not node_ids:
        return found
    rows = Node.objects.filter(pk__in=node_ids).values_list("pk", "sample", "sampled_at")
    for pk, sample, sampled_at in rows:
        fresh = Node(sample=sample, sampled_at=sampled_at).fresh_sample(now) or {}
        mask = 0
        for gpu in fresh.get("gpus") or []:
            index = gpu.get("index") if isinstance(gpu, dict) else None
            if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < 1024:
                util = selectors.GpuCard(index=index, label="", row=None, live=gpu).utilization
                if util is not None and util < IDLE_BELOW_PCT:
                    mask |= 1 << index
        found[pk] = rollup.Resting(seen=now.timestamp(), t=now.timestamp(), runs=[(math.nan, False, mask)])
    return found


def _resting(now: datetime) -> list[_Resting]:
    """Every ready replica whose every card rests now, from the rollup: one query and one read."""
    by_replica: dict[int, tuple[list[tuple[int, list[int], int]], datetime | None]] = {}
    rows = Shard.objects.filter(replica__state=ReplicaState.READY).values_list(
        "replica_id", "node_id", "rank", "gpu_indices", "replica__placed_at"
    )
    for replica_id, node_id, rank, indices, placed_at in rows:
        cards = [i for i in indices or [] if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 1024]
        if cards:
            by_replica.setdefault(replica_id, ([], placed_at))[0].append((rank, cards, node_id))
    states = _states({node_id for shards, _placed in by_replica.values() for _rank, _cards, node_id in shards}, now)
    resting = []
    for replica_id, (shards, placed_at) in by_replica.items():
        ordered = [(node_id, cards) for _rank, cards, node_id in sorted(shards)]
        rest = _rest_of(ordered, states)
        if rest is None:
            continue
        held = _Resting(replica_id, ordered)
        since, at_least = rest
        if not math.isnan(since):
            held.since, held.at_least = since, at_least
            if placed_at is not None and placed_at.timestamp() > since:
                held.since, held.at_least = placed_at.timestamp(), False
        resting.append(held)
    return resting


def _states(node_ids: set[int], now: datetime) -> dict[int, rollup.Resting]:
    """What the rollup knows of these nodes now, and their rows' samples where it knows nothing."""
    states = rollup.resting(node_ids, history.client(), now.timestamp())
    states.update(_unrolled(node_ids - set(states), now))
    return states


def _rest_of(shards: list[tuple[int, list[int]]], states: dict[int, rollup.Resting]) -> tuple[float, bool] | None:
    """Since when every card of these shards has rested (NaN: unknown) and whether that is "at
    least"; None when one of them is busy, or its figure unknown."""
    since, at_least = -math.inf, False
    for node_id, cards in shards:
        state = states.get(node_id)
        span = state.span(rollup.mask_of(cards)) if state is not None else None
        if span is None:
            return None
        if span[0] > since or math.isnan(span[0]):
            since, at_least = span
        elif span[0] == since:
            at_least = at_least or span[1]
    return since, at_least


@dataclass
class IdleSummary:
    """The fleet's held idle replicas at a moment: the costliest IDLE_ROWS whole, the rest counted.
    The rest's GPU-hours grow with time: at `now` they are (card_seconds + timed_cards x (now - at)) / 3600.

    With them, the fleet's registered cards by GPU class (the charts' titles and the count of every
    card) and its number of nodes (the pager's total): counts over every card and every node row,
    which a fleet of 10,000 nodes pays for every 15 s in the worker rather than on each look at the
    page. None in a summary kept before they were."""

    at: float
    shown: list[_Resting]
    more: int = 0
    timed_cards: int = 0  # the cards of the rest whose rest is timed
    card_seconds: float | None = None  # their cards times how long they had rested at `at`; None: none timed
    cards: dict[str, int] | None = None  # registered cards by GPU class at `at`
    nodes: int | None = None  # nodes at `at`

    def more_hours(self, now: float) -> float | None:
        if self.card_seconds is None:
            return None
        return (self.card_seconds + self.timed_cards * max(0.0, now - self.at)) / 3600


def summarise_idle(now: datetime | None = None, *, keep: bool = False) -> IdleSummary:
    """Work out the fleet's held idle replicas from the rollup (every ready replica's shards: one
    query and one read of the rollup, growing with the fleet), and count its cards by class and its
    nodes (two queries more). With `keep`, store it for the page (the worker does so every
    IDLE_SUMMARY_SECONDS), so that a look at the page reads IDLE_ROWS replicas and the nodes it
    shows rather than the fleet."""
    now = now or timezone.now()
    moment = now.timestamp()
    resting = sorted(_resting(now), key=lambda r: (-(r.gpu_hours(moment) or 0.0), r.replica_id))
    rest = resting[IDLE_ROWS:]
    timed = [r for r in rest if r.since is not None]
    summary = IdleSummary(
        at=moment,
        shown=resting[:IDLE_ROWS],
        more=len(rest),
        timed_cards=sum(r.cards for r in timed),
        card_seconds=sum(r.cards * max(0.0, moment - (r.since or moment)) for r in timed) if timed else None,
        cards=_class_counts(),
        nodes=Node.objects.count(),
    )
    if keep:
        cache.set(IDLE_SUMMARY_KEY, summary, timeout=IDLE_SUMMARY_STALE_SECONDS)
    return summary


def _idle_summary(now: datetime) -> IdleSummary:
    """The summary the worker kept, when it is fresh, with the replicas it lists that no longer rest
    left out; else worked out now (no worker, or a stopped one)."""
    try:
        kept = cache.get(IDLE_SUMMARY_KEY)
    except Exception:  # one written by another version of llmgw, or a cache away: work it out
        log.warning("could not read the held idle summary; working it out", exc_info=True)
        kept = None
    if not isinstance(kept, IdleSummary) or not 0 <= now.timestamp() - kept.at <= IDLE_SUMMARY_STALE_SECONDS:
        return summarise_idle(now)
    states = _states({n for r in kept.shown for n, _c in r.shards}, now)
    return replace(kept, shown=[r for r in kept.shown if _rest_of(r.shards, states) is not None])


def _idle(prefix: str, now: datetime, summary: IdleSummary) -> tuple[list[HeldIdle], tuple[int, float | None] | None]:
    """Held idle replicas of the summary, the costliest first. Only the first IDLE_ROWS are read in
    full (their models and owners, nodes' names and samples, and the history of those whose run
    began before their nodes were first seen); the rest are counted, with the GPU-hours they hold
    idle. A listed replica whose cards are busy again by their nodes' fresh samples is left out."""
    moment = now.timestamp()
    shown = [replace(r) for r in summary.shown]  # their starts may be read further from the history below
    replicas = Replica.objects.select_related(
        "model__organization", "model__team__organization", "model__project__team__organization"
    ).in_bulk([r.replica_id for r in shown])
    nodes = {
        pk: (name, sample)
        for pk, name, sample in Node.objects.filter(pk__in={n for r in shown for n, _c in r.shards}).values_list(
            "pk", "name", "sample"
        )
    }
    # Only a node whose history reaches back before the run can tell more of it: read the oldest
    # point of each first, the whole hour of those alone.
    oldest = history.oldest_points({n for r in shown if r.at_least for n, _c in r.shards})
    idle = []
    for held in shown:
        if held.at_least and any((oldest.get(n) or math.inf) < (held.since or -math.inf) for n, _c in held.shards):
            # The history may know when the run began: the last hour of each of its nodes. A run
            # that covers all of it may have begun before, and stays "at least".
            starts, whole = [], True
            for node_id, cards in held.shards:
                since, all_of_it = _idle_since(history.sample_history(node_id), cards)
                starts.append(since)
                whole = whole and all_of_it
            if held.since is not None and starts and all(s is not None for s in starts):
                held.since = min(held.since, max(s for s in starts if s is not None))
                held.at_least = whole
        replica = replicas.get(held.replica_id)
        figures: list[float | None] = []
        for node_id, cards in held.shards:
            sample = read_sample(nodes.get(node_id, ("", None))[1]) or {}
            by_index: dict[Any, Any] = {g.get("index"): g for g in sample.get("gpus") or [] if isinstance(g, dict)}
            figures.extend(
                selectors.GpuCard(index=i, label="", row=None, live=by_index.get(i) or GpuFigures(index=i)).utilization
                for i in cards
            )
        known = [f for f in figures if f is not None]
        idle.append(
            HeldIdle(
                model=replica.model.name if replica is not None else "-",
                replica_id=held.replica_id,
                cards=[
                    (short_name(nodes.get(n, ("?",))[0], prefix), nodes.get(n, ("?",))[0], c) for n, c in held.shards
                ],
                utilization=max(known) if known else 0.0,
                owner=owner_name(replica.model) if replica is not None else "-",
                idle_seconds=None if held.since is None else max(0.0, moment - held.since),
                at_least=held.at_least,
            )
        )
    idle.sort(key=lambda h: (-(h.gpu_hours or 0.0), h.model, h.replica_id))
    if not summary.more:
        return idle, None
    # The rest are counted: how many, and the GPU-hours of those whose rest is timed.
    return idle, (summary.more, summary.more_hours(moment))


def _class_counts() -> dict[str, int]:
    """How many registered cards of each GPU class the fleet has: one grouped count (unordered: the
    model's ordering by node name would join every card to its node)."""
    counts: dict[str, int] = defaultdict(int)
    cards = Gpu.objects.order_by().filter(parent_index__isnull=True)  # a slice is not a card of its own
    for class_name, name, count in cards.values_list("gpu_class", "name").annotate(count=Count("id")):
        counts[class_name or name or "?"] += count
    return counts


def _fleet_charts(counts: dict[str, int]) -> list[FleetChart]:
    """Average utilisation of each GPU class over the last hour, from the rollup's slots."""
    series = rollup.class_series(history.client())
    charts = []
    for name in sorted(counts):
        title = _("%(gpu_class)s utilisation, average of %(count)s cards") % {"gpu_class": name, "count": counts[name]}
        svg = line_chart(series.get(name, []), label=title, y_max=100, unit="%", gap_seconds=CHART_BUCKET_SECONDS * 3)
        charts.append(FleetChart(title=title, gpu_class=name, cards=counts[name], svg=svg))
    return charts


def _legend(colour: str) -> list[tuple[str, str]]:
    steps = []
    for step in range(BUCKETS):
        if colour == "temp":
            width = (TEMP_HIGH_C - TEMP_LOW_C) / BUCKETS
            low, high = TEMP_LOW_C + step * width, TEMP_LOW_C + (step + 1) * width
            text = _("%(low)s-%(high)s °C") % {"low": _number(low), "high": _number(high)}
            if step == 0:
                text = _("under %(high)s °C") % {"high": _number(high)}
            elif step == BUCKETS - 1:
                text = _("%(low)s °C and over") % {"low": _number(low)}
        else:
            text = _("%(low)s-%(high)s%%") % {"low": step * 10, "high": (step + 1) * 10}
        steps.append((f"gpu-{step}", text))
    steps.append(("gpu-none", _("unknown")))
    return steps


def _node_page(nodes: QuerySet[Node], number: Any, counted: int | None) -> Page[Node]:
    """Page `number` of `nodes` (the first for anything that is not a page number), NODES_PER_PAGE
    of them, with the worker's count of the fleet (`counted`, None when there is none) rather than
    one of the nodes table, which heartbeats keep rewriting: counting it reads every version of
    every row. The page is read one node further, so that whether another follows is known here
    and the last page's total is exact whatever the count says; a page past the end (fewer nodes
    than counted) and a missing count are counted at once."""
    per_page = selectors.NODES_PER_PAGE
    paginator = Paginator(nodes, per_page)
    wanted = 1 if number is None else whole_number(number, 1, MAX_ID // per_page)
    if counted is None or wanted is None:  # Paginator's answer to anything else: page 1, or the last
        return paginator.get_page(number)
    bottom = (wanted - 1) * per_page
    found = list(nodes[bottom : bottom + per_page + 1])
    if not found and bottom:
        return paginator.get_page(number)
    # A node past this page: at least one more page, however many the count (up to
    # IDLE_SUMMARY_STALE_SECONDS old) says; none: this is the last page, and its total is exact.
    paginator.count = max(counted, bottom + per_page + 1) if len(found) > per_page else bottom + len(found)
    return Page(found[:per_page], wanted, paginator)


def cluster_overview(
    colour: str = "util", now: datetime | None = None, *, charts: bool = True, page: Any = None
) -> Overview:
    """Everything the cluster page shows, in a handful of queries: the table and the map for one
    page of nodes (`page`, NODES_PER_PAGE of them by name), the rest for the whole fleet."""
    now = now or timezone.now()
    colour = colour if colour in COLOURS else "util"
    prefix = fleet_prefix()
    summary = _idle_summary(now)
    nodes_by_name = Node.objects.prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))
    shown = _node_page(nodes_by_name.order_by("name"), page, summary.nodes)
    nodes = list(shown.object_list)
    rows = [selectors.node_row(node, now) for node in nodes]
    held = _page_holders(nodes)
    idle, idle_more = _idle(prefix, now, summary)
    hrefs = {node.name: node_href(node.name) for node in nodes}
    gpu_nodes = []
    for node in nodes:
        squares = _squares(node, _live_gpus(node, now), held, colour)
        if squares:
            gpu_nodes.append(
                NodeGpus(name=node.name, short=short_name(node.name, prefix), squares=squares, href=hrefs[node.name])
            )
    # As the worker last counted them (within IDLE_SUMMARY_STALE_SECONDS), else counted now.
    counts = summary.cards if summary.cards is not None else _class_counts()
    # The cards of the nodes on other pages: the fleet's, less this page's (their rows are at hand).
    here = sum(1 for node in nodes for gpu in node.gpus.all() if gpu.parent_index is None)
    elsewhere = max(0, sum(counts.values()) - here) if shown.has_other_pages() else 0
    return Overview(
        rows=rows,
        prefix=prefix,
        columns=_columns(rows),
        colour=colour,
        nodes=gpu_nodes,
        idle=idle,
        idle_more=idle_more,
        charts=_fleet_charts(counts) if charts else [],
        legend=_legend(colour),
        page=shown,
        gpus_elsewhere=elsewhere,
        hrefs=hrefs,
    )
