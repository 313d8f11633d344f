"""Who holds a busy model's slots and who waits for them, with their shares: the part of a model's
card (apps.catalog.cards) that shows it while the model is contended.

Read, never changed:

- with Redis (settings.REDIS_URL), from what every gateway process keeps there: the tickets in the
  model's queue, in both bands, whose expiry has not passed, and the leases in the slot sets of its
  replicas (apps.gateway.slots); each member ends with "|<fairness.Who.token>";
- without Redis, from this process's gateway (then the only one): its fair queue's tickets and its
  slot keeper's leases.

Anything else is unknown, and said so rather than shown as nobody. A lease that names nobody (a
guard model's check, a lease from a gateway before leases named their owner) is counted as held
by someone unknown.

Shares are the fair queue's (apps.gateway.fairness.Waiting): at each level of the tree, a branch's
weight over the weights of its siblings with requests waiting, multiplied down to it. Only those
waiting share the next slots; a branch that only holds slots has no share of them.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils.translation import gettext as _

from apps.catalog.cards import CardPart
from apps.catalog.models import Model
from apps.cluster.choices import ReplicaState
from apps.gateway.fairness import BATCH, Waiting, Who
from apps.gateway.slots import queue_keys, shared_key
from llmgw import redis_client

if TYPE_CHECKING:
    import redis

__all__ = ["Party", "Reading", "ShareRow", "card_part", "read", "share_rows"]

log = logging.getLogger("llmgw.gateway")

# KEYS: a model's two bands' tag sets and its tickets' expiry set, then the slot sets of its replicas.
# Returns the live tickets of each band, then the live leases of each slot set (what has not expired).
READ_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for b = 1, 2 do
  local live = {}
  for _, member in ipairs(redis.call('ZRANGE', KEYS[b], 0, -1)) do
    local expiry = redis.call('ZSCORE', KEYS[3], member)
    if expiry and tonumber(expiry) > now then live[#live + 1] = member end
  end
  out[b] = live
end
for i = 4, #KEYS do out[i - 1] = redis.call('ZRANGEBYSCORE', KEYS[i], '(' .. now, '+inf') end
return out
"""


@dataclass(frozen=True)
class Party:
    """One key's requests on the model: how many hold a slot and how many wait (and in which band).
    `who` is None for slots held by someone unknown."""

    who: Who | None
    holding: int = 0
    waiting: int = 0
    batch: int = 0  # of those waiting, how many in the batch band


@dataclass(frozen=True)
class Reading:
    """What is known of a model's slots and queue now; `unknown` says why nothing is, when so."""

    parties: tuple[Party, ...] = ()
    unknown: str = ""

    @property
    def holding(self) -> int:
        return sum(p.holding for p in self.parties)

    @property
    def waiting(self) -> int:
        return sum(p.waiting for p in self.parties)


def _owner(member: str) -> Who | None:
    """Whose request a ticket or a lease is, from the Who token its member ends with."""
    head, bar, token = member.rpartition("|")
    return Who.from_token(token) if bar and head else None


def _collect(holders: Iterable[Who | None], interactive: Iterable[Who | None], batch: Iterable[Who | None]) -> Reading:
    holding: Counter[Who | None] = Counter(holders)
    waiting: Counter[Who | None] = Counter(interactive)
    batched: Counter[Who | None] = Counter(batch)
    waiting.update(batched)
    keys = sorted(set(holding) | set(waiting), key=lambda who: who.token() if who is not None else "")
    return Reading(tuple(Party(who, holding[who], waiting[who], batched[who]) for who in keys))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_redis(client: redis.Redis, model: str, upstream_ids: Sequence[str]) -> Reading:
    prefix = settings.REDIS_PREFIX
    keys = [*queue_keys(prefix, model)[:3], *(shared_key(prefix, "slots", i) for i in upstream_ids)]
    try:
        reply: Any = client.eval(READ_SCRIPT, len(keys), *keys)
    except Exception as exc:
        log.warning("could not read the queue of %s from Redis: %s", model, exc)
        return Reading(unknown=_("Redis did not answer (%(error)s).") % {"error": type(exc).__name__})
    interactive, batch, *slots = reply
    return _collect(
        (_owner(_text(m)) for members in slots for m in members),
        (_owner(_text(m)) for m in interactive),
        (_owner(_text(m)) for m in batch),
    )


def _read_process(model: str) -> Reading:
    gateway = sys.modules.get("apps.gateway.asgi")
    if gateway is None:
        return Reading(unknown=_("No gateway runs in this process and no Redis is configured to ask."))
    app = gateway.gateway_app
    tickets = list(app.admission.queue.tickets(model))
    return _collect(
        (Who.from_token(token) if token else None for token in app.keeper.holders(model)),
        (t.who for t in tickets if t.band != BATCH),
        (t.who for t in tickets if t.band == BATCH),
    )


def read(model: str, upstream_ids: Sequence[str]) -> Reading:
    """Who holds the slots of `model` (on the upstreams `upstream_ids`) and who waits for one, from
    Redis when it is configured, else from this process's gateway."""
    client = redis_client.client()
    if client is not None:
        return _read_redis(client, model, upstream_ids)
    return _read_process(model)


# The rows the card shows ---------------------------------------------------------------------------

LEVELS = ("org", "team", "project", "key")


@dataclass(frozen=True)
class ShareRow:
    """One branch of the tree (or a key) with requests on the model, indented by `depth`."""

    depth: int
    kind: str  # "org", "team", "project", "key", or "unknown" for slots held by nobody known
    name: str
    weight: int | None
    share: float | None  # of the next slots, among those waiting; None when it waits for none
    holding: int
    waiting: int
    batch: int = 0

    @property
    def share_percent(self) -> float | None:
        return None if self.share is None else self.share * 100


@dataclass
class _Node:
    depth: int
    weight: int
    holding: int = 0
    waiting: int = 0
    batch: int = 0


def _nodes(parties: Iterable[Party]) -> dict[tuple[int, ...], _Node]:
    nodes: dict[tuple[int, ...], _Node] = {}
    for party in parties:
        if party.who is None:
            continue
        for depth, (path, weight) in enumerate(zip(party.who.nodes(), party.who.weights, strict=True)):
            node = nodes.setdefault(path, _Node(depth, weight))
            node.holding += party.holding
            node.waiting += party.waiting
            node.batch += party.batch
    return nodes


def _share(waiting: Waiting, path: tuple[int, ...], weights: dict[tuple[int, ...], int]) -> float:
    share = 1.0
    for end in range(1, len(path) + 1):
        node = path[:end]
        total = waiting.weight_sum.get(node[:-1], 0.0)
        share *= weights[node] / total if total > 0 else 1.0
    return share


def _names(nodes: Iterable[tuple[int, ...]]) -> dict[tuple[int, int], str]:
    """{(depth, id): name} for the organisations, teams, projects and keys named in the paths."""
    from apps.accounts.models import ApiKey, Organization, Project, Team

    wanted: list[set[int]] = [set(), set(), set(), set()]
    for path in nodes:
        wanted[len(path) - 1].add(path[-1])
    names: dict[tuple[int, int], str] = {}
    for depth, rows in enumerate(
        (
            Organization.objects.filter(pk__in=wanted[0]).values_list("pk", "name"),
            Team.objects.filter(pk__in=wanted[1]).values_list("pk", "name"),
            Project.objects.filter(pk__in=wanted[2]).values_list("pk", "name"),
        )
    ):
        names.update(((depth, pk), name) for pk, name in rows)
    for key in ApiKey.objects.filter(pk__in=wanted[3]).only("name", "prefix"):
        names[(3, key.pk)] = f"{key.name} ({key.prefix}…)"
    return names


def share_rows(reading: Reading) -> list[ShareRow]:
    """The organisations, teams, projects and keys holding or waiting for the model, as a tree in name
    order, each with its weight, its share of the next slots and how many requests it holds and waits;
    then one row for slots held by someone unknown, if any."""
    nodes = _nodes(reading.parties)
    waiting = Waiting()
    for party in reading.parties:
        if party.who is not None and party.waiting:
            waiting.add(party.who, party.waiting)
    weights = {path: node.weight for path, node in nodes.items()}
    names = _names(nodes)

    def label(path: tuple[int, ...]) -> str:
        if not path[-1]:
            return _("(none)")
        return names.get((len(path) - 1, path[-1])) or _("#%(id)s (deleted)") % {"id": path[-1]}

    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for path in nodes:
        children.setdefault(path[:-1], []).append(path)
    rows: list[ShareRow] = []

    def walk(parent: tuple[int, ...]) -> None:
        for path in sorted(children.get(parent, []), key=lambda p: (label(p).casefold(), p)):
            node = nodes[path]
            share = _share(waiting, path, weights) if node.waiting else None
            rows.append(
                ShareRow(
                    node.depth,
                    LEVELS[node.depth],
                    label(path),
                    node.weight,
                    share,
                    node.holding,
                    node.waiting,
                    node.batch,
                )
            )
            walk(path)

    walk(())
    unknown = sum(p.holding for p in reading.parties if p.who is None)
    if unknown:
        rows.append(ShareRow(0, "unknown", _("unknown"), None, None, unknown, 0))
    return rows


def card_part(model: Model, user: Any) -> CardPart | None:
    """The "Who holds and waits" part of a model's card (none for a model served outside the cluster).

    The card is for staff who read everything, so every branch is named.
    """
    if model.is_external:
        return None
    replicas = list(model.replicas.all())
    reading = read(model.name, [str(r.pk) for r in replicas])
    parallel = {profile.pk: profile.parallel for profile in model.profiles.all()}
    slots = sum(parallel.get(r.profile_id or 0, 0) for r in replicas if r.state == ReplicaState.READY)
    return CardPart(
        "gateway/partials/model_queue.html",
        {
            "reading": reading,
            "rows": share_rows(reading) if reading.waiting else [],
            "slots": slots,
        },
    )
