"""The agent protocol bounds every whole number the server keeps in a column exactly as the column
does, so a figure past the column is refused when the message is read, naming its field, instead
of failing the database write (PostgreSQL: "integer out of range") after the message passed.

The integer columns of the apps that keep what agents send are walked: each is either filled from
a message field listed in FED (and then held to its bounds here) or listed in NOT_FED with where
its values come from, so a new column is a conscious decision."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.apps import apps
from django.db import models

from agent import protocol
from llmgw.ids import column_range

Message = Callable[[Any], dict[str, Any]]


def registered_gpu(field: str) -> Message:
    return lambda value: {
        "v": 1,
        "type": "register",
        "agent_version": "0.1.0",
        "hardware": {"gpus": [{"index": 0, field: value}]},
    }


def sampled_gpu(field: str) -> Message:
    return lambda value: {"v": 1, "type": "heartbeat", "sample": {"gpus": [{"index": 0, field: value}]}}


def reported_shard(field: str) -> Message:
    return lambda value: {"v": 1, "type": "report", "shards": [{"shard": "r1s0", "state": "running", field: value}]}


# column ("app.model.field") -> each message field that fills it: (message with the value there, its path)
FED: dict[str, list[tuple[Message, str]]] = {
    "cluster.gpu.index": [
        (registered_gpu("index"), "register.hardware.gpus[0].index"),
        (sampled_gpu("index"), "heartbeat.sample.gpus[0].index"),
    ],
    "cluster.gpu.parent_index": [
        (registered_gpu("parent"), "register.hardware.gpus[0].parent"),
    ],
    "cluster.gpu.memory_total_mib": [
        (registered_gpu("memory_total_mib"), "register.hardware.gpus[0].memory_total_mib"),
    ],
    "cluster.gpu.foreign_processes": [
        (registered_gpu("foreign_processes"), "register.hardware.gpus[0].foreign_processes"),
        (sampled_gpu("foreign_processes"), "heartbeat.sample.gpus[0].foreign_processes"),
    ],
    "cluster.shard.pid": [(reported_shard("pid"), "report.shards[0].pid")],
    "cluster.shard.exit_code": [(reported_shard("exit_code"), "report.shards[0].exit_code")],
    "cluster.shard.context_tokens": [(reported_shard("context_tokens"), "report.shards[0].context_tokens")],
}

# column -> where its values come from, if not from an agent's message
NOT_FED = {
    "cluster.node.drain_grace": "the console's and the API's drain form",
    "cluster.node.desired_version": "counted by the server",
    "cluster.replica.failures": "counted by the reconciler",
    "cluster.replica.drain_grace": "the server's drain grace, or the node's drain form, when it is stopped",
    "cluster.shard.rank": "placement",
    "cluster.shard.memory_bytes": "placement's claim",
    "cluster.shard.port": "placement",
    "cluster.shard.memory_used_bytes": "not written: the page reads the engine's use from the node's sample",
    "cluster.agentrequest.timeout_s": "the server's request",
    "fabrics.nodefabrics.changes": "counted by the server",
    "fabrics.fabrictest.duration_s": "the operator's test request",
    "facility.budget.watts": "the operator's budget",
}
AGENT_APPS = ("cluster", "fabrics", "facility")


def integer_columns() -> list[str]:
    found = []
    for model in apps.get_models():
        if model._meta.app_label not in AGENT_APPS:
            continue
        for field in model._meta.concrete_fields:
            if field.primary_key or field.is_relation:
                continue
            try:
                column_range(field)
            except KeyError:
                continue  # not an integer
            found.append(f"{model._meta.label_lower}.{field.name}")
    return found


def column(name: str) -> models.Field[Any, Any]:
    label, field = name.rsplit(".", 1)
    return apps.get_model(label)._meta.get_field(field)  # type: ignore[return-value]


def test_every_integer_column_of_the_apps_agents_feed_is_accounted_for() -> None:
    columns = integer_columns()
    assert "cluster.gpu.index" in columns  # it really walked
    assert sorted(c for c in columns if c not in FED and c not in NOT_FED) == []
    assert sorted(c for c in [*FED, *NOT_FED] if c not in columns) == []  # nothing listed that went away


@pytest.mark.parametrize(("name", "message", "path"), [(n, m, p) for n, fed in FED.items() for m, p in fed])
def test_the_protocol_bounds_each_fed_column_as_the_column_does(name: str, message: Message, path: str) -> None:
    low, high = column_range(column(name))
    for fits in (low, high):
        protocol.parse_message(json.dumps(message(fits)), expect="agent")
    for past in (low - 1, high + 1):
        with pytest.raises(protocol.ProtocolError) as refused:
            protocol.parse_message(json.dumps(message(past)), expect="agent")
        assert refused.value.code == "invalid"
        assert refused.value.message == f"{path}: expected a whole number from {low} to {high}, got {past}"
