"""Choosing an upstream: prefix affinity under a load bound, else the least loaded, within slots.

Choosing is two steps, so that one process (counts in memory) and several (counts in Redis,
apps.gateway.slots) decide by the same rule:

1. `preference(upstreams, key)` orders the candidates. With a prompt key, the order is the
   key's walk round a consistent-hash ring, so the turns of one conversation (whose start does
   not change) come to the same replica, which holds that prefix in its cache; without one, a
   random order, so ties between equally loaded replicas are broken at random.
2. `pick(loads, capacities, mode)` takes the first candidate in that order whose load is within
   LOAD_BOUND of the average of those with a free slot (mode BOUNDED), else the least loaded
   with a free slot, earliest in the order on a tie (mode LEAST). None when every slot is taken.

`POLICY` switches the rule for benchmarks only ("affinity", the default; "least_load";
"round_robin"); nothing in production sets it.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from apps.gateway.tables import Upstream

__all__ = ["AFFINITY_CHARS", "BOUNDED", "FIRST", "LEAST", "LOAD_BOUND", "POLICY", "affinity_key", "pick", "preference"]

# How much of the system text and of the first user turn decide where a conversation's cache
# lives: enough to tell conversations apart that share a long system prompt.
AFFINITY_CHARS = 256
LOAD_BOUND = 1.25  # a preferred replica may carry this much more than the average before we move on
VNODES = 64

LEAST, BOUNDED, FIRST = 0, 1, 2  # pick's modes (the same numbers the Redis script reads)

POLICY = "affinity"
_round_robin = itertools.count()


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def affinity_key(body: dict[str, Any]) -> str | None:
    """A conversation's stable start: the start of its system text and of its first user turn."""
    system = ""
    for name in ("system", "instructions"):
        system += _text(body.get(name))
    first_user = ""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict):
                continue
            if message.get("role") in ("system", "developer") and not first_user:
                system += _text(message.get("content"))
            elif message.get("role") == "user":
                first_user = _text(message.get("content"))
                break
    elif isinstance(body.get("prompt"), str):
        first_user = body["prompt"]
    elif isinstance(body.get("input"), str):
        first_user = body["input"]
    if not system and not first_user:
        return None
    return system[:AFFINITY_CHARS] + "\x00" + first_user[:AFFINITY_CHARS]


def _ring_position(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


_rings: dict[tuple[str, ...], tuple[list[int], list[int]]] = {}


def _ring(ids: tuple[str, ...]) -> tuple[list[int], list[int]]:
    cached = _rings.get(ids)
    if cached is None:
        points = sorted((_ring_position(f"{uid}#{v}"), i) for i, uid in enumerate(ids) for v in range(VNODES))
        cached = ([p for p, _i in points], [i for _p, i in points])
        if len(_rings) > 1024:
            _rings.clear()
        _rings[ids] = cached
    return cached


def preference(upstreams: Sequence[Upstream], key: str | None) -> tuple[list[Upstream], int]:
    """The candidates in the order they are preferred, and the mode `pick` applies to that order."""
    if len(upstreams) <= 1:
        return list(upstreams), LEAST
    if POLICY == "round_robin":
        start = next(_round_robin) % len(upstreams)
        return [*upstreams[start:], *upstreams[:start]], FIRST
    if key is None or POLICY == "least_load":
        shuffled = list(upstreams)
        random.shuffle(shuffled)
        return shuffled, LEAST
    points, owners = _ring(tuple(u.id for u in upstreams))
    start = bisect_left(points, _ring_position(key))
    order: list[Upstream] = []
    seen: set[int] = set()
    for step in range(len(points)):
        index = owners[(start + step) % len(points)]
        if index not in seen:
            seen.add(index)
            order.append(upstreams[index])
            if len(order) == len(upstreams):
                break
    return order, BOUNDED


def pick(loads: Sequence[int], capacities: Sequence[int], mode: int) -> int | None:
    """The index (into the preference order) of the upstream to use; None when all are full."""
    usable = [i for i, (load, capacity) in enumerate(zip(loads, capacities, strict=True)) if load < capacity]
    if not usable:
        return None
    if mode == FIRST:
        return usable[0]
    if mode == BOUNDED:
        limit = sum(loads[i] for i in usable) / len(usable) * LOAD_BOUND + 1
        for i in usable:
            if loads[i] <= limit:
                return i
    return min(usable, key=lambda i: loads[i])
