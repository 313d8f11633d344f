"""The fair queue on its own (apps/gateway/fairness.py), with seeded random arrivals and departures:
a simulated model with a few slots and requests that hold one for their cost in tokens."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest

from apps.gateway.fairness import BATCH, BATCH_EVERY, INTERACTIVE, FairQueue, Full, Who, band_named

M = "m"


@dataclass
class Flow:
    who: Who
    band: int = INTERACTIVE
    in_flight: int = 0  # a closed loop keeps this many requests outstanding
    every: float | None = None  # or an open one: one request about every `every` seconds
    cost: float = 100.0


def simulate(flows: list[Flow], *, slots: int = 4, seconds: float = 3000.0, seed: int = 1, most: int = 10_000):
    """Run a model with `slots` for `seconds`: a request takes cost/100 seconds of a slot. Returns
    (tokens served per flow, waits per flow)."""
    rng = random.Random(seed)
    queue = FairQueue(most)
    events: list[tuple[float, int, str, object]] = []
    order = iter(range(10**9))
    served: Counter[int] = Counter()
    waits: defaultdict[int, list[float]] = defaultdict(list)
    free = slots
    entered: dict[int, tuple[float, int]] = {}

    def push(at: float, kind: str, item: object) -> None:
        heapq.heappush(events, (at, next(order), kind, item))

    for index, flow in enumerate(flows):
        for _ in range(flow.in_flight):
            push(rng.random(), "arrive", index)
        if flow.every:
            push(rng.random() * flow.every, "arrive", index)

    def dispatch(now: float) -> None:
        nonlocal free
        while free and (ticket := queue.head(M)) is not None:
            queue.grant(M, ticket)
            free -= 1
            at, index = entered.pop(id(ticket))
            waits[index].append(now - at)
            cost = flows[index].cost * rng.uniform(0.5, 1.5)
            queue.correct(M, ticket, cost)
            push(now + cost / 100.0, "done", (index, cost))

    while events:
        now, _n, kind, item = heapq.heappop(events)
        if now > seconds:
            break
        if kind == "arrive":
            index = int(item)  # type: ignore[call-overload]
            flow = flows[index]
            ticket, _pushed = queue.enter(M, flow.who, flow.band, flow.cost)
            entered[id(ticket)] = (now, index)
            if flow.every:
                push(now + flow.every * rng.uniform(0.9, 1.1), "arrive", index)
        else:
            index, cost = item  # type: ignore[misc]
            free += 1
            served[index] += cost
            if flows[index].in_flight:
                push(now, "arrive", index)
        dispatch(now)
    return served, waits


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_light_key_waits_for_about_one_slot_beside_a_flood(seed: int) -> None:
    """The campaign's case: one team keeps 32 requests in flight, another sends one short request
    every 2 s. The short one takes the next slot that frees; the flood waits behind itself."""
    flood = Flow(Who(1, 1, 1, 1), in_flight=32)
    light = Flow(Who(1, 2, 2, 2), every=2.0, cost=30.0)
    _served, waits = simulate([flood, light], seed=seed)
    service = flood.cost / 100.0  # one request's time on a slot
    assert len(waits[1]) > 1000
    # with 4 slots a slot frees every service/4 on average; the light key takes the next one
    assert p99(waits[1]) <= service, p99(waits[1])
    assert p99(waits[0]) > 5 * service  # the flood waits behind itself


@pytest.mark.parametrize("seed", [1, 2])
def test_two_saturating_teams_weighted_3_to_1_share_the_tokens_75_25(seed: int) -> None:
    heavy = Flow(Who(1, 1, 1, 1, weights=(1, 3, 1, 1)), in_flight=16)
    light = Flow(Who(1, 2, 2, 2, weights=(1, 1, 1, 1)), in_flight=16, cost=37.0)  # different request sizes
    served, _waits = simulate([heavy, light], seed=seed)
    share = served[0] / (served[0] + served[1])
    assert 0.72 <= share <= 0.78, share


def test_organisations_share_first_then_their_teams_and_keys() -> None:
    """Org A has three saturating keys, org B one: each organisation gets half, A's keys a sixth each."""
    flows = [Flow(Who(1, 1, 1, k), in_flight=8) for k in (1, 2, 3)] + [Flow(Who(2, 5, 5, 9), in_flight=8)]
    served, _ = simulate(flows, seed=4)
    total = sum(served.values())
    assert abs(served[3] / total - 0.5) < 0.04
    for index in (0, 1, 2):
        assert abs(served[index] / total - 1 / 6) < 0.03


def test_work_conserving_a_share_nobody_uses_goes_to_those_waiting() -> None:
    alone = Flow(Who(1, 1, 1, 1, weights=(1, 1, 1, 1)), in_flight=8)
    idle_heavy = Who(1, 2, 2, 2, weights=(1, 9, 1, 1))  # weighted 9 but asks nothing
    served, _ = simulate([alone], seed=5)
    assert served[0] >= 4 * 2900 * 100 * 0.95  # four slots busy nearly all the time
    assert FairQueue(10).share(M, idle_heavy) == 1.0  # nobody waits: all of it


def test_interactive_before_batch_and_batch_never_starves() -> None:
    interactive = Flow(Who(1, 1, 1, 1), in_flight=16)
    batch = Flow(Who(2, 2, 2, 2), band=BATCH, in_flight=16)
    served, waits = simulate([interactive, batch], seed=6)
    total = served[0] + served[1]
    assert served[1] > 0
    # strict priority, bounded: the batch band gets about one grant in BATCH_EVERY
    assert served[1] / total == pytest.approx(1 / BATCH_EVERY, abs=0.03)


def test_at_most_batch_every_grants_pass_a_waiting_batch_request() -> None:
    queue = FairQueue(100)
    batch, _ = queue.enter(M, Who(2, 2, 2, 2), BATCH, 10)
    for _ in range(30):
        queue.enter(M, Who(1, 1, 1, 1), INTERACTIVE, 10)
    granted = []
    for _ in range(BATCH_EVERY):
        head = queue.head(M)
        assert head is not None
        queue.grant(M, head)
        granted.append(head.band)
    assert granted.index(BATCH) == BATCH_EVERY - 1 and batch.granted


def test_a_full_queue_refuses_the_one_furthest_over_its_share_in_the_lowest_band() -> None:
    queue = FairQueue(4)
    flood = Who(1, 1, 1, 1)
    tickets = [queue.enter(M, flood, INTERACTIVE, 100)[0] for _ in range(3)]
    batch, _ = queue.enter(M, Who(3, 3, 3, 3), BATCH, 100)
    # full: a light interactive request pushes out the batch one first ...
    light, pushed = queue.enter(M, Who(2, 2, 2, 2), INTERACTIVE, 100)
    assert pushed is batch and batch.gone == "pushed out"
    # ... then the flood's last one (the largest tag), not the newest
    other, pushed = queue.enter(M, Who(4, 4, 4, 4), INTERACTIVE, 100)
    assert pushed is tickets[-1]
    # the flood asking again is itself refused: its tag is larger than every one waiting
    with pytest.raises(Full):
        queue.enter(M, flood, INTERACTIVE, 100)
    # and a batch request is refused while interactive ones fill the queue
    with pytest.raises(Full):
        queue.enter(M, Who(5, 5, 5, 5), BATCH, 1)
    assert queue.waiting(M) == 4 and {light, other} <= set(queue.tickets(M))


def test_leaving_frees_the_place_at_once_and_charges_nothing() -> None:
    queue = FairQueue(10)
    key = Who(1, 1, 1, 1)
    first, _ = queue.enter(M, key, INTERACTIVE, 100)
    second, _ = queue.enter(M, key, INTERACTIVE, 100)
    queue.leave(M, second)
    assert queue.waiting(M) == 1 and second.gone == "left"
    third, _ = queue.enter(M, key, INTERACTIVE, 100)
    assert third.tag == second.tag  # the place given back is taken again, not charged twice


def test_ten_thousand_keys_in_one_project_share_it_evenly() -> None:
    queue = FairQueue(20_000)
    tickets = [queue.enter(M, Who(1, 1, 1, k), INTERACTIVE, 10)[0] for k in range(10_000)]
    assert queue.waiting(M) == 10_000
    assert tickets[-1].share == pytest.approx(1 / 10_000)
    assert queue.head(M) is tickets[0]


def test_nobody_waiting_forgets_the_tags() -> None:
    queue = FairQueue(10)
    ticket, _ = queue.enter(M, Who(1, 1, 1, 1), INTERACTIVE, 10_000)
    queue.grant(M, ticket)
    light, _ = queue.enter(M, Who(1, 1, 1, 1), INTERACTIVE, 10)
    assert light.tag == 0.0  # a new busy period: what it used while nobody contended is not held against it


@pytest.mark.parametrize(
    ("name", "band"),
    [("interactive", INTERACTIVE), ("batch", BATCH), ("flex", BATCH), ("auto", INTERACTIVE), ("Batch ", BATCH)],
)
def test_band_names(name: str, band: int) -> None:
    assert band_named(name) == band


@pytest.mark.parametrize("name", ["urgent", "", None, 1, "batch\x00"])
def test_a_band_that_does_not_exist_is_none(name: object) -> None:
    assert band_named(name) is None


def test_who_travels_in_a_token() -> None:
    who = Who(1, 22, 333, 4444, weights=(3, 1, 2, 1))
    assert Who.from_token(who.token()) == who
    assert Who.from_token("1.2.3") is None and Who.from_token("a.b.c.d.1.1.1.1") is None
