"""Files and batches belong to the key's organisation and project: another organisation's key is told
they do not exist (404), for every operation, and lists only its own."""

from __future__ import annotations

import aiohttp
import anthropic
import openai
import pytest

from tests.batches.harness import World, chat_line


async def test_another_organisation_cannot_read_cancel_or_delete_the_firsts_files_and_batches(world: World) -> None:
    mine, theirs = world.openai(world.a), world.openai(world.b)
    uploaded = await world.upload([chat_line("a"), chat_line("b")])
    batch = await mine.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await world.ended(batch.id)
    assert done.status == "completed"

    for call in (
        lambda: theirs.files.retrieve(uploaded.id),
        lambda: theirs.files.content(uploaded.id),
        lambda: theirs.files.content(done.output_file_id),
        lambda: theirs.files.delete(uploaded.id),
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert [f.id async for f in theirs.files.list()] == []
    assert [b.id async for b in theirs.batches.list()] == []

    # Everything is still there for its owners.
    assert (await mine.files.retrieve(uploaded.id)).id == uploaded.id
    assert sorted([f.id async for f in mine.files.list()]) == sorted([uploaded.id, done.output_file_id])
    deleted = await mine.files.delete(uploaded.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        await mine.files.retrieve(uploaded.id)
    assert (await mine.batches.retrieve(batch.id)).input_file_id == uploaded.id  # as the API keeps it


async def test_another_organisation_cannot_reach_a_message_batch(world: World) -> None:
    mine, theirs = world.anthropic(world.a), world.anthropic(world.b)
    params = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    batch = await mine.messages.batches.create(requests=[{"custom_id": "one", "params": params}])
    ended = await world.message_batch_ended(batch.id)
    for call in (
        lambda: theirs.messages.batches.retrieve(batch.id),
        lambda: theirs.messages.batches.cancel(batch.id),
        lambda: theirs.messages.batches.delete(batch.id),
    ):
        with pytest.raises(anthropic.NotFoundError):
            await call()
    headers = {"x-api-key": world.b.secret}
    async with aiohttp.ClientSession() as session, session.get(ended.results_url, headers=headers) as answer:
        assert answer.status == 404 and (await answer.json())["error"]["type"] == "not_found_error"
    assert [b.id async for b in theirs.messages.batches.list()] == []
    assert [r.custom_id async for r in await mine.messages.batches.results(batch.id)] == ["one"]
    # An OpenAI key of the first organisation does not see it as an OpenAI batch either.
    with pytest.raises(openai.NotFoundError):
        await world.openai(world.a).batches.retrieve(batch.id)
