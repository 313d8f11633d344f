"""Who gets a model's next free slot: weighted fair sharing by tokens, down the people tree, in
priority bands. Pure Python, no I/O: the gateway's admission stage (apps.gateway.admission) keeps
one `FairQueue` per process, and with Redis the same rules run in apps.gateway.slots' scripts.

The discipline is start-time fair queuing (SFQ, Goyal, Vin and Cheng 1996), applied per model:

- every request has a cost in tokens: its prompt plus the output it is expected to produce (its
  `max_tokens`, bounded by what its key's requests to the model really produce);
- a request waiting for a slot gets a start tag S = max(V, F) where V is the model's virtual time
  (the tag of the request last given a slot) and F its key's finish tag, and moves F on to
  S + cost / share. The waiting request with the smallest tag is served next;
- `share` is the key's share of the model down the tree, among those waiting for it now:
  (its organisation's weight / the weights of the organisations with requests waiting)
  x (its team's weight / its organisation's teams with requests waiting) x (project) x (key).
  A share nobody uses goes to those waiting: the discipline is work-conserving;
- when a request ends, its key's F is corrected by what it really cost: (real - expected) / share;
- when nobody waits any more (the end of a busy period), the model's tags are forgotten: fairness
  is among those who contend, and a key is not held back later for what it used when nobody else
  wanted the model.

A key that has not asked for a while has F <= V, so its next request starts at V, ahead of a
flooding key whose tags run far beyond V: a light user waits for about one slot, not behind the
flood. Two keys both saturating a model get slots in the ratio of their shares, in tokens.

Bands: `interactive` (0) before `batch` (1). A batch request is given a slot only when no
interactive one waits, except that after `BATCH_EVERY - 1` interactive grants in a row while a
batch request waited, the next goes to the batch band: a batch request at the head of its band
waits at most BATCH_EVERY slot grants of its model, so nothing waits for ever.

A full queue refuses the request furthest over its share in the lowest band: the waiting one with
the largest tag there (its owner is furthest ahead of the rest), or the new one if its own tag
is larger still or its band lower.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["BANDS", "BATCH", "BATCH_EVERY", "INTERACTIVE", "FairQueue", "Ticket", "Who", "band_named"]

INTERACTIVE, BATCH = 0, 1
BANDS = ("interactive", "batch")
#: Of every this many slot grants of a model, one goes to a waiting batch request.
BATCH_EVERY = 10


def band_named(name: object) -> int | None:
    """The band called `name` ("interactive", "batch"; OpenAI's `service_tier` "flex" is batch,
    "default", "auto" and "priority" interactive), None for a name no band has."""
    if not isinstance(name, str):
        return None
    text = name.strip().lower()
    if text in ("interactive", "default", "auto", "priority"):
        return INTERACTIVE
    if text in ("batch", "flex"):
        return BATCH
    return None


@dataclass(frozen=True)
class Who:
    """Whose request: the path down the people tree (0 where a level is missing) and each level's
    weight, organisation first."""

    org: int
    team: int
    project: int
    key: int
    weights: tuple[int, int, int, int] = (1, 1, 1, 1)

    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """The tree's nodes on this path, organisation first: each a tuple of the ids above it."""
        return (
            (self.org,),
            (self.org, self.team),
            (self.org, self.team, self.project),
            (
                self.org,
                self.team,
                self.project,
                self.key,
            ),
        )

    def token(self) -> str:
        """The path and weights in a few characters (a shared queue's member carries them)."""
        return ".".join(map(str, (self.org, self.team, self.project, self.key, *self.weights)))

    @classmethod
    def from_token(cls, text: str) -> Who | None:
        parts = text.split(".")
        if len(parts) != 8 or not all(p.isascii() and p.isdigit() for p in parts):
            return None
        n = [int(p) for p in parts]
        return cls(n[0], n[1], n[2], n[3], weights=(n[4], n[5], n[6], n[7]))


class Waiting:
    """The people with requests waiting, down the tree: per node, how many of its requests wait,
    and per parent, the weights of its children that have some (kept as requests come and go)."""

    def __init__(self) -> None:
        self.count: dict[tuple[int, ...], int] = {}
        self.weight_sum: dict[tuple[int, ...], float] = {}

    def add(self, who: Who, delta: int) -> None:
        for node, weight in zip(who.nodes(), who.weights, strict=True):
            before = self.count.get(node, 0)
            after = before + delta
            parent = node[:-1]
            if before == 0 and after > 0:
                self.weight_sum[parent] = self.weight_sum.get(parent, 0.0) + weight
            elif before > 0 and after == 0:
                left = self.weight_sum.get(parent, 0.0) - weight
                if left > 1e-9:
                    self.weight_sum[parent] = left
                else:
                    self.weight_sum.pop(parent, None)
            if after > 0:
                self.count[node] = after
            else:
                self.count.pop(node, None)

    def share(self, who: Who) -> float:
        """The key's share of the model among those waiting, itself counted as waiting."""
        share = 1.0
        for node, weight in zip(who.nodes(), who.weights, strict=True):
            waiting = self.weight_sum.get(node[:-1], 0.0)
            if self.count.get(node, 0) == 0:
                waiting += weight  # not waiting yet: it is about to
            share *= weight / waiting if waiting > 0 else 1.0
        return share


@dataclass(eq=False)
class Ticket:
    """One waiting request's place: its tag, band, share, and what it was charged."""

    who: Who
    band: int
    cost: float
    tag: float
    share: float
    seq: int
    gone: str | None = None  # why it left the queue without a slot (pushed out to make room)
    granted: bool = False


@dataclass
class _Model:
    vtime: float = 0.0
    finish: dict[int, float] = field(default_factory=dict)
    heaps: tuple[list[tuple[float, int, Ticket]], list[tuple[float, int, Ticket]]] = field(
        default_factory=lambda: ([], [])
    )
    sizes: list[int] = field(default_factory=lambda: [0, 0])
    skips: int = 0
    waiting: Waiting = field(default_factory=Waiting)


class Full(Exception):
    """The queue is full and this request is the one refused; `ticket` says its tag and share."""

    def __init__(self, ticket: Ticket) -> None:
        super().__init__("queue full")
        self.ticket = ticket


class FairQueue:
    """The waiting requests of every model in one process, by the rules of the module docstring."""

    def __init__(self, most: int, *, batch_every: int = BATCH_EVERY, first_come: bool = False) -> None:
        self.most = most
        self.batch_every = max(2, batch_every)
        # First come, first served in each band (tags are arrival order): only bench/fairness.py's
        # baseline runs so.
        self.first_come = first_come
        self._models: dict[str, _Model] = {}
        self._seq = itertools.count()

    def _model(self, name: str) -> _Model:
        found = self._models.get(name)
        if found is None:
            found = self._models[name] = _Model()
        return found

    def waiting(self, model: str, band: int | None = None) -> int:
        found = self._models.get(model)
        if found is None:
            return 0
        return sum(found.sizes) if band is None else found.sizes[band]

    def share(self, model: str, who: Who) -> float:
        return self._model(model).waiting.share(who)

    def enter(self, model: str, who: Who, band: int, cost: float, *, room: int = 0) -> tuple[Ticket, Ticket | None]:
        """Queue a request: (its ticket, the one pushed out to make room or None). Full when the
        queue is full and this request is the one refused (nothing changes then). `room`: places
        beyond the maximum, for waiters about to leave it for a slot that is free now."""
        state = self._model(model)
        share = state.waiting.share(who)
        seq = next(self._seq)
        start = float(seq) if self.first_come else max(state.vtime, state.finish.get(who.key, state.vtime))
        ticket = Ticket(who, band, cost, start, share, seq)
        pushed = None
        if sum(state.sizes) >= self.most + room:
            victim = self._furthest(state)
            if victim is None or (victim.band, victim.tag) <= (band, start):
                raise Full(ticket)
            victim.gone = "pushed out"
            state.sizes[victim.band] -= 1
            state.waiting.add(victim.who, -1)
            pushed = victim
        state.finish[who.key] = start + cost / share
        heapq.heappush(state.heaps[band], (start, ticket.seq, ticket))
        state.sizes[band] += 1
        state.waiting.add(who, 1)
        return ticket, pushed

    def _furthest(self, state: _Model) -> Ticket | None:
        """The waiting request furthest over its share in the lowest band that has any."""
        for band in (BATCH, INTERACTIVE):
            live = [t for _s, _q, t in state.heaps[band] if t.gone is None and not t.granted]
            if live:
                return max(live, key=lambda t: (t.tag, t.seq))
        return None

    def charge(self, model: str, who: Who, band: int, cost: float) -> Ticket:
        """A request took a free slot with nobody waiting: it is in service, so its key's tag moves
        on as if it had queued, and the model's virtual time to its start (a key's tag thus stays
        within one request of the virtual time while nobody contends). Its ticket, already granted,
        is what `correct` takes once it ends."""
        state = self._model(model)
        share = state.waiting.share(who)
        start = max(state.vtime, state.finish.get(who.key, state.vtime))
        if not self.first_come:
            state.finish[who.key] = start + cost / share
            state.vtime = start
        return Ticket(who, band, cost, start, share, next(self._seq), granted=True)

    def head(self, model: str) -> Ticket | None:
        """The request that is to take the model's next slot."""
        state = self._models.get(model)
        if state is None:
            return None
        first = self._top(state, INTERACTIVE)
        second = self._top(state, BATCH)
        if first is None or (second is not None and state.skips >= self.batch_every - 1):
            return second
        return first

    def top(self, model: str, band: int) -> Ticket | None:
        """The first in turn of one band (the interactive one's, when a batch head may not take a
        slot: the interactive reserve holds it back)."""
        state = self._models.get(model)
        return None if state is None else self._top(state, band)

    @staticmethod
    def _top(state: _Model, band: int) -> Ticket | None:
        heap = state.heaps[band]
        while heap and (heap[0][2].gone is not None or heap[0][2].granted):
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def grant(self, model: str, ticket: Ticket) -> None:
        """The ticket took a slot: it leaves the queue, and the model's virtual time moves to its tag."""
        state = self._models.get(model)
        if state is None or ticket.gone is not None or ticket.granted:
            return
        lower_waits = state.sizes[BATCH] - (1 if ticket.band == BATCH else 0) > 0
        state.skips = state.skips + 1 if ticket.band == INTERACTIVE and lower_waits else 0
        state.vtime = max(state.vtime, ticket.tag)
        ticket.granted = True
        self._left(model, state, ticket)

    def leave(self, model: str, ticket: Ticket) -> None:
        """The request stopped waiting without a slot (timed out, the client left): its place goes,
        and its key is not charged for what it never used."""
        state = self._models.get(model)
        if state is None or ticket.gone is not None or ticket.granted:
            return
        finish = state.finish.get(ticket.who.key)
        if finish is not None:
            state.finish[ticket.who.key] = max(state.vtime, finish - ticket.cost / ticket.share)
        ticket.gone = "left"
        self._left(model, state, ticket)

    def _left(self, model: str, state: _Model, ticket: Ticket) -> None:
        state.sizes[ticket.band] -= 1
        state.waiting.add(ticket.who, -1)
        if not sum(state.sizes):  # the busy period ended: its tags are forgotten
            del self._models[model]

    def correct(self, model: str, ticket: Ticket, real_cost: float) -> None:
        """Charge the key what its request really cost, once it ended."""
        state = self._models.get(model)
        if state is None or ticket.share <= 0:
            return
        finish = state.finish.get(ticket.who.key)
        if finish is not None:
            state.finish[ticket.who.key] = max(ticket.tag, finish + (real_cost - ticket.cost) / ticket.share)

    def place(self, model: str, ticket: Ticket) -> tuple[int, int]:
        """(1-based place of the ticket among those of its band, how many of its band wait)."""
        state = self._models.get(model)
        if state is None:
            return 0, 0
        live = sorted((t.tag, t.seq) for _s, _q, t in state.heaps[ticket.band] if t.gone is None and not t.granted)
        try:
            return live.index((ticket.tag, ticket.seq)) + 1, len(live)
        except ValueError:
            return 0, len(live)

    def tickets(self, model: str) -> Iterator[Ticket]:
        """The model's waiting tickets, interactive first. Each band's heap is copied in one step, so
        another thread (the console's model card) may read them while the gateway's loop runs."""
        state = self._models.get(model)
        if state is None:
            return
        for band in (INTERACTIVE, BATCH):
            for _s, _q, ticket in list(state.heaps[band]):
                if ticket.gone is None and not ticket.granted:
                    yield ticket
