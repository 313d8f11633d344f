"""Stored Responses API answers, as the OpenAI SDK and the OpenAI Agents SDK use them.

The gateway (tests/gateway/harness.py) stores into the test's database: two organisations, Acme
(Ann and Bea) and Globex (Cai), each person with a key of a project of theirs, and Dan with a key of
no project. The mock engine answers; with `tools_then_text` it calls a tool first, as a model does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection

from apps.accounts.models import Organization, Project, Team, User
from apps.gateway.tables import KeyEntry
from tests.conftest import make_user
from tests.gateway.harness import Gateway, entry, gateway_fixture, openai
from tests.gateway.mock_engine import MockEngine

pytestmark = pytest.mark.django_db(transaction=True)

ANN, BEA, CAI, DAN = "llmgw_ann_key", "llmgw_bea_key", "llmgw_cai_key", "llmgw_dan_key"


@dataclass
class People:
    keys: dict[str, KeyEntry]


def _member(email: str, org: Organization | None, key_id: int) -> KeyEntry:
    user: User = make_user(email)
    if org is None:
        return entry(key_id, user_id=user.pk, org_id=None, team_id=None, project_id=None)
    team = Team.objects.get_or_create(organization=org, slug="core", defaults={"name": "Core"})[0]
    project = Project.objects.get_or_create(team=team, slug="app", defaults={"name": "App"})[0]
    return entry(key_id, user_id=user.pk, org_id=org.pk, team_id=team.pk, project_id=project.pk)


@pytest.fixture
def people(transactional_db: Any) -> People:
    acme = Organization.objects.create(name="Acme", slug="acme")
    globex = Organization.objects.create(name="Globex", slug="globex")
    return People(
        {
            ANN: _member("ann@acme.example", acme, 1),
            BEA: _member("bea@acme.example", acme, 2),
            CAI: _member("cai@globex.example", globex, 3),
            DAN: _member("dan@example.com", None, 4),
        }
    )


@pytest.fixture
async def gw(engine: MockEngine, people: People, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    async for gateway in gateway_fixture(engine, monkeypatch, store=True, key=people.keys[ANN]):
        for raw, key in people.keys.items():
            gateway.set_key(raw, key)
        yield gateway


def client(gw: Gateway, key: str = ANN) -> Any:
    return gw.openai(key)


def tools_then_text(body: dict[str, Any]) -> dict[str, Any]:
    """A model's turn: the weather tool first, then an answer made of what it gave."""
    last = body["messages"][-1]
    if last["role"] == "tool":
        return {"content": f"It is {json.loads(last['content'])['sky']} in Paris."}
    call = {"id": "call_w1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    return {"content": None, "tool_calls": [call]}


# Stored, fetched, listed, deleted ----------------------------------------------------------------------


async def test_a_response_is_stored_by_default_and_can_be_fetched(gw: Gateway, engine: MockEngine) -> None:
    made = await client(gw).responses.create(model="m", input="Hello")
    assert made.store is True
    fetched = await client(gw).responses.retrieve(made.id)
    assert fetched.id == made.id and fetched.output_text == made.output_text == "Hello there"
    assert fetched.status == "completed" and fetched.usage.input_tokens == made.usage.input_tokens
    items = await client(gw).responses.input_items.list(made.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Hello")]
    assert items.data[0].id


async def test_a_streamed_response_is_stored_before_its_last_event(gw: Gateway) -> None:
    stream = await client(gw).responses.create(model="m", input="Hello", stream=True)
    done = [event async for event in stream if event.type == "response.completed"]
    made = done[0].response
    assert made.store is True
    fetched = await client(gw).responses.retrieve(made.id)
    assert fetched.output_text == made.output_text == "t0 t1 t2 "


async def test_store_false_keeps_nothing(gw: Gateway) -> None:
    made = await client(gw).responses.create(model="m", input="Hello", store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        await client(gw).responses.retrieve(made.id)
    assert f"No response with id '{made.id}' found" in caught.value.message


async def test_a_deleted_response_is_gone_and_cannot_be_continued(gw: Gateway) -> None:
    made = await client(gw).responses.create(model="m", input="Hello")
    await client(gw).responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        await client(gw).responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        await client(gw).responses.delete(made.id)
    with pytest.raises(openai.BadRequestError) as caught:
        await client(gw).responses.create(model="m", input="More", previous_response_id=made.id)
    assert caught.value.param == "previous_response_id" and caught.value.code == "previous_response_not_found"


async def test_a_response_cannot_be_cancelled_since_none_runs_in_the_background(gw: Gateway) -> None:
    made = await client(gw).responses.create(model="m", input="Hello")
    with pytest.raises(openai.BadRequestError) as caught:
        await client(gw).responses.cancel(made.id)
    assert "background=true" in caught.value.message
    with pytest.raises(openai.NotFoundError):
        await client(gw).responses.cancel("resp_nothing")


async def test_input_items_come_a_page_at_a_time(gw: Gateway) -> None:
    said = [{"role": "user", "content": f"line {n}"} for n in range(5)]
    made = await client(gw).responses.create(model="m", input=said)
    first = await client(gw).responses.input_items.list(made.id, limit=2, order="asc")
    assert [i.content[0].text for i in first.data] == ["line 0", "line 1"] and first.has_more
    every = [item.content[0].text async for item in client(gw).responses.input_items.list(made.id, limit=2)]
    assert every == [f"line {n}" for n in (4, 3, 2, 1, 0)]  # newest first by default, through every page
    bad = await gw.get(f"/v1/responses/{made.id}/input_items?limit=500", key=ANN)
    assert bad.status == 400 and bad.json["error"]["param"] == "limit"


# Continued conversations ----------------------------------------------------------------------------------


async def test_previous_response_id_replays_the_conversation_before_the_new_input(
    gw: Gateway, engine: MockEngine
) -> None:
    first = await client(gw).responses.create(model="m", input="Hello", instructions="Be brief.")
    second = await client(gw).responses.create(model="m", input="Again?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert engine.seen[1].body["messages"] == [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello there"},
        {"role": "user", "content": "Again?"},
    ]  # the first request's instructions are not carried over, as the API reference says
    third = await client(gw).responses.create(model="m", input="Once more", previous_response_id=second.id)
    assert [m["content"] for m in engine.seen[2].body["messages"]] == [
        "Hello",
        "Hello there",
        "Again?",
        "Hello there",
        "Once more",
    ]
    items = await client(gw).responses.input_items.list(third.id)
    assert [i.content[0].text for i in items.data] == ["Once more"]  # what that request itself sent


async def test_a_conversation_too_large_to_replay_is_refused_with_its_size(gw: Gateway, engine: MockEngine) -> None:
    first = await client(gw).responses.create(model="m", input="x" * 3000)
    gw.app.responses.most_bytes = 2000
    with pytest.raises(openai.BadRequestError) as caught:
        await client(gw).responses.create(model="m", input="more", previous_response_id=first.id)
    assert "more than the 2000 a request may send" in caught.value.message
    assert len(engine.seen) == 1


async def test_a_fault_in_a_continued_requests_own_input_is_named_by_its_own_index(gw: Gateway) -> None:
    first = await client(gw).responses.create(model="m", input=[{"role": "user", "content": "a"}] * 3)
    with pytest.raises(openai.BadRequestError) as caught:
        await client(gw).responses.create(
            model="m", input=[{"role": "tool", "content": "x"}], previous_response_id=first.id
        )
    assert caught.value.param == "input[0].role"


# Organisations --------------------------------------------------------------------------------------------


async def test_another_organisations_key_cannot_reach_a_stored_response(gw: Gateway, engine: MockEngine) -> None:
    made = await client(gw, ANN).responses.create(model="m", input="Acme's secret plan")
    for reach in (
        client(gw, CAI).responses.retrieve(made.id),
        client(gw, CAI).responses.delete(made.id),
        client(gw, CAI).responses.cancel(made.id),
        client(gw, CAI).responses.input_items.list(made.id),
        client(gw, DAN).responses.retrieve(made.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await reach
    with pytest.raises(openai.BadRequestError):
        await client(gw, CAI).responses.create(model="m", input="tell me", previous_response_id=made.id)
    assert len(engine.seen) == 1  # Globex's continuation never reached the engine with Acme's words
    # Acme's other member reaches it; it is still there after Globex's attempt to delete it.
    assert (await client(gw, BEA).responses.retrieve(made.id)).output_text == "Hello there"


async def test_a_key_without_a_project_reaches_only_its_users_responses(gw: Gateway) -> None:
    made = await client(gw, DAN).responses.create(model="m", input="mine")
    assert (await client(gw, DAN).responses.retrieve(made.id)).id == made.id
    with pytest.raises(openai.NotFoundError):
        await client(gw, ANN).responses.retrieve(made.id)


# Retention and the switch ---------------------------------------------------------------------------------


async def db[T](func: Callable[[], T]) -> T:
    """func against the test's database, in a thread whose connection is closed after."""

    def run() -> T:
        try:
            return func()
        finally:
            connection.close()

    return await sync_to_async(run, thread_sensitive=False)()


async def test_an_expired_response_is_not_found_and_the_beat_task_removes_it(gw: Gateway) -> None:
    from django.conf import settings
    from django.utils import timezone

    from apps.gateway.models import StoredResponse
    from apps.gateway.tasks import delete_expired_responses

    made = await client(gw).responses.create(model="m", input="Hello")
    kept = await client(gw).responses.create(model="m", input="Hello")
    row = await db(lambda: StoredResponse.objects.get(pk=made.id))
    assert timedelta(days=29) < row.expires_at - timezone.now() <= timedelta(days=30)  # the default retention
    past = timezone.now() - timedelta(seconds=1)
    await db(lambda: StoredResponse.objects.filter(pk=made.id).update(expires_at=past))
    with pytest.raises(openai.NotFoundError):
        await client(gw).responses.retrieve(made.id)
    assert await db(delete_expired_responses) == 1
    left = await db(lambda: set(StoredResponse.objects.values_list("pk", flat=True)))
    assert left == {kept.id}
    schedule = settings.CELERY_BEAT_SCHEDULE["delete-expired-responses"]
    assert schedule["task"] == "apps.gateway.tasks.delete_expired_responses"


async def test_with_the_store_off_nothing_is_kept_and_the_refusals_say_so(gw: Gateway) -> None:
    from apps.gateway.models import StoredResponse

    gw.app.responses.enabled = False
    made = await client(gw).responses.create(model="m", input="Hello")
    assert made.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        await client(gw).responses.retrieve(made.id)
    assert "LLMGW_RESPONSES_STORE=off" in missing.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        await client(gw).responses.create(model="m", input="more", previous_response_id=made.id)
    assert "LLMGW_RESPONSES_STORE=off" in refused.value.message
    assert await db(StoredResponse.objects.count) == 0


# The OpenAI Agents SDK --------------------------------------------------------------------------------------


def _agent(engine: MockEngine) -> Any:
    agents = pytest.importorskip(
        "agents",
        reason="openai-agents is not installed (pip install openai-agents; it is not in the dev extra, "
        "since it asks for websockets<17 and the lock holds 17.4)",
    )
    engine.answer = tools_then_text

    @agents.function_tool
    def weather(city: str) -> str:
        """The sky over a city."""
        return json.dumps({"city": city, "sky": "sunny"})

    agents.set_tracing_disabled(True)  # its traces would go to api.openai.com
    return agents, agents.Agent(name="forecaster", instructions="Answer about the weather.", tools=[weather])


async def _model(agents: Any, gw: Gateway) -> Any:
    return agents.OpenAIResponsesModel(model="m", openai_client=client(gw))


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_agents_sdk_chains_turns_and_tool_calls_by_previous_response_id(
    gw: Gateway, engine: MockEngine, streamed: bool
) -> None:
    agents, agent = _agent(engine)
    agent.model = await _model(agents, gw)

    async def run(question: str, previous: str | None) -> Any:
        if not streamed:
            return await agents.Runner.run(
                agent, question, previous_response_id=previous, auto_previous_response_id=True
            )
        result = agents.Runner.run_streamed(
            agent, question, previous_response_id=previous, auto_previous_response_id=True
        )
        async for _event in result.stream_events():
            pass
        return result

    from apps.gateway.models import StoredResponse

    first = await run("What is the weather in Paris?", None)
    assert first.final_output == "It is sunny in Paris."
    # The SDK sent the tool's output alone, naming the response with the call: the gateway replayed it.
    asked, answered = (r.response_id for r in first.raw_responses)
    row = await db(lambda: StoredResponse.objects.get(pk=answered))
    assert row.previous == asked
    assert [item["type"] for item in row.input_items] == ["function_call_output"]
    sent_back = engine.seen[1].body["messages"]
    assert [m["role"] for m in sent_back] == ["system", "user", "assistant", "tool"]
    assert sent_back[2]["tool_calls"][0]["function"]["name"] == "weather"
    assert sent_back[3]["tool_call_id"] == sent_back[2]["tool_calls"][0]["id"]
    second = await run("And tomorrow?", first.last_response_id)
    assert second.final_output == "It is sunny in Paris."
    roles = [m["role"] for m in engine.seen[2].body["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert engine.seen[2].body["messages"][-1]["content"] == "And tomorrow?"
