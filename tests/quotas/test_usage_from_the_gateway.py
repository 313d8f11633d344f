"""Requests through the real gateway, their usage records written as the writer does, and read back
through the usage API: client errors are counted, and names no model has are grouped under "-"."""

from __future__ import annotations

import asyncio
import types
import typing
from typing import Any

import pytest

from apps.quotas.models import UsageRecord
from apps.quotas.records import RECORD_KEYS, UsageRecordDict
from apps.quotas.usage import StoredRecord, write_records_sync
from tests.gateway.harness import HELLO, KEY, engine_fixture, entry, gateway_fixture
from tests.quotas.conftest import make_key


def through_the_gateway(
    key: Any, calls: list[dict[str, Any]], *, delete_model_midway: bool = False
) -> tuple[list[int], list[dict[str, Any]]]:
    """Send chat requests (bodies) through a gateway serving model "m" with Bob's key; the statuses
    and the usage records it emitted."""

    async def run() -> tuple[list[int], list[dict[str, Any]]]:
        with pytest.MonkeyPatch.context() as patch:
            engines = engine_fixture()
            engine = await anext(engines)
            gateways = gateway_fixture(engine, patch)
            gw = await anext(gateways)
            try:
                project = key.project
                gw.set_key(
                    KEY,
                    entry(
                        key_id=key.pk,
                        user_id=key.user_id,
                        project_id=project.pk,
                        team_id=project.team_id,
                        org_id=project.team.organization_id,
                    ),
                )
                statuses = []
                for body in calls:
                    if delete_model_midway:
                        engine.gate = asyncio.Event()
                        engine.arrived.clear()
                        sent = asyncio.create_task(gw.post("/v1/chat/completions", body))
                        await engine.arrived.wait()
                        gw.set_models()  # the model is deleted while the engine has the request
                        engine.gate.set()
                        statuses.append((await sent).status)
                    else:
                        statuses.append((await gw.post("/v1/chat/completions", body)).status)
                await gw.usage.wait(len(calls))
                return statuses, list(gw.usage.records)
            finally:
                await gateways.aclose()
                await engines.aclose()

    return asyncio.run(run())


def usage_by_model(api: Any, user: Any) -> dict[str, dict[str, Any]]:
    api.force_authenticate(user)
    response = api.get("/api/v1/usage", {"group_by": "model"})
    assert response.status_code == 200, response.content
    return {row["group"]: row for row in response.json()["results"]}


@pytest.mark.django_db
def test_made_up_model_names_are_grouped_under_a_dash_as_client_errors(api, bob, tree) -> None:
    key = make_key(bob, tree.project)
    statuses, records = through_the_gateway(
        key,
        [
            {"model": "m", "messages": HELLO},
            {"model": "gpt-4", "messages": HELLO},
            {"model": "gpt-4o-mini", "messages": HELLO},
            {"model": "m", "messages": HELLO, "mock": "error"},  # the engine answers 400
            {"messages": HELLO},  # no model named
        ],
    )
    assert statuses == [200, 404, 404, 400, 400]
    assert [r["model"] for r in records] == ["m", "-", "-", "m", "-"]
    assert write_records_sync(records) == 5

    rows = usage_by_model(api, bob)
    assert set(rows) == {"m", "-"}
    made_up = rows["-"]
    assert made_up["label"] == "(no such model)"
    assert (
        made_up["requests"],
        made_up["client_errors"],
        made_up["server_errors"],
        made_up["errors"],
        made_up["refusals"],
    ) == (3, 3, 0, 0, 0)
    assert made_up["latency_ms_p50"] is not None  # a refusal of the gateway's is timed, a limit's is not
    served = rows["m"]
    assert (served["requests"], served["client_errors"], served["server_errors"]) == (2, 1, 0)


@pytest.mark.django_db
def test_a_request_an_engine_took_keeps_its_models_name_when_the_model_goes_meanwhile(api, bob, tree) -> None:
    key = make_key(bob, tree.project)
    statuses, records = through_the_gateway(key, [{"model": "m", "messages": HELLO}], delete_model_midway=True)
    assert statuses == [200]
    assert records[0]["model"] == "m"
    write_records_sync(records)
    assert usage_by_model(api, bob)["m"]["requests"] == 1


def _is_a(value: object, declared: object) -> bool:
    """Whether `value` fits a declared field type (unions of plain classes and of list[...])."""
    options = typing.get_args(declared) if isinstance(declared, types.UnionType) else (declared,)
    return any(isinstance(value, typing.get_origin(option) or option) for option in options)


@pytest.mark.django_db
def test_the_record_the_gateway_writes_has_every_declared_key_and_no_other(bob, tree) -> None:
    """A misspelt key in the gateway would be written nowhere (and shown as "-"): the record a real
    request makes carries exactly UsageRecordDict's keys, each of its declared type, and every one
    is a column of the row it becomes."""
    key = make_key(bob, tree.project)
    statuses, records = through_the_gateway(key, [{"model": "m", "messages": HELLO}])
    assert statuses == [200]
    [record] = records
    assert set(record) == set(RECORD_KEYS)
    declared = typing.get_type_hints(UsageRecordDict)
    wrong = {name: value for name, value in record.items() if not _is_a(value, declared[name])}
    assert wrong == {}, f"values not of their declared types: {wrong}"
    assert set(StoredRecord.__annotations__) == set(RECORD_KEYS)
    columns = {f.attname for f in UsageRecord._meta.concrete_fields}
    assert set(RECORD_KEYS) <= columns, f"declared but not stored: {set(RECORD_KEYS) - columns}"

    assert write_records_sync(records) == 1
    row = UsageRecord.objects.get(request_id=record["request_id"])
    assert (row.model, row.api_key_id, row.project_id, row.status, row.stream) == (
        "m",
        key.pk,
        tree.project.pk,
        200,
        record["stream"],
    )
