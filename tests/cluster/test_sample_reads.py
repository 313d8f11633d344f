"""What the control plane reads from a heartbeat's sample is what agent.messages declares.

mypy holds a sample's readers to HeartbeatSample where they index it or build one, but not where
they call .get("key"): it types an unknown key's value as `object` and says nothing. So the
readers are run here on a sample that records every key read from it, at every depth, and each
must be a key the types declare (tests/agent/test_message_types.py holds the types to what the
agent sends).
"""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest
from django.utils import timezone

from agent.messages import HeartbeatSample
from apps.cluster import history, inventory, reports, rollup, selectors
from apps.cluster.models import Node
from tests.builders import make_node

Read = tuple[str, str]  # (TypedDict, key)


class Recording(dict[str, Any]):
    """An object of a sample that notes each key read from it, under its TypedDict's name."""

    def __init__(self, data: dict[str, Any], name: str, reads: set[Read]) -> None:
        super().__init__(data)
        self.name, self.reads = name, reads

    def get(self, key: str, default: Any = None) -> Any:
        self.reads.add((self.name, key))
        return super().get(key, default)

    def __getitem__(self, key: str) -> Any:
        self.reads.add((self.name, key))
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.reads.add((self.name, str(key)))
        return super().__contains__(key)


def _value(tp: Any, reads: set[Read]) -> Any:
    """A value of type `tp` with every key it can hold, objects recording their reads."""
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return Recording({key: _value(hint, reads) for key, hint in hints.items()}, tp.__name__, reads)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _value(next(arg for arg in args if arg is not type(None)), reads)
    if origin is list:
        return [_value(args[0], reads)]
    if origin is dict:
        return {"0": _value(args[1], reads)}
    return {float: 1.5, int: 1, str: "/models/x", bool: True, Any: 1}[tp]


def _declared(tp: Any, found: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    found = {} if found is None else found
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        found[tp.__name__] = set(hints)
        for hint in hints.values():
            _declared(hint, found)
    else:
        for arg in typing.get_args(tp):
            _declared(arg, found)
    return found


def _undeclared(reads: set[Read]) -> list[Read]:
    declared = _declared(HeartbeatSample)
    return sorted((name, key) for name, key in reads if key not in declared[name])


def test_the_history_health_rollup_and_fetch_readers_read_declared_keys() -> None:
    reads: set[Read] = set()
    sample = _value(HeartbeatSample, reads)
    reports.sample_health(sample)
    history._history_point(sample)
    list(rollup._classes(sample))
    rollup._step(None, sample, 1.0, 1.0)
    inventory.fetch_states(sample)
    assert {("HeartbeatSample", "gpus"), ("GpuFigures", "utilization_gpu_pct"), ("MirrorState", "dir")} <= reads
    assert _undeclared(reads) == []


@pytest.mark.django_db
def test_the_node_pages_selectors_read_declared_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: set[Read] = set()
    sample = _value(HeartbeatSample, reads)
    node = make_node(gpus=2)
    monkeypatch.setattr(Node, "fresh_sample", lambda self, now=None, max_age=None: sample)
    detail = selectors.node_detail(node)
    for card in detail.gpus:  # what the page shows of each device
        for name, attribute in vars(selectors.GpuCard).items():
            if isinstance(attribute, property):
                getattr(card, name)
    selectors.node_row(node, timezone.now())  # the nodes' list
    assert {("HeartbeatSample", "storage"), ("GpuFigures", "temperature_gpu_c"), ("ShardFigures", "shard")} <= reads
    assert _undeclared(reads) == []


def test_a_misspelt_read_is_caught() -> None:
    reads: set[Read] = set()
    sample = _value(HeartbeatSample, reads)
    sample["gpus"][0].get("utilisation_gpu_pct")
    assert _undeclared(reads) == [("GpuFigures", "utilisation_gpu_pct")]
