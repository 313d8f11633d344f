"""Slots and the queue shared through Redis by several gateway processes, each played here by its
own keeper and connection against the suite's real Redis. Skipped where the suite has no Redis."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

import pytest

from apps.gateway.slots import QueueFull, SharedSlots, SlotKeeper, WaitingRoom
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
        self.waiting = WaitingRoom(2, self.shared)
        self.shared.on_released = self.waiting.released
        self.shared.start()

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
    first = await a.waiting.enter("m")
    second = await b.waiting.enter("m")
    with pytest.raises(QueueFull):
        await a.waiting.enter("m")
    await b.waiting.leave("m", second)
    third = await a.waiting.enter("m")
    await a.waiting.leave("m", first)
    await a.waiting.leave("m", third)


async def test_a_slot_given_back_in_one_process_wakes_the_waiters_of_another(processes: Callable[..., Process]) -> None:
    a, b = processes(), processes()
    await asyncio.sleep(0.3)  # both are listening for releases
    target = [upstream(capacity=1)]
    lease = await a.keeper.acquire(target, None)
    assert lease is not None
    woken = b.waiting.event("m")
    await a.keeper.give_back(lease)
    async with asyncio.timeout(WAIT):
        await woken.wait()


async def test_taking_a_slot_with_a_queue_ticket_leaves_the_queue_in_the_same_step(
    processes: Callable[..., Process],
) -> None:
    a, b = processes(), processes()
    target = [upstream(capacity=1)]
    first = await a.waiting.enter("m")
    second = await b.waiting.enter("m")
    lease = await a.keeper.acquire(target, None, ticket=first)
    assert lease is not None
    # The queue has room again at once, before the first request's own leave.
    third = await b.waiting.enter("m")
    await a.waiting.leave("m", first)
    await b.waiting.leave("m", second)
    await b.waiting.leave("m", third)
