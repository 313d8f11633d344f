"""Replica slots: given back exactly once, whatever happens between taking and giving them.

The keeper is driven on its own by a seeded random mix of starts, ends, client cancels, engine
failures, retries onto other replicas and table reloads; the whole gateway by real requests of
every kind while its tables are reloaded under them. Both must end with every count at zero and
llmgw_gateway_in_flight at the sum of the counts.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY

from apps.gateway.slots import Lease, SlotKeeper
from apps.gateway.tables import ModelRoute, Tables, Upstream
from tests.gateway.harness import HELLO, KEY, WAIT, Gateway, endpoint, held, route, until
from tests.gateway.mock_engine import MockEngine, closed_port


def in_flight_gauge() -> float:
    return REGISTRY.get_sample_value("llmgw_gateway_in_flight") or 0.0


def upstream(upstream_id: str, capacity: int) -> Upstream:
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


def tables_of(upstreams: list[Upstream], version: int) -> Tables:
    return Tables(
        models={"m": ModelRoute(name="m", upstreams=upstreams, fallbacks=[], min_replicas=1, hardware=["cpu"])},
        version=version,
    )


# The keeper on its own ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(25))
async def test_random_starts_ends_cancels_failures_retries_and_reloads_leave_every_count_at_zero(seed: int) -> None:
    rng = random.Random(seed)
    keeper = SlotKeeper()
    gauge_before = in_flight_gauge()
    ids = ["r1", "r2", "r3", "r4"]
    version = 1
    capacity = {i: rng.randint(1, 3) for i in ids}
    tables = tables_of([upstream(i, capacity[i]) for i in ids], version)
    keeper.bind(tables)
    leases: list[Lease] = []
    everything: set[int] = set()  # every InFlight ever handed out, by identity

    def check() -> None:
        live: dict[int, int] = {}
        for lease in leases:
            live[id(lease.inflight)] = live.get(id(lease.inflight), 0) + 1
        for inflight in {id(lease.inflight): lease.inflight for lease in leases}.values():
            assert inflight.held == live[id(inflight)]
        assert keeper.held() == len(leases)
        assert in_flight_gauge() - gauge_before == len(leases)

    for _step in range(600):
        action = rng.random()
        current = tables.models["m"].upstreams
        if action < 0.40:  # a request starts
            key = rng.choice([None, "conversation a", "conversation b", f"fresh {rng.random()}"])
            lease = await keeper.acquire(current, key)
            if lease is not None:
                assert lease.inflight.held <= lease.upstream.capacity
                leases.append(lease)
                everything.add(id(lease.inflight))
        elif action < 0.65 and leases:  # one ends: answered, cancelled by its client, or failed in the engine
            keeper.release(leases.pop(rng.randrange(len(leases))))
        elif action < 0.75 and leases:  # its replica could not be reached: retried on another
            lease = leases.pop(rng.randrange(len(leases)))
            keeper.mark_failed(lease.upstream, 0.0 if rng.random() < 0.5 else 60.0)
            keeper.release(lease)
            other = await keeper.acquire(current, None, exclude={lease.upstream.id})
            if other is not None:
                assert other.upstream.id != lease.upstream.id
                leases.append(other)
        elif action < 0.80 and leases:  # a second release of the same lease changes nothing
            keeper.release(rng.choice(leases))
            leases = [lease for lease in leases if not lease.released]
        else:  # the tables are rebuilt: new objects, replicas gone and back, capacities changed
            version += 1
            present = [i for i in ids if rng.random() < 0.8] or [rng.choice(ids)]
            for i in present:
                if rng.random() < 0.2:
                    capacity[i] = rng.randint(1, 3)
            tables = tables_of([upstream(i, capacity[i]) for i in present], version)
            keeper.bind(tables)
        check()

    for lease in leases:
        keeper.release(lease)
    leases.clear()
    check()
    assert keeper.held() == 0
    assert all(inflight.held == 0 for inflight in keeper.known())
    assert in_flight_gauge() == gauge_before


async def test_a_slot_taken_before_a_reload_is_given_back_to_the_count_the_new_table_reads() -> None:
    keeper = SlotKeeper()
    old = tables_of([upstream("r1", 1)], 1)
    keeper.bind(old)
    lease = await keeper.acquire(old.models["m"].upstreams, None)
    assert lease is not None
    new = tables_of([upstream("r1", 1)], 2)
    keeper.bind(new)
    # The new table's upstream is full: its count is the one the request holds.
    assert await keeper.acquire(new.models["m"].upstreams, None) is None
    keeper.release(lease)
    assert new.models["m"].upstreams[0].inflight is not None
    assert new.models["m"].upstreams[0].inflight.held == 0
    assert await keeper.acquire(new.models["m"].upstreams, None) is not None


async def test_a_replica_that_leaves_the_table_while_held_keeps_its_count_until_given_back() -> None:
    keeper = SlotKeeper()
    first = tables_of([upstream("r1", 1)], 1)
    keeper.bind(first)
    lease = await keeper.acquire(first.models["m"].upstreams, None)
    assert lease is not None
    keeper.bind(tables_of([upstream("r2", 1)], 2))  # r1 is gone from the table
    back = tables_of([upstream("r1", 1)], 3)
    keeper.bind(back)  # and back: still held by the request that took it
    assert await keeper.acquire(back.models["m"].upstreams, None) is None
    keeper.release(lease)
    assert await keeper.acquire(back.models["m"].upstreams, None) is not None


# The whole gateway -------------------------------------------------------------------------------------


def reload_to(gw: Gateway, upstreams: list[Upstream], **route_options: Any) -> Tables:
    """What the database says now: the gateway's next reload reads it."""
    tables = Tables(
        keys=gw.app.tables.keys, models={"m": route("m", upstreams, **route_options)}, version=gw.app.tables.version + 1
    )
    gw.database["tables"] = tables
    return tables


async def test_a_stream_that_spans_several_reloads_and_a_replica_change_gives_its_slot_back(
    gw: Gateway, engine: MockEngine
) -> None:
    gw.set_models(route("m", [endpoint(engine.url, "1", slots=1)]))
    engine.hold = asyncio.Event()
    engine.chunks = 5
    streaming = asyncio.create_task(gw.chat(stream=True))
    async with asyncio.timeout(WAIT):
        await engine.arrived.wait()
    for _ in range(3):  # reloads while the stream runs: new upstream objects for the same replica
        reload_to(gw, [endpoint(engine.url, "1", slots=1)])
        await gw.app.reload()
    reload_to(gw, [endpoint(engine.url, "2", slots=1)])  # the replica is replaced by another
    await gw.app.reload()
    reload_to(gw, [endpoint(engine.url, "1", slots=1), endpoint(engine.url, "2", slots=1)])
    await gw.app.reload()
    engine.hold.set()
    answer = await streaming
    assert answer.status == 200 and answer.text.endswith("data: [DONE]\n\n")
    assert gw.app.keeper.held() == 0
    assert all(held(u) == 0 for u in gw.app.tables.models["m"].upstreams)
    # The one-slot replica serves the next request at once: its slot came back.
    reload_to(gw, [endpoint(engine.url, "1", slots=1)])
    await gw.app.reload()
    gw.app.admission.timeouts = (0.5, 0.5)
    engine.hold = None
    assert (await gw.chat()).status == 200


async def test_a_request_retried_on_another_replica_across_a_reload_gives_both_slots_back(
    gw: Gateway, engine: MockEngine
) -> None:
    bad = endpoint(f"http://127.0.0.1:{closed_port()}", "bad", slots=1)
    good = endpoint(engine.url, "good", slots=1)
    gw.set_models(route("m", [bad, good]))
    gw.app.keeper.mark_failed(good, 0)  # both usable; the bad one is tried first for some prompts
    answers = await asyncio.gather(*(gw.chat(messages=[{"role": "user", "content": f"turn {i}"}]) for i in range(6)))
    assert all(a.status == 200 for a in answers)
    reload_to(gw, [endpoint(engine.url, "good", slots=1)])
    await gw.app.reload()
    assert gw.app.keeper.held() == 0


async def _one_request(gw: Gateway, rng: random.Random, index: int) -> str:
    """One request of a random kind; returns what it was, for the record."""
    kind = rng.choice(["chat", "stream", "stream-cancel", "error", "die", "whole-cancel", "messages"])
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": f"request {index}"}],
        "mock_chunks": rng.randint(1, 30),
    }
    path = "/v1/chat/completions"
    if kind == "error":
        body["mock"] = "error"
    elif kind == "die":
        body["mock"], body["stream"] = "die", True
    elif kind in ("stream", "stream-cancel"):
        body["stream"] = True
    elif kind == "messages":
        path = "/v1/messages"
        body = {"model": "m", "max_tokens": 5, "messages": HELLO, "stream": rng.random() < 0.5}
    elif kind == "whole-cancel":
        body["mock"] = "hang"
        body["stream"] = True
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        async with asyncio.timeout(WAIT * 4):
            async with gw.client.post(gw.url + path, data=json.dumps(body), headers=headers) as response:
                if kind in ("stream-cancel", "whole-cancel"):
                    await response.content.read(rng.randint(1, 200))
                    response.close()  # the client hangs up mid-way
                else:
                    await response.read()
    except (aiohttp.ClientError, TimeoutError):
        pass
    return kind


@pytest.mark.parametrize("seed", range(3))
async def test_real_requests_of_every_kind_under_reloads_leave_every_slot_given_back(
    gw: Gateway, engine: MockEngine, seed: int
) -> None:
    rng = random.Random(seed)
    gauge_before = in_flight_gauge()
    unreachable = f"http://127.0.0.1:{closed_port()}"

    def upstreams() -> list[Upstream]:
        chosen = [endpoint(engine.url, "1", slots=rng.randint(1, 3)), endpoint(engine.url, "2", slots=2)]
        if rng.random() < 0.5:
            chosen.append(endpoint(unreachable, "gone", slots=1))
        return [u for u in chosen if rng.random() < 0.85] or chosen[:1]

    gw.set_models(route("m", upstreams()))
    gw.app.admission.timeouts = (3, 3)

    async def reloads() -> None:
        while True:
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            reload_to(gw, upstreams())
            await gw.app.reload()

    reloading = asyncio.create_task(reloads())
    try:
        kinds = await asyncio.gather(*(_one_request(gw, rng, i) for i in range(60)))
    finally:
        reloading.cancel()
    reload_to(gw, [endpoint(engine.url, "1", slots=2)])
    await gw.app.reload()
    await until(lambda: gw.app.keeper.held() == 0)
    assert in_flight_gauge() == gauge_before
    await until(lambda: len(gw.usage.records) == len(kinds))
    statuses = {r["status"] for r in gw.usage.records}
    assert statuses <= {200, 400, 499, 502, 503}
    assert {200, 499} <= statuses  # answered ones and ones whose clients hung up, at least
