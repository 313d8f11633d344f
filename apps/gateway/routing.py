"""Choosing a replica: least outstanding requests with prefix affinity, within each one's slots."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from bisect import bisect_left
from collections.abc import Sequence

from apps.gateway.tables import Endpoint

__all__ = ["Admission", "affinity_key", "choose"]

AFFINITY_CHARS = 512  # the start of the prompt that decides where a conversation's cache lives
LOAD_BOUND = 1.25  # a preferred replica may carry this much more than the average before we move on
VNODES = 64


def affinity_key(body: dict) -> str | None:
    """The start of the prompt: system text and the first user turn (a conversation's stable prefix)."""
    messages = body.get("messages")
    parts: list[str] = []
    if isinstance(body.get("system"), str):
        parts.append(body["system"])
    if isinstance(body.get("instructions"), str):
        parts.append(body["instructions"])
    if isinstance(messages, list):
        for message in messages[:2]:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    elif isinstance(body.get("prompt"), str):
        parts.append(body["prompt"])
    elif isinstance(body.get("input"), str):
        parts.append(body["input"])
    text = "\n".join(parts)[:AFFINITY_CHARS]
    return text or None


def _ring_position(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


_rings: dict[tuple[str, ...], tuple[list[int], list[int]]] = {}


def _ring(endpoints: Sequence[Endpoint]) -> tuple[list[int], list[int]]:
    ids = tuple(e.id for e in endpoints)
    cached = _rings.get(ids)
    if cached is None:
        points = sorted((_ring_position(f"{eid}#{v}"), i) for i, eid in enumerate(ids) for v in range(VNODES))
        cached = ([p for p, _i in points], [i for _p, i in points])
        if len(_rings) > 1024:
            _rings.clear()
        _rings[ids] = cached
    return cached


def choose(endpoints: Sequence[Endpoint], key: str | None, *, exclude: set[str] | None = None) -> Endpoint | None:
    """A replica with a free slot: the prompt's home on the ring unless it is overloaded, else the less
    busy of two picked at random. None when every replica is full (or failing)."""
    now = time.monotonic()
    usable = [e for e in endpoints if e.outstanding < e.slots and e.failed_until <= now
              and (exclude is None or e.id not in exclude)]
    if not usable:
        return None
    if len(usable) == 1:
        return usable[0]
    if key is not None:
        points, owners = _ring(endpoints)
        start = bisect_left(points, _ring_position(key)) % len(points)
        average = sum(e.outstanding for e in usable) / len(usable)
        seen: set[int] = set()
        for step in range(len(points)):
            index = owners[(start + step) % len(points)]
            if index in seen:
                continue
            seen.add(index)
            candidate = endpoints[index]
            if candidate in usable and candidate.outstanding <= average * LOAD_BOUND + 1:
                return candidate
            if len(seen) == len(endpoints):
                break
    a, b = random.sample(usable, 2)  # noqa: S311 - load balancing, not secrets
    return a if a.outstanding <= b.outstanding else b


class Admission:
    """Per model: requests wait here (bounded, with a timeout) when every replica's slots are taken."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.waiting: dict[str, int] = {}
        self._events: dict[str, asyncio.Event] = {}

    def event(self, model: str) -> asyncio.Event:
        event = self._events.get(model)
        if event is None:
            event = self._events[model] = asyncio.Event()
        return event

    def released(self, model: str) -> None:
        event = self._events.get(model)
        if event is not None:
            event.set()
            self._events[model] = asyncio.Event()

    def full(self, model: str) -> bool:
        return self.waiting.get(model, 0) >= self.max_waiting
