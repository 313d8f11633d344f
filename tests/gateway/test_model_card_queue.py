"""A model's card shows, while the model is contended, who holds its slots and who waits, by
organisation, team, project and key, with their shares: from this process's gateway without Redis,
and from Redis (every gateway process's leases and tickets) with it."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.test import Client

from apps.accounts import services
from apps.accounts.models import ApiKey, Organization, Project, Team, User
from apps.gateway import asgi
from apps.gateway.fairness import BATCH, INTERACTIVE, Who
from apps.gateway.intake import CHAT, Call
from apps.gateway.slots import Lease, SharedSlots
from apps.gateway.tables import KeyEntry, load_tables
from tests.builders import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

REDIS_URL = os.environ.get("LLMGW_REDIS_URL", "")


@dataclass
class People:
    """Acme (weight 3) > Research > Search holds Bob's two keys; Globex (weight 1) > Ops > Deploy
    holds Carol's."""

    bob: ApiKey
    bob2: ApiKey
    carol: ApiKey


def branch(org: str, weight: int, team: str, project: str) -> Project:
    organization = Organization.objects.create(name=org, slug=org.lower(), weight=weight)
    return Project.objects.create(
        team=Team.objects.create(organization=organization, name=team, slug=team.lower()), name=project
    )


@pytest.fixture
def people(bob: User, charlie: User) -> People:
    search = branch("Acme", 3, "Research", "Search")
    deploy = branch("Globex", 1, "Ops", "Deploy")

    def key(user: User, name: str, project: Project) -> ApiKey:
        return services.create_api_key(user, name=name, project=project, actor=user).key

    return People(key(bob, "crawler", search), key(bob, "indexer", search), key(charlie, "deployer", deploy))


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch, people: People) -> Iterator[asgi.GatewayApp]:
    """This process's gateway, fresh, with its tables read from the database: model "m" has one
    ready replica of two slots."""
    make_replica(make_model("m", memory_gb=1, cores=1, parallel=2), make_node("cpu-01"))
    app = asgi.GatewayApp()
    monkeypatch.setattr(asgi, "gateway_app", app)
    app.tables = load_tables()
    app.keeper.bind(app.tables)
    yield app


def entry(app: asgi.GatewayApp, key: ApiKey) -> KeyEntry:
    return app.tables.keys[key.key_hash]


def who(app: asgi.GatewayApp, key: ApiKey) -> Who:
    found = entry(app, key)
    return Who(found.org_id or 0, found.team_id or 0, found.project_id or 0, found.key_id, found.weights)


def take_a_slot(app: asgi.GatewayApp, key: ApiKey) -> Lease:
    """A request of `key` through the admission stage, which gives it a free slot at once."""
    call = Call(CHAT)
    call.entry = entry(app, key)
    call.model = "m"
    call.body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 50}
    lease = asyncio.run(app.admission.acquire(call, app.tables.models["m"], None))
    assert lease is not None and lease.who == who(app, key).token()
    return lease


def rows(html: str) -> dict[str, dict[str, str]]:
    """{name: {column: text}} of the card's table of who holds and waits."""
    table = html[html.index("data-queue-table") :]
    found = {}
    for name, body in re.findall(r'<tr data-share-row="\w+" data-name="([^"]*)">(.*?)</tr>', table, re.S):
        cells = dict(re.findall(r'<td data-col="(\w+)">(.*?)</td>', body, re.S))
        found[name] = {column: text.strip() for column, text in cells.items()}
    return found


def card(user: User) -> str:
    client = Client()
    client.force_login(user)
    return client.get("/models/m/").content.decode()


def test_the_card_shows_holders_and_waiters_with_their_shares(
    alice: User, people: People, gateway: asgi.GatewayApp, settings: Any
) -> None:
    settings.REDIS_URL = ""
    assert 'data-queue="idle"' in card(alice)  # nobody waits: no table
    leases = [take_a_slot(gateway, people.bob) for _ in range(2)]  # both slots, Acme's
    queue = gateway.admission.queue
    tickets = [
        queue.enter("m", who(gateway, people.carol), INTERACTIVE, 100.0)[0],
        queue.enter("m", who(gateway, people.carol), BATCH, 100.0)[0],
        queue.enter("m", who(gateway, people.bob2), INTERACTIVE, 100.0)[0],
    ]
    html = card(alice)
    assert 'data-queue="contended"' in html
    shown = rows(html)
    # Acme weighs 3 against Globex's 1, both with requests waiting: 75 % and 25 % of the next slots.
    assert shown["Acme"] == {"weight": "3", "share": "75.0 %", "holding": "2", "waiting": "1"}
    assert shown["Globex"] == {"weight": "1", "share": "25.0 %", "holding": "0", "waiting": "2 (1)"}
    assert shown["Research"]["share"] == shown["Search"]["share"] == "75.0 %"
    # Bob's first key holds both slots and waits for none: no share of the next ones.
    assert shown[f"crawler ({people.bob.prefix}…)"] == {"weight": "1", "share": "-", "holding": "2", "waiting": "0"}
    assert shown[f"indexer ({people.bob2.prefix}…)"]["share"] == "75.0 %"
    assert shown[f"deployer ({people.carol.prefix}…)"]["share"] == "25.0 %"
    assert list(shown)[:4] == ["Acme", "Research", "Search", f"crawler ({people.bob.prefix}…)"]  # as a tree
    # The replicas' refresh brings it too.
    client = Client()
    client.force_login(alice)
    fragment = client.get("/models/m/", HTTP_HX_REQUEST="true").content.decode()
    assert "data-queue-table" in fragment
    for ticket in tickets:
        queue.leave("m", ticket)
    for lease in leases:
        gateway.keeper.release(lease)
    assert 'data-queue="idle"' in card(alice)


def test_without_a_gateway_here_or_redis_the_card_says_it_does_not_know(
    alice: User, people: People, gateway: asgi.GatewayApp, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    settings.REDIS_URL = ""
    monkeypatch.delitem(sys.modules, "apps.gateway.asgi")
    html = card(alice)
    assert 'data-queue="unknown"' in html and "data-queue-table" not in html


@pytest.mark.skipif(not REDIS_URL, reason="the shared queue is in Redis; this run has none")
def test_with_redis_the_card_reads_every_processs_leases_and_tickets(
    alice: User, people: People, gateway: asgi.GatewayApp, settings: Any
) -> None:
    from apps.quotas.resp import RedisClient

    settings.REDIS_URL = REDIS_URL
    settings.REDIS_PREFIX = f"llmgw-test-{uuid.uuid4().hex[:8]}"
    route = gateway.tables.models["m"]

    async def another_process() -> None:
        """A gateway process of its own takes both slots for Bob and queues Carol's and Bob's second key's."""
        shared = SharedSlots(RedisClient(REDIS_URL, timeout=2.0), prefix=settings.REDIS_PREFIX)
        for _ in range(2):
            index, _token = await shared.acquire(route.upstreams, 0, "m", who=who(gateway, people.bob).token())
            assert index == 0
        for key, band in ((people.carol, INTERACTIVE), (people.carol, BATCH), (people.bob2, INTERACTIVE)):
            await shared.enter("m", who(gateway, key).token(), band, key.pk, 100.0, 10)

    asyncio.run(another_process())
    shown = rows(card(alice))
    assert shown["Acme"] == {"weight": "3", "share": "75.0 %", "holding": "2", "waiting": "1"}
    assert shown["Globex"] == {"weight": "1", "share": "25.0 %", "holding": "0", "waiting": "2 (1)"}
    assert shown[f"crawler ({people.bob.prefix}…)"]["holding"] == "2"
