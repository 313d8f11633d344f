"""agent.messages against what the agent really sends.

mypy holds the code at both ends to these types; these tests hold the types to the agent. On
each captured host, the sample (and the registration's devices) has no key the types lack, at
any depth, holds every key they call required, and each value has the declared type. Every
key the types declare is sent by some captured host, or is one of the few named here with
the reason no host sends it: a declared key no agent sends is a misspelling the control plane
would read as unknown for ever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os
import time
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from agent import protocol
from agent.config import parse_config
from agent.messages import DesiredShardMessage, DrainingShardMessage, GpuFigures, GpuProcess, HeartbeatSample
from agent.mirror import MirrorSync
from agent.sampler import Sampler
from agent.supervisor import READY, Supervisor, _Entry
from tests.fleet import HOSTS, build_host, fixtures_available
from tests.ggufgen import make_tiny_gguf

# Keys no captured host sends, and why. Each must still be declared, and sent by some agent.
_IB = "the captured InfiniBand sysfs trees hold no LIDs, GUIDs, counters or RoCE addresses"
NOT_ON_CAPTURED_HOSTS = {
    ("HeartbeatSample", "inlet_temp_c"): "no captured hwmon tree names an inlet sensor",
    ("GpuFigures", "retired_pages_pending"): "page retirement: the captured cards remap rows instead",
    ("GpuFigures", "ecc_corrected"): "an AMD figure the captured MI300X outputs leave out",
    ("GpuFigures", "temperature_edge_c"): "an AMD figure the captured MI300X outputs leave out",
    ("GpuFigures", "fault"): "a device that cannot be trusted: its layout changed under the agent",
    **{("GpuProcess", key): "the captures list no process on a card" for key in typing.get_type_hints(GpuProcess)},
    ("IbPortFigures", "lid"): _IB,
    ("IbPortFigures", "sm_lid"): _IB,
    ("IbPortFigures", "node_guid"): _IB,
    ("IbPortFigures", "port_guid"): _IB,
    ("IbPortFigures", "netdev"): _IB,
    ("IbPortFigures", "network"): _IB,
    ("IbPortFigures", "roce_ip"): _IB,
    ("IbPortFigures", "roce_gid_index"): _IB,
    ("IbPortFigures", "xmit_bytes"): _IB,
    ("IbPortFigures", "rcv_bytes"): _IB,
    ("ImexState", "error"): "a tray without IMEX installed: every captured tray has it",
    ("StoragePoolFigures", "partial"): "a scan stopped at its bounds (test_sampler makes one)",
    ("ShardFigures", "engine"): "an engine's own figures: read from a running engine (test_engine_metrics)",
}


def _is_typeddict(tp: Any) -> bool:
    return isinstance(tp, type) and typing.is_typeddict(tp)


def _declared(tp: Any, found: dict[str, type] | None = None) -> dict[str, type]:
    """Every TypedDict reachable from `tp`, by name."""
    found = {} if found is None else found
    if _is_typeddict(tp):
        if tp.__name__ not in found:
            found[tp.__name__] = tp
            for hint in typing.get_type_hints(tp).values():
                _declared(hint, found)
    else:
        for arg in typing.get_args(tp):
            _declared(arg, found)
    return found


def _problems(value: Any, tp: Any, path: str, sent: set[tuple[str, str]]) -> list[str]:
    """What in `value` does not fit `tp`; each (TypedDict, key) met is added to `sent`."""
    if tp is Any:
        return []
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        fits = [option for option in options if not _problems(value, option, path, set())]
        if not fits:
            return [f"{path}: {value!r:.80} is none of {tp}"]
        return _problems(value, fits[0], path, sent)
    if _is_typeddict(tp):
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r:.80}"]
        hints = typing.get_type_hints(tp)
        out = [f"{path}.{key}: required by {tp.__name__} and missing" for key in tp.__required_keys__ - set(value)]
        for key, item in value.items():
            if key not in hints:
                out.append(f"{path}.{key}: sent, and not declared in {tp.__name__}")
                continue
            sent.add((tp.__name__, key))
            out += _problems(item, hints[key], f"{path}.{key}", sent)
        return out
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r:.80}"]
        (item_type,) = typing.get_args(tp)
        return [p for i, item in enumerate(value) for p in _problems(item, item_type, f"{path}[{i}]", sent)]
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r:.80}"]
        key_type, item_type = typing.get_args(tp)
        return [p for key, item in value.items() for p in _problems(item, item_type, f"{path}.{key}", sent)]
    if tp is type(None):
        return [] if value is None else [f"{path}: expected null, got {value!r:.80}"]
    # JSON's scalars: a whole number is a number too, but true is not one.
    allowed = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}[tp]
    if isinstance(value, bool) and tp is not bool or not isinstance(value, allowed):
        return [f"{path}: expected {tp.__name__}, got {value!r:.80}"]
    return []


def _later(stat: Path) -> None:
    """/proc/stat a moment later, each CPU 100 ticks busier and 100 idler: the second sample has a rate."""
    lines = []
    for line in stat.read_text().splitlines():
        if line.startswith("cpu"):
            name, user, *middle, idle = line.split()[:5]
            line = " ".join([name, str(int(user) + 100), *middle, str(int(idle) + 100), *line.split()[5:]])
        lines.append(line)
    stat.write_text("\n".join(lines) + "\n")


def _engine_usage(tmp_path: Path) -> list[Any]:
    """process_usage() of a supervisor that runs one engine: this test's own process group."""
    supervisor = Supervisor(tmp_path / "supervisor", {})
    supervisor._entries["r1s0"] = _Entry(
        shard="r1s0", spec=None, fingerprint="", state=READY, pid=os.getpid(), pgid=os.getpgid(0)
    )
    supervisor.process_usage()
    time.sleep(0.02)
    return list(supervisor.process_usage())  # the second call has a rate: cpu_cores


def _mirror_report(tmp_path: Path) -> list[Any]:
    mirror = MirrorSync(tmp_path / "mirror", [str(tmp_path / "models")], lambda url: (url, {}))
    mirror.states = {"7": ("held", ""), "8": ("fetching", "m.gguf")}
    mirror.dirs = {"7": str(tmp_path / "models" / "v7"), "8": str(tmp_path / "models" / "v8")}
    return list(mirror.report())


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], HeartbeatSample]]:
    """Per captured host: its registration's hardware and its second sample (the first has no rates),
    with the engines' figures and the mirror's report as agent.main adds them to a heartbeat."""
    if not fixtures_available():
        pytest.skip("no captured fixtures")
    out = {}
    for host in sorted(HOSTS):
        root = tmp_path_factory.mktemp(host.replace("-", "_"))
        models = root / "models"
        models.mkdir()
        make_tiny_gguf(models / "tiny.gguf")
        tools = build_host(HOSTS[host], root)
        config = {"server": "http://127.0.0.1:1", "state_dir": str(root / "state"), "root": str(root)}
        sampler = Sampler(parse_config({**config, "tools": tools, "model_dirs": [str(models)]}))
        hardware, _warnings = asyncio.run(sampler.hardware())
        asyncio.run(sampler.sample(force=True))
        _later(root / "proc" / "stat")
        sample = asyncio.run(sampler.sample(force=True)).copy()
        sample["shards"] = _engine_usage(root)
        sample["mirror"] = _mirror_report(root)
        protocol.parse_message(protocol.encode("heartbeat", {"sample": sample}), expect="agent")
        out[host] = (hardware, sample)
    return out


def test_every_key_a_captured_host_sends_is_declared_with_its_type(
    samples: dict[str, tuple[dict[str, Any], HeartbeatSample]],
) -> None:
    problems = []
    for host, (hardware, sample) in samples.items():
        problems += _problems(sample, HeartbeatSample, f"{host}: sample", set())
        problems += _problems(hardware["gpus"], list[GpuFigures], f"{host}: hardware.gpus", set())
    assert problems == []


def test_every_declared_key_is_sent_by_a_captured_host_or_said_why_not(
    samples: dict[str, tuple[dict[str, Any], HeartbeatSample]],
) -> None:
    sent: set[tuple[str, str]] = set()
    for hardware, sample in samples.values():
        _problems(sample, HeartbeatSample, "sample", sent)
        _problems(hardware["gpus"], list[GpuFigures], "hardware.gpus", sent)
    declared = {(name, key) for name, td in _declared(HeartbeatSample).items() for key in typing.get_type_hints(td)}
    assert set(NOT_ON_CAPTURED_HOSTS) <= declared, "a reason given for a key no type declares"
    unsent = sorted(declared - sent - set(NOT_ON_CAPTURED_HOSTS))
    assert not unsent, f"declared, and sent by no captured host: {unsent}"
    sent_after_all = sorted(set(NOT_ON_CAPTURED_HOSTS) & sent)
    assert not sent_after_all, f"sent after all, take them off NOT_ON_CAPTURED_HOSTS: {sent_after_all}"


def _fields(check: Any) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The (required, optional) fields of a protocol obj() check, through nullable() and array()."""
    names = inspect.getclosurevars(check).nonlocals
    if "required" in names:
        return names["required"], names["optional"]
    inner = names.get("inner")
    return _fields(inner) if callable(inner) else None


def _typeddict_in(hint: Any) -> Any:
    """The TypedDict a key's type holds (`X | None`, `list[X]`), None for a scalar's."""
    if _is_typeddict(hint):
        return hint
    for arg in typing.get_args(hint):
        found = _typeddict_in(arg)
        if found is not None:
            return found
    return None


def _against_protocol(td: Any, check: Any, path: str) -> list[str]:
    fields = _fields(check)
    assert fields is not None, path
    required, optional = fields
    hints = typing.get_type_hints(td)
    out = [
        f"{path}.{key}: checked by the protocol, not declared" for key in sorted({*required, *optional} - set(hints))
    ]
    if set(required) != set(td.__required_keys__):
        out.append(f"{path}: the protocol requires {sorted(required)}, {td.__name__} {sorted(td.__required_keys__)}")
    for key, inner in {**required, **optional}.items():
        nested = _typeddict_in(hints.get(key))
        if nested is not None:
            out += _against_protocol(nested, inner, f"{path}.{key}")
    return out


def test_the_types_declare_every_field_the_protocol_checks_and_require_what_it_requires() -> None:
    """The TypedDicts may name more (what the agent sends and no one checks: a process's type),
    never less, and a key is required in both or in neither."""
    assert _against_protocol(HeartbeatSample, protocol.SAMPLE, "sample") == []
    protocol.parse_message(protocol.encode("heartbeat", {"sample": {}}), expect="agent")  # nothing is required


def test_the_desired_shard_and_draining_shard_messages_are_their_dataclasses_fields() -> None:
    assert typing.get_type_hints(DesiredShardMessage).keys() == {
        f.name for f in dataclasses.fields(protocol.DesiredShard)
    }
    assert typing.get_type_hints(DrainingShardMessage).keys() == {
        f.name for f in dataclasses.fields(protocol.DrainingShard)
    }
    shard = protocol.parse_shard(
        {"shard": "r1s0", "model": "m", "engine": "llama.cpp", "source": "/m.gguf", "api_key": "k", "port": 9000}
    )
    assert _problems(shard.to_message(), DesiredShardMessage, "shard", set()) == []
    draining = protocol.DrainingShard(shard="r1s0", grace=30, left=12.5)
    assert _problems(draining.to_message(), DrainingShardMessage, "draining", set()) == []
