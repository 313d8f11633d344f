"""Bad input, each case as the reference treats it, reported in the batch's `errors` with line numbers.

OpenAI fails the whole batch at validation for a line that is not JSON, a custom_id used twice, a url
other than the batch's endpoint, a second model, an empty file and too many lines: so does llmgw. A
line with `stream: true` or a model the key may not use fails alone; the rest run.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from django.conf import settings

from apps.batches.models import BatchFile
from tests.batches.harness import World, chat_line, db, make_tenant


async def failed_batch(world: World, raw: bytes) -> Any:
    client = world.openai()
    uploaded = await world.upload([], raw=raw)
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return await world.ended(batch.id)


def lines_of(*lines: Any) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)


def errors_of(batch: Any) -> list[tuple[str | None, int | None]]:
    return [(e.code, e.line) for e in batch.errors.data]


async def test_a_line_that_is_not_json_fails_the_batch_naming_the_line(world: World) -> None:
    batch = await failed_batch(world, lines_of(chat_line("a"), b"{not json", chat_line("c")))
    assert batch.status == "failed" and batch.failed_at is not None
    assert errors_of(batch) == [("invalid_json_line", 2)]
    assert batch.errors.data[0].message == "This line is not parseable as valid JSON."
    assert world.engine.seen == []  # nothing ran


async def test_a_custom_id_used_twice_fails_the_batch(world: World) -> None:
    batch = await failed_batch(world, lines_of(chat_line("a"), chat_line("b"), chat_line("a")))
    assert batch.status == "failed" and errors_of(batch) == [("duplicate_custom_id", 3)]


async def test_a_url_other_than_the_endpoint_fails_the_batch(world: World) -> None:
    other = {**chat_line("b"), "url": "/v1/embeddings"}
    batch = await failed_batch(world, lines_of(chat_line("a"), other))
    assert batch.status == "failed" and errors_of(batch) == [("url_mismatch", 2)]
    assert "/v1/embeddings" in batch.errors.data[0].message


async def test_a_second_model_fails_the_batch(world: World) -> None:
    second = chat_line("b")
    second["body"]["model"] = "another"
    batch = await failed_batch(world, lines_of(chat_line("a"), second))
    assert batch.status == "failed" and errors_of(batch) == [("model_mismatch", 2)]


async def test_an_empty_file_fails_the_batch(world: World) -> None:
    batch = await failed_batch(world, b"\n\n")
    assert batch.status == "failed" and errors_of(batch) == [("empty_file", None)]


async def test_more_lines_than_a_batch_takes_fail_it(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings, "BATCH_MAX_LINES", 3)
    batch = await failed_batch(world, lines_of(*(chat_line(f"l{i}") for i in range(5))))
    assert batch.status == "failed" and errors_of(batch) == [("too_many_tasks", 4)]
    assert "more than 3 requests" in batch.errors.data[0].message


async def test_a_streaming_line_fails_alone_and_the_rest_run(world: World) -> None:
    client = world.openai()
    uploaded = await world.upload([chat_line("a"), chat_line("b", stream=True), chat_line("c")])
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await world.ended(batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert errors_of(done) == [("invalid_value", 2)] and done.errors.data[0].param == "body.stream"
    [error] = [json.loads(line) for line in (await client.files.content(done.error_file_id)).content.splitlines()]
    assert error["custom_id"] == "b" and error["response"]["status_code"] == 400
    assert "stream" in error["response"]["body"]["error"]["message"]
    assert len(world.engine.seen) == 2


async def test_a_model_the_key_may_not_use_fails_each_of_its_lines_alone(world: World) -> None:
    narrow = await db(make_tenant, "nora", allowed_models=["other"])
    client = world.openai(narrow)
    uploaded = await world.upload([chat_line("a"), chat_line("b")], narrow)
    batch = await client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = await world.ended(batch.id, narrow)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (0, 2)
    assert errors_of(done) == [("model_not_allowed", 1), ("model_not_allowed", 2)]
    errors = [json.loads(line) for line in (await client.files.content(done.error_file_id)).content.splitlines()]
    assert {e["response"]["status_code"] for e in errors} == {403}
    assert errors[0]["response"]["body"]["error"]["message"] == "This API key may not use the model “m”."
    assert world.engine.seen == []


async def test_a_file_over_the_size_limit_is_refused_with_the_numbers(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings, "BATCH_MAX_FILE_BYTES", 1000)
    with pytest.raises(openai.APIStatusError) as refused:
        await world.upload([], raw=b"x" * 5000)
    assert refused.value.status_code == 413
    assert "over the limit of 1000 bytes (LLMGW_BATCH_MAX_FILE_BYTES)" in refused.value.message
    assert await db(BatchFile.objects.count) == 0
    assert list((settings.BATCH_STORAGE_DIR / "tmp").iterdir()) == []  # nothing of it was kept


async def test_the_organisations_storage_limit_is_refused_with_the_numbers(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings, "BATCH_ORG_STORAGE_BYTES", 3000)
    await world.upload([], raw=b"y" * 2000)
    with pytest.raises(openai.APIStatusError) as refused:
        await world.upload([], raw=b"z" * 2000)
    assert refused.value.status_code == 413
    assert "over 1000 bytes, what this organisation's storage limit of 3000 bytes leaves" in refused.value.message
    await world.upload([], raw=b"w" * 900)  # what is left still fits
    with pytest.raises(openai.APIStatusError, match="over 100 bytes, what this organisation's storage limit"):
        await world.upload([], raw=b"v" * 200)
    await world.upload([], raw=b"t" * 100)
    with pytest.raises(openai.APIStatusError, match="hold 3000 bytes, and it may hold 3000"):
        await world.upload([], raw=b"s")
    # Another organisation's room is its own.
    await world.upload([], world.b, raw=b"u" * 2000)


async def test_a_file_of_another_organisation_is_not_found(world: World) -> None:
    theirs = await world.upload([chat_line("a")], world.b)
    with pytest.raises(openai.NotFoundError, match=f"No such File object: {theirs.id}"):
        await world.openai().batches.create(
            input_file_id=theirs.id, endpoint="/v1/chat/completions", completion_window="24h"
        )


async def test_an_endpoint_or_window_the_api_does_not_take_is_refused(world: World) -> None:
    client = world.openai()
    uploaded = await world.upload([chat_line("a")])
    with pytest.raises(openai.BadRequestError, match="/v1/moderations.*not supported.*/v1/chat/completions"):
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/moderations", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="'completion_window' must be 24h"):
        await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="at most 16 keys"):
        await client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={str(i): "v" for i in range(17)},
        )


async def test_an_upload_that_is_not_a_form_or_has_no_purpose_is_refused(world: World) -> None:
    headers = {"Authorization": f"Bearer {world.a.secret}"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{world.url}/v1/files", data=b"{}", headers=headers) as answer:
            assert answer.status == 400
            assert "multipart/form-data" in (await answer.json())["error"]["message"]
        form = aiohttp.FormData()
        form.add_field("purpose", "fine-tune")
        form.add_field("file", b"{}", filename="x.jsonl")
        async with session.post(f"{world.url}/v1/files", data=form, headers=headers) as answer:
            assert answer.status == 400
            assert "'purpose' must be one of batch, user_data" in (await answer.json())["error"]["message"]
        cut = b'--B\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nabc'
        multipart = {**headers, "Content-Type": "multipart/form-data; boundary=B"}
        async with session.post(f"{world.url}/v1/files", data=cut, headers=multipart) as answer:
            assert answer.status == 400 and "closing boundary" in (await answer.json())["error"]["message"]
        async with session.get(f"{world.url}/v1/files", headers={"Authorization": "Bearer nope"}) as answer:
            assert answer.status == 401
    assert await db(BatchFile.objects.count) == 0
