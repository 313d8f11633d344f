"""Slots and the fair queue shared through Redis by several gateway processes, each played here by
its own keeper and connection against the suite's real Redis. Skipped where the suite has no Redis."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

import pytest

from apps.gateway.fairness import BATCH, INTERACTIVE, Who
from apps.gateway.slots import Gone, NotYourTurn, QueueFull, SharedSlots, SlotKeeper
from apps.gateway.tables import Upstream
from apps.quotas.resp import RedisClient, subscribe

REDIS_URL = os.environ.get("LLMGW_REDIS_URL", "")
pytestmark = pytest.mark.skipif(not REDIS_URL, reason="shared slots are counted in Redis; this run has none")

WAIT = 10.0


def upstream(upstream_id: str = "r1", capacity: int = 2) -> Upstream:
    return Upstream(
        id=upstream_id,
        url="http://127.0.0.1:1",
        secret=None,
        capacity=capacity,
        hardware="cpu",
        node="n1",
        model="m",
        upstream_model="m",
    )


class Process:
    """What one gateway process holds: its keeper, queue and shared counts."""

    def __init__(self, prefix: str, lease_s: float) -> None:
        self.shared = SharedSlots(
            RedisClient(REDIS_URL, timeout=2.0), prefix=prefix, lease_s=lease_s, subscribe=partial(subscribe, REDIS_URL)
        )
        self.keeper = SlotKeeper(self.shared)
        self.heard: list[str] = []
        self.shared.on_released = self.heard.append
        self.shared.start()

    async def enter(self, key: int, band: int = INTERACTIVE, cost: float = 100.0, most: int = 2) -> str:
        ticket, _tag, _pushed = await self.shared.enter("m", Who(key, key, key, key).token(), band, key, cost, most)
        return ticket

    async def stop(self) -> None:
        await self.shared.stop()
        await self.shared.client.close()

    async def die(self) -> None:
        """As a process killed with -9: nothing is given back, renewals stop."""
        for task in (self.shared._renewer, self.shared._listener):
            if task is not None:
                task.cancel()
        self.shared._held.clear()
        await self.shared.client.close()


@pytest.fixture
async def processes() -> AsyncIterator[Callable[..., Process]]:
    prefix = f"llmgw-test-{uuid.uuid4().hex[:8]}"
    made: list[Process] = []

    def make(lease_s: float = 15.0) -> Process:
        process = Process(prefix, lease_s)
        made.append(process)
        return process

    yield make
    for process in made:
        await process.stop()


async def test_two_processes_never_hold_more_of_an_upstream_than_its_capacity(
    processes: Callable[..., Process],
) -> None:
    a, b = processes(), processes()
    target = [upstream(capacity=3)]
    leases = [
        await a.keeper.acquire(target, None),
        await b.keeper.acquire(target, None),
        await a.keeper.acquire(target, None),
    ]
    assert all(lease is not None for lease in leases)
    assert await b.keeper.acquire(target, None) is None
    assert await a.keeper.acquire(target, None) is None
    await a.keeper.give_back(leases[0])  # type: ignore[arg-type]
    assert await b.keeper.acquire(target, None) is not None


async def test_both_processes_see_the_load_of_the_other_when_they_choose(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    one, two = upstream("r1", 4), upstream("r2", 4)
    first = await a.keeper.acquire([one, two], None)
    second = await a.keeper.acquire([one, two], None)
    assert first is not None and second is not None
    assert first.upstream is not second.upstream  # the least loaded of two, by the shared count
    third = await b.keeper.acquire([one, two], None)
    fourth = await b.keeper.acquire([one, two], None)
    assert third is not None and fourth is not None
    assert {third.upstream.id, fourth.upstream.id} == {"r1", "r2"}


async def test_the_slots_of_a_process_that_died_come_back_when_its_leases_expire(
    processes: Callable[..., Process],
) -> None:
    dead, alive = processes(lease_s=1.0), processes()
    target = [upstream(capacity=1)]
    assert await dead.keeper.acquire(target, None) is not None
    await dead.die()
    assert await alive.keeper.acquire(target, None) is None
    found = []

    async def try_again() -> None:
        while not found:
            lease = await alive.keeper.acquire(target, None)
            if lease is not None:
                found.append(lease)
            await asyncio.sleep(0.1)

    async with asyncio.timeout(WAIT):
        await try_again()


async def test_a_live_process_keeps_its_slots_past_the_lease_by_renewing_them(
    processes: Callable[..., Process],
) -> None:
    holder, other = processes(lease_s=1.0), processes()
    target = [upstream(capacity=1)]
    assert await holder.keeper.acquire(target, None) is not None
    await asyncio.sleep(2.5)  # more than two leases long: renewed every third of one
    assert await other.keeper.acquire(target, None) is None


async def test_the_queue_counts_waiters_of_every_process_against_its_maximum(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    first = await a.enter(1)
    second = await b.enter(2)
    with pytest.raises(QueueFull):
        await a.enter(3)  # a new key's tag is no smaller than those waiting: it is the one refused
    await b.shared.leave("m", second, 2, 100.0)
    third = await a.enter(3)
    await a.shared.leave("m", first, 1, 100.0)
    await a.shared.leave("m", third, 3, 100.0)


async def test_a_slot_given_back_in_one_process_wakes_the_waiters_of_another(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    await asyncio.sleep(0.3)  # both are listening for releases
    target = [upstream(capacity=1)]
    lease = await a.keeper.acquire(target, None)
    assert lease is not None
    await a.keeper.give_back(lease)
    async with asyncio.timeout(WAIT):
        while "m" not in b.heard:
            await asyncio.sleep(0.02)


async def test_the_turn_is_the_same_in_every_process(processes: Callable[..., Process]) -> None:
    """A flooding key's requests wait in one process, a light key's in another: the light one takes
    the slot that frees, and nobody without a ticket takes one past those waiting."""
    flood, light = processes(), processes()
    target = [upstream(capacity=1)]
    held = await flood.keeper.acquire(target, None)
    assert held is not None
    flooding = [await flood.enter(1, most=10) for _ in range(3)]
    mine = await light.enter(2, most=10)  # its key asked nothing yet: its tag is the virtual time
    await flood.keeper.give_back(held)
    with pytest.raises(NotYourTurn) as other:
        await flood.keeper.acquire(target, None, queue="m", ticket=flooding[1])
    assert other.value.head in (flooding[0], mine)
    with pytest.raises(NotYourTurn):
        await flood.keeper.acquire(target, None)  # no ticket: no passing those who wait
    winner = flooding[0] if other.value.head == flooding[0] else mine
    owner = flood if winner == flooding[0] else light
    lease = await owner.keeper.acquire(target, None, queue="m", ticket=winner)
    assert lease is not None
    await owner.keeper.give_back(lease)
    following = flooding[0] if winner == mine else mine
    follower = flood if following == flooding[0] else light
    lease = await follower.keeper.acquire(target, None, queue="m", ticket=following)
    assert lease is not None  # the light key's request was never behind the flood's second and third
    await follower.keeper.give_back(lease)


async def test_a_full_queue_pushes_out_the_one_furthest_over_its_share(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    batch = await a.enter(9, band=BATCH, most=2)
    await a.enter(1, most=2)
    await b.enter(2, most=2)  # full: the batch request goes
    with pytest.raises(Gone):
        await a.keeper.acquire([upstream(capacity=1)], None, queue="m", ticket=batch)


async def test_the_tickets_of_a_process_that_died_give_their_place_back(processes: Callable[..., Process]) -> None:
    dead, alive = processes(lease_s=1.0), processes()
    await dead.enter(1, most=1)
    await dead.die()
    with pytest.raises(QueueFull):
        await alive.enter(2, most=1)
    async with asyncio.timeout(WAIT):
        while True:
            try:
                await alive.enter(2, most=1)
                break
            except QueueFull:
                await asyncio.sleep(0.2)


async def test_taking_a_slot_with_a_queue_ticket_leaves_the_queue_in_the_same_step(
    processes: Callable[..., Process],
) -> None:
    a, b = processes(), processes()
    target = [upstream(capacity=1)]
    first = await a.enter(1)
    second = await b.enter(1)  # the same key: behind its first
    lease = await a.keeper.acquire(target, None, queue="m", ticket=first)
    assert lease is not None
    # The queue has room again at once, before the first request's own leave.
    third = await b.enter(2)
    await a.shared.leave("m", first, 1, 100.0)
    await b.shared.leave("m", second, 1, 100.0)
    await b.shared.leave("m", third, 2, 100.0)
