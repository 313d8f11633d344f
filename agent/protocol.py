"""Messages between the control plane and node agents (no Django import; Python 3.11+).

Every message is one JSON object on the websocket:

    {"v": 1, "type": "<type>", "id": "<optional correlation id>", ...fields}

Agent to server:
    register    hardware, agent version, features (requests it can answer), labels
    heartbeat   a sample of what the node measures now
    fabrics     the InfiniBand/RoCE ports it can carry traffic on, when that changed
    report      the state of each shard the agent runs (used by the models issue)
    response    the answer to a server request (used later)
    error       a message the agent could not use

Server to agent:
    registered  the node's name and the heartbeat interval to use
    desired     the whole list of shards the node should run, and the shards being stopped whose
                engines run on for the requests in flight ("draining")
    request     a question only the node can answer (used later)
    error       a message the server could not use

Both sides validate with `parse_message()`; a bad message raises ProtocolError, whose
code and text go back to the sender in an "error" message. Neither side ever dies of one.

What JSON allows but nothing downstream can store is refused here, before it reaches a
database or a batch it could spoil: NaN and Infinity (Python's reader takes them, PostgreSQL's
jsonb does not), numbers that overflow to infinity, whole numbers beyond 64 bits, NUL
characters in strings (no PostgreSQL text can hold one), and nesting deeper than MAX_DEPTH.

What a checked heartbeat sample and "desired" message hold, for the type checker at both ends,
is agent.messages (HeartbeatSample, DesiredMessage; re-exported here).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from agent.messages import DesiredMessage, DesiredShardMessage, DrainingShardMessage, GpuFigures, HeartbeatSample
from agent.probes.mig import SLICE_BASE

__all__ = [
    "ENGINES",
    "MAX_MESSAGE_BYTES",
    "DesiredMessage",
    "DesiredShard",
    "DesiredShardMessage",
    "DrainingShard",
    "DrainingShardMessage",
    "GpuFigures",
    "HeartbeatSample",
    "PROTOCOL_VERSION",
    "RESULTS",
    "ProtocolError",
    "encode",
    "error_message",
    "parse_message",
    "parse_draining",
    "parse_shard",
    "read_result",
]

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1024 * 1024
MAX_DEPTH = 32  # no message nests deeper; 2,000 levels made the reader recurse until it failed
INT64 = 2**63
AGENT_TO_SERVER = frozenset({"register", "heartbeat", "fabrics", "report", "response", "error"})
SERVER_TO_AGENT = frozenset({"registered", "desired", "request", "error", "replaced"})

# Close codes the server uses (4000-4999 are for applications).
CLOSE_BAD_CREDENTIAL = 4401
CLOSE_REVOKED = 4403
CLOSE_REPLACED = 4409
CLOSE_TOO_MANY_ERRORS = 4429
CLOSE_BUSY = 1013  # RFC 6455 "try again later": the server takes so many agents at once; back off and dial again


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# A check takes the value and its path in the message, for the refusal's text. The path is None
# on the first pass over a message (parse_message): no path is built for a message that passes,
# and one that fails is checked again with paths to say where.
Check = Callable[[Any, str | None], None]


def _fail(path: str | None, expected: str, value: Any) -> None:
    shown = json.dumps(value)[:60] if not isinstance(value, str) else repr(value[:60])
    raise ProtocolError("invalid", f"{path}: expected {expected}, got {shown}")


def string(max_len: int = 1000) -> Check:
    def check(value: Any, path: str | None) -> None:
        if not isinstance(value, str):
            _fail(path, "a string", value)
        if len(value) > max_len:
            raise ProtocolError("invalid", f"{path}: longer than {max_len} characters")

    return check


def number(value: Any, path: str | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(path, "a number", value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError("invalid", f"{path}: expected a finite number, got {value}")
    if isinstance(value, int) and not -INT64 <= value < INT64:
        raise ProtocolError("invalid", f"{path}: a number beyond 64 bits")


def integer(value: Any, path: str | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, "a whole number", value)
    if not -INT64 <= value < INT64:
        raise ProtocolError("invalid", f"{path}: a whole number beyond 64 bits")


# The integer columns the server keeps agent figures in, on PostgreSQL's sizes (SQLite holds 64
# bits in all of them, so a figure checked only there would pass what PostgreSQL refuses). A
# field the server stores in a column is checked against that column's range here, so a figure
# past it is refused with its path instead of failing the database write. Each is held to its
# model field by tests/cluster/test_protocol_columns.py.
POSITIVE_SMALLINT = (0, 2**15 - 1)  # PositiveSmallIntegerField
POSITIVE_INT = (0, 2**31 - 1)  # PositiveIntegerField
INT32 = (-(2**31), 2**31 - 1)  # IntegerField


def whole(low: int, high: int) -> Check:
    """A whole number from `low` to `high` (the range of the column the server keeps it in)."""

    def check(value: Any, path: str | None) -> None:
        integer(value, path)
        if not low <= value <= high:
            raise ProtocolError("invalid", f"{path}: expected a whole number from {low} to {high}, got {value}")

    return check


def boolean(value: Any, path: str | None) -> None:
    if not isinstance(value, bool):
        _fail(path, "true or false", value)


def nullable(inner: Check) -> Check:
    def check(value: Any, path: str | None) -> None:
        if value is not None:
            inner(value, path)

    return check


def array(inner: Check, max_items: int = 4096) -> Check:
    def check(value: Any, path: str | None) -> None:
        if not isinstance(value, list):
            _fail(path, "a list", value)
        if len(value) > max_items:
            raise ProtocolError("invalid", f"{path}: more than {max_items} items")
        for i, item in enumerate(value):
            inner(item, None if path is None else f"{path}[{i}]")

    return check


def mapping(inner: Check | None = None, max_items: int = 4096) -> Check:
    """A JSON object with free keys (values checked by `inner` when given)."""

    def check(value: Any, path: str | None) -> None:
        if not isinstance(value, dict):
            _fail(path, "an object", value)
        if len(value) > max_items:
            raise ProtocolError("invalid", f"{path}: more than {max_items} keys")
        if inner is not None:
            for key, item in value.items():
                inner(item, None if path is None else f"{path}.{key}")

    return check


def obj(required: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """A JSON object with known fields; unknown fields are allowed (newer peers add them)."""
    optional = optional or {}

    def check(value: Any, path: str | None) -> None:
        if not isinstance(value, dict):
            _fail(path, "an object", value)
        for name, inner in required.items():
            if name not in value:
                raise ProtocolError("invalid", f"{path}.{name}: missing")
            inner(value[name], None if path is None else f"{path}.{name}")
        for name, inner in optional.items():
            if name in value:
                inner(value[name], None if path is None else f"{path}.{name}")

    return check


def within(minimum: float, maximum: float, *, whole: bool = False) -> Check:
    """A number (a whole one with ``whole``) from ``minimum`` to ``maximum``: a figure that cannot
    be true (a negative bandwidth, 1e308 Gb/s) is refused like one of the wrong type."""

    def check(value: Any, path: str | None) -> None:
        (integer if whole else number)(value, path)
        if not minimum <= value <= maximum:
            raise ProtocolError("invalid", f"{path}: expected {minimum:,g} to {maximum:,g}, got {value:,g}")

    return check


NUM = nullable(number)
INT = nullable(integer)
STR = nullable(string())

#: Devices one node may list: cards and their MIG slices or compute partitions.
MAX_DEVICES = 1024

GPU = obj(
    {"index": whole(*POSITIVE_SMALLINT)},  # cluster.Gpu.index
    {
        "uuid": STR,
        "name": STR,
        "architecture": STR,
        "gpu_class": STR,
        "pci_bus_id": STR,
        "memory_total_mib": nullable(whole(*POSITIVE_INT)),  # cluster.Gpu.memory_total_mib
        "memory_used_mib": INT,
        "utilization_gpu_pct": NUM,
        "utilization_memory_pct": NUM,
        "sm_clock_mhz": NUM,
        "temperature_gpu_c": NUM,
        "temperature_memory_c": NUM,
        "power_draw_w": NUM,
        "power_limit_w": NUM,
        "throttle_reasons": nullable(array(string(100), 64)),
        "ecc_uncorrected_volatile": INT,
        "ecc_uncorrected_aggregate": INT,
        "retired_pages_pending": nullable(boolean),
        "remapped_rows_pending": nullable(boolean),
        "remapped_rows_failure": nullable(boolean),
        "remapped_rows_uncorrectable": INT,
        "pcie_replay_count": INT,
        "mig_mode": STR,
        "mig_pending": STR,
        # A device is a card ("gpu") or a slice of one ("mig", "partition"; agent.devices): a
        # slice names its card (`parent`), its `profile`, what the engine is told to use
        # (`device_id`), its share of the card and the slices it shares memory with.
        "vendor": nullable(string(16)),
        "kind": nullable(string(16)),
        "parent": nullable(whole(*POSITIVE_SMALLINT)),  # cluster.Gpu.parent_index
        "profile": nullable(string(64)),
        "device_id": nullable(string(200)),
        "share": nullable(within(0.0, 1.0)),
        "split": nullable(boolean),
        "memory_group": nullable(string(64)),
        "fault": nullable(string(1000)),
        "gpu_instance_id": INT,
        "compute_instance_id": INT,
        "temperature_edge_c": NUM,
        "temperature_junction_c": NUM,
        "ecc_corrected": INT,
        "compute_partition": nullable(string(16)),
        "memory_partition": nullable(string(16)),
        "processes": nullable(array(obj({}, {"pid": INT, "name": STR, "used_memory_mib": INT}), 1024)),
        "fabric": nullable(
            obj(
                {},
                {
                    "state": STR,
                    "status": STR,
                    "clique_id": INT,
                    "cluster_uuid": STR,
                    "health_summary": STR,
                    "bandwidth": STR,
                    "health_faults": nullable(array(string(200), 16)),
                },
            )
        ),
        "xids": nullable(mapping(integer, 256)),
        "nvlink_errors": nullable(mapping(integer, 64)),
        "foreign_processes": nullable(whole(*POSITIVE_INT)),  # cluster.Gpu.foreign_processes
    },
)

STORAGE = obj(
    {"mount_point": string(4096)},
    {
        "fstype": STR,
        "shared": nullable(boolean),
        "total_bytes": INT,
        "free_bytes": INT,
        "directories": array(string(4096), 256),
        "weights": nullable(array(string(4096), 4096)),
        "held": nullable(array(obj({"path": string(4096)}, {"bytes": INT}), 4096)),
        # Directories whose scan stopped at its bounds: a source in one may be there unlisted.
        "partial": array(string(4096), 256),
    },
)

#: What a node says of its engines, at registration (in its hardware) and in every report.
ENGINE_FIELDS: dict[str, Check] = {
    "engines": nullable(array(string(64), 64)),
    # True once the agent has looked: an empty `engines` then means "has none".
    "engines_probed": nullable(boolean),
    # Engine -> what its install is doing, in the node's words ("installing: downloading ...").
    "engine_status": nullable(mapping(string(2000), 64)),
    # Engine -> "configured" (named in agent.yaml) or "installed" (by the agent).
    "engine_sources": nullable(mapping(string(32), 64)),
    # Installed engine -> its build ("cuda-13.3-x64", "vulkan-x64", "rocm-7.2-x64", "cu129"): what
    # devices it can drive (an engine named in agent.yaml is not listed).
    "engine_builds": nullable(mapping(string(64), 64)),
}

ENGINE_REPORT = obj({}, {**ENGINE_FIELDS, "engine_versions": nullable(mapping(nullable(string(200)), 64))})

#: One engine the control plane wants on the node, with the assets of its release.
_RELEASE_ASSETS = array(
    obj(
        {"name": string(300)},
        {"size": INT, "digest": STR, "urls": array(string(4096), 8), "browser_download_url": STR},
    ),
    512,
)
DESIRED_ENGINE = obj(
    {"engine": string(32), "version": string(64)},
    {
        "note": STR,
        "unreachable": nullable(boolean),
        # What gives the node an archive where the control plane holds none that suits it.
        "fix": STR,
        "source": nullable(
            obj(
                {"package": string(200), "version": string(64), "sha256": string(64)},
                {"subdir": string(300), "after_refusal": nullable(boolean)},
            )
        ),
        "assets": _RELEASE_ASSETS,
        # vLLM and SGLang (uv-built environments)
        "build": string(16),
        "index_variant": string(16),
        "torch_index": string(2048),
        "min_compute": string(8),
        "min_free_bytes": INT,
        "unsupported": STR,
        "uv": nullable(obj({"version": string(64)}, {"assets": _RELEASE_ASSETS})),
    },
)

#: A model version the node keeps from the control plane's mirror: each file into `dir`.
DESIRED_MIRROR = obj(
    {"version": INT, "dir": string(4096)},
    {
        "files": array(
            obj({"path": string(1000), "url": string(4096)}, {"size": INT, "sha256": string(64)}),
            4096,
        )
    },
)

IB_PORT = obj(
    {"device": string(64), "port": integer},
    {
        "fabric": string(200),
        "link_layer": STR,
        "state": INT,
        "state_name": STR,
        "phys_state": INT,
        "phys_state_name": STR,
        "up": nullable(boolean),
        "rate_gbps": NUM,
        "lid": INT,
        "sm_lid": INT,
        "node_guid": STR,
        "port_guid": STR,
        "sm_guid": STR,
        "netdev": STR,
        "roce_ip": STR,
        "roce_gid_index": INT,
        "network": STR,
        "xmit_bytes": INT,
        "rcv_bytes": INT,
        "errors": nullable(mapping(integer, 64)),
        "flaps": INT,
    },
)

SUBNET_MANAGERS = obj(
    {"via": string(100), "master": string(32)},
    {"managers": array(obj({"guid": string(32)}, {"lid": INT, "priority": INT, "state": INT, "act_count": INT}), 64)},
)

FABRICS = obj(
    {"ports": array(IB_PORT, 256)},
    {
        "declared": array(string(200), 64),
        "flaps": mapping(integer, 256),
        # netdev -> its addresses, for the interface NCCL bootstraps over
        "interfaces": mapping(array(string(64), 16), 256),
    },
)

# `nvidia-smi topo -m`, per GPU: its NVLink group inside the node (cards joined by NVLink, directly or
# through others), its NVLink peers (index -> bonded links), the matrix's path to each other GPU and
# adapter, the closest adapters and its NUMA node.
GPU_TOPOLOGY = obj(
    {
        "gpus": array(
            obj(
                {"index": integer},
                {
                    "links": mapping(integer, 256),
                    "link_kind": nullable(string(16)),  # "XGMI" between AMD cards; NVLink's say NV#
                    "paths": mapping(string(16), 256),
                    "nics": mapping(string(16), 256),
                    "nearest_nics": array(string(64), 64),
                    "nearest_path": STR,
                    "numa_node": INT,
                    "cpu_affinity": nullable(string(400)),
                },
            ),
            256,
        )
    },
    {"nics": array(string(64), 256)},
)

# nvidia-imex-ctl -q / -N and the channels under /dev/nvidia-caps-imex-channels.
IMEX = obj(
    {"installed": boolean},
    {
        "state": STR,
        "domain_state": STR,
        "configured": nullable(boolean),
        "nodes": array(obj({"index": integer}, {"address": STR, "state": STR, "version": STR}), 256),
        "channels": nullable(array(integer, 4096)),
        "error": STR,
    },
)

HARDWARE = obj(
    {},
    {
        "hostname": STR,
        "cpu_model": STR,
        "cpus": INT,
        "sockets": INT,
        "cpu_flags": nullable(array(string(64), 2048)),
        "has_avx2": nullable(boolean),
        "has_avx512": nullable(boolean),
        "os": STR,
        "kernel": STR,
        "arch": STR,
        "memory_total_bytes": INT,
        "driver_version": STR,
        "cuda_version": STR,
        "gpus": array(GPU, MAX_DEVICES),
        "gpu_topology": nullable(GPU_TOPOLOGY),
        # `nvidia-smi mig -lgip`: the GPU instance profiles each MIG card offers.
        "mig_profiles": nullable(
            array(obj({"gpu": integer, "name": string(64)}, {"free": INT, "total": INT, "memory_gib": NUM}), 256)
        ),
        "rocm_version": STR,
        "amd_driver_version": STR,
        # The last time a card's MIG or partition layout changed under the agent, and how.
        "gpu_layout_changed": nullable(obj({"at": number}, {"cards": mapping(string(1000), 256)})),
        # Engine name -> what its `--version` says; null when that could not be read.
        "engine_versions": nullable(mapping(nullable(string(200)), 64)),
        **ENGINE_FIELDS,
    },
)

SAMPLE = obj(
    {},
    {
        "taken_at": NUM,
        "cpu_utilization_pct": NUM,
        "cpus": INT,
        "load": nullable(array(number, 3)),
        "memory_total_bytes": INT,
        "memory_available_bytes": INT,
        "memory_used_bytes": INT,
        "cpu_package_temp_c": NUM,
        "inlet_temp_c": NUM,
        "cpu_package_power_w": NUM,
        "gpus": array(GPU, MAX_DEVICES),
        "storage": array(STORAGE, 256),
        "ib_ports": array(IB_PORT, 256),
        "subnet_managers": array(SUBNET_MANAGERS, 64),
        "imex": nullable(IMEX),
        # Per running engine: its CPU and memory, and (rank 0) its own figures in llmgw's names
        # (agent.engine_metrics).
        "shards": array(
            obj({"shard": string(200)}, {"cpu_cores": NUM, "memory_bytes": INT, "engine": nullable(mapping(NUM, 64))}),
            1024,
        ),
        "warnings": array(string(2000), 256),
        # Each mirror version the node was told to keep (agent.mirror): held, fetching, refused or
        # failed, with the file or the reason.
        "mirror": array(
            obj({"version": INT, "dir": string(4096), "state": string(16)}, {"message": string(4000)}), 1024
        ),
    },
)

SHARD_STATE = obj(
    {"shard": string(200), "state": string(32)},
    {
        "pid": nullable(whole(*POSITIVE_INT)),  # cluster.Shard.pid
        "exit_code": nullable(whole(*INT32)),  # cluster.Shard.exit_code
        "log_tail": nullable(array(string(4000), 50)),
        "endpoint": STR,
        "message": STR,
        # The tokens one request may hold, as the engine says (its /v1/models); cluster.Shard.context_tokens
        "context_tokens": nullable(whole(*POSITIVE_INT)),
    },
)

SCHEMAS: dict[str, Check] = {
    # agent to server
    "register": obj(
        {"agent_version": string(64), "hardware": HARDWARE},
        {
            "features": array(string(64), 256),
            "labels": mapping(string(256), 256),
            "sample": SAMPLE,
            "warnings": array(string(2000), 256),
            "fabrics": FABRICS,
        },
    ),
    "heartbeat": obj({"sample": SAMPLE}),
    "fabrics": FABRICS,
    "report": obj({"shards": array(SHARD_STATE, 1024)}, {"engines": ENGINE_REPORT}),
    "response": obj({"request_id": string(64), "ok": boolean}, {"result": lambda v, p: None, "error": STR}),
    "error": obj({"code": string(64), "message": string(2000)}, {"in_reply_to": STR}),
    # server to agent
    "registered": obj({"node": string(200), "heartbeat_interval": number}),
    "desired": obj(
        {"shards": array(obj({"shard": string(200)}, {}), 1024)},
        {
            "generation": INT,
            "engines": array(DESIRED_ENGINE, 16),
            "mirror": array(DESIRED_MIRROR, 1024),
            "draining": array(obj({"shard": string(200)}, {}), 1024),
        },
    ),
    "request": obj({"request_id": string(64), "kind": string(64)}, {"params": mapping()}),
    "replaced": obj({}, {"message": STR}),
}


# The answers to requests ("response" messages) ------------------------------------------------

#: The fastest adapter port today is XDR InfiniBand at 800 Gb/s; ten times that leaves room for
#: what comes next and still refuses a figure no port can reach.
MAX_PORT_GBPS = 8000.0
#: ib_write_bw's message rate on one port: a ConnectX-8 reaches a few hundred million a second.
MAX_MESSAGE_RATE_MPPS = 100_000.0

_PERFTEST_RESULT: dict[str, Check] = {
    "bw_average_gbps": nullable(within(0, MAX_PORT_GBPS)),
    "bw_peak_gbps": nullable(within(0, MAX_PORT_GBPS)),
    "msg_rate_mpps": nullable(within(0, MAX_MESSAGE_RATE_MPPS)),
    "unit": nullable(string(32)),
    "device": nullable(string(64)),
    "link_type": nullable(string(32)),
    "warnings": array(string(2000), 10),
}

#: Per request kind, the fields its answer (the "result" of a "response") may hold. The answer
#: is read field by field (read_result), not refused whole: one forged figure costs that figure.
RESULTS: dict[str, dict[str, Check]] = {
    "ibnetdiscover": {
        "text_gz": string(MAX_MESSAGE_BYTES),
        "text": string(MAX_MESSAGE_BYTES),
        "exit_code": INT,
        "bytes": nullable(within(0, INT64 - 1, whole=True)),
    },
    "perftest.server": _PERFTEST_RESULT,
    "perftest.client": _PERFTEST_RESULT,
}


def read_result(kind: str, value: Any) -> dict[str, Any]:
    """The answer to a ``kind`` request as the receiving side may keep it: each field RESULTS
    knows, checked; one that fails is kept as unknown (None) and its reason listed under
    ``"refused"`` (with the numbers: "bw_average_gbps: expected 0 to 8,000, got -5"). Fields
    RESULTS does not name are dropped, and so is everything of a kind it does not know: nothing
    an agent sends is kept as sent."""
    fields = RESULTS.get(kind)
    if fields is None:
        return {"refused": [f"{kind}: this side does not know what such an answer holds"]}
    try:
        mapping()(value, "result")
    except ProtocolError as exc:
        return {"refused": [exc.message]}
    kept: dict[str, Any] = {}
    refused: list[str] = []
    for name, check in fields.items():
        if name not in value:
            continue
        try:
            check(value[name], name)
        except ProtocolError as exc:
            kept[name] = None
            refused.append(exc.message)
        else:
            kept[name] = value[name]
    if refused:
        kept["refused"] = refused
    return kept


@dataclass(frozen=True)
class Message:
    type: str
    body: dict[str, Any]
    id: str | None = None


def parse_message(raw: str | bytes, *, expect: str) -> Message:
    """Decode and validate one message. `expect` is "agent" (from agents) or "server"."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"message of {len(raw)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ProtocolError("invalid", f"nested deeper than {MAX_DEPTH} levels") from None
    except ProtocolError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError("malformed", f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("malformed", "a message must be a JSON object")
    _check_values(data, raw)
    version = data.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            "version", f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    kind = data.get("type")
    allowed = AGENT_TO_SERVER if expect == "agent" else SERVER_TO_AGENT
    if not isinstance(kind, str) or kind not in allowed:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}; expected one of {sorted(allowed)}")
    message_id = data.get("id")
    if message_id is not None and not isinstance(message_id, str):
        raise ProtocolError("invalid", "id: expected a string")
    try:
        SCHEMAS[kind](data, None)
    except ProtocolError:
        SCHEMAS[kind](data, kind)  # again, building the paths, to say where
        raise
    body = {k: v for k, v in data.items() if k not in {"v", "type", "id"}}
    return Message(type=kind, body=body, id=message_id)


def _no_constant(name: str) -> Any:
    raise ProtocolError("invalid", f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    """A JSON number with a fraction or an exponent; 1e999 would read as infinity."""
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError("invalid", f"{text[:40]} is not a finite number")
    return value


_ESCAPE = re.compile(r"\\.")
_BRACKET = re.compile(r"[\[\]{}]")


def _depth(text: str) -> int:
    """How deep a JSON text nests, its strings left out (escapes first, then what lies between
    quotes): the work is done by str methods and re, and only the brackets are counted one by one."""
    outside = "".join(_ESCAPE.sub("", text).split('"')[::2])
    depth = deepest = 0
    for bracket in _BRACKET.findall(outside):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _check_values(data: dict[str, Any], raw: str | bytes) -> None:
    """Walk the message once, when it might hold what the schemas do not look at: deep nesting, and
    NUL characters anywhere (free-form mappings included). Non-finite numbers are refused as
    they are read (_finite)."""
    text = raw if isinstance(raw, str) else raw.decode("utf-8", "replace")
    nul = "\\u0000" in text
    deep = text.count("{") + text.count("[") > MAX_DEPTH and _depth(text) > MAX_DEPTH
    if not (nul or deep):
        return
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ProtocolError("invalid", f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if "\x00" in key:
                    raise ProtocolError("invalid", f"{path or 'message'}: a key holds a NUL character")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str):
            if "\x00" in value:
                raise ProtocolError("invalid", f"{path}: a NUL character is not text")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ProtocolError("invalid", f"{path}: expected a finite number, got {value}")


def encode(kind: str, body: Mapping[str, Any] | None = None, *, id: str | None = None) -> str:
    payload: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": kind}
    if id is not None:
        payload["id"] = id
    payload.update(body or {})
    return json.dumps(payload, separators=(",", ":"))


def error_message(exc: ProtocolError, in_reply_to: str | None = None) -> str:
    body: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if in_reply_to:
        body["in_reply_to"] = in_reply_to
    return encode("error", body)


# The shards of a "desired" message ----------------------------------------------------------

#: Engine name (as the catalog spells it) -> module in agent.engines.
ENGINES = {"llama.cpp": "llamacpp", "vllm": "vllm", "sglang": "sglang"}

_SHARD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class DesiredShard:
    """One engine process a node should run: a whole single-node replica, or one rank of a multi-node
    one. The one shape of a shard: the server builds it (`to_message`) and the agent reads it back
    (`parse`), which refuses what the agent could not run, naming the field."""

    shard: str
    model: str
    engine: str
    source: str
    api_key: str
    port: int
    served_name: str = ""
    gpu_indices: list[int] = field(default_factory=list)
    cpu_cores: float = 0.0
    memory_bytes: int = 0
    context_size: int | None = None
    parallel: int = 1
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    nodes_per_replica: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    tensor_parallel: int | None = None
    pipeline_parallel: int | None = None
    generation: int = 0
    stop_grace: float | None = None  # seconds from SIGTERM to SIGKILL when it is stopped
    # What the engine is told to use, one per gpu_indices entry: a MIG device's UUID, an AMD
    # device's ROCm index. Empty for whole NVIDIA cards, which are told their indices.
    devices: list[str] = field(default_factory=list)
    vendor: str = "nvidia"  # "nvidia" or "amd": which variables name the devices

    @property
    def is_cpu(self) -> bool:
        return not self.gpu_indices

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_message(self) -> DesiredShardMessage:
        """The shard as the "desired" message carries it (parse() reads it back to an equal object)."""
        return cast(DesiredShardMessage, asdict(self))  # every field, by its name: the TypedDict's keys

    @classmethod
    def parse(cls, obj: Any) -> DesiredShard:
        return parse_shard(obj)


@dataclass(frozen=True)
class DrainingShard:
    """A shard whose replica is being stopped: no gateway sends it new requests any more, and its
    engine runs on for those in flight. The agent stops it once it has been idle (nothing running
    or waiting) after `settle` seconds, or when `left` seconds have passed, whichever is first.
    A running shard in neither list is stopped at once."""

    shard: str
    grace: float  # the whole grace it was given (said in messages)
    left: float  # seconds of it left when the message was made
    settle: float = 0.0  # seconds until every gateway has stopped routing to it

    def to_message(self) -> DrainingShardMessage:
        return cast(DrainingShardMessage, asdict(self))


def _seconds(data: dict[str, Any], name: str, default: Any = ...) -> float:
    value = data.get(name)
    if value is None:
        if default is ...:
            raise ValueError(f"{name}: missing")
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 86400:
        raise _bad(name, "seconds from 0 to 86400", value)
    return float(value)


def parse_draining(obj: Any) -> DrainingShard:
    """Validate one item of a "desired" message's "draining" list (ValueError naming the field)."""
    if not isinstance(obj, dict):
        raise _bad("draining", "an object", obj)
    shard = _str(obj, "shard", max_len=200)
    if not _SHARD_ID.fullmatch(shard):
        raise ValueError(f"shard: {shard!r} is not a valid shard id")
    return DrainingShard(
        shard=shard,
        grace=_seconds(obj, "grace"),
        left=_seconds(obj, "left"),
        settle=_seconds(obj, "settle", default=0.0),
    )


# --------------------------------------------------------------------------- parsing


def _bad(name: str, expected: str, value: Any) -> ValueError:
    shown = repr(value) if not isinstance(value, str) else repr(value[:80])
    return ValueError(f"{name}: expected {expected}, got {shown}")


def _str(data: dict[str, Any], name: str, *, default: Any = ..., allow_empty: bool = False, max_len: int = 4096) -> Any:
    if name not in data or data[name] is None:
        if default is ...:
            raise ValueError(f"{name}: missing")
        return default
    value = data[name]
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    if not allow_empty and not value:
        raise ValueError(f"{name}: must not be empty")
    if len(value) > max_len:
        raise ValueError(f"{name}: longer than {max_len} characters")
    if "\x00" in value:
        raise ValueError(f"{name}: contains a NUL character")
    return value


def _int(
    data: dict[str, Any], name: str, *, default: Any = ..., minimum: int | None = None, maximum: int | None = None
) -> Any:
    if name not in data or data[name] is None:
        if default is ...:
            raise ValueError(f"{name}: missing")
        return default
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "a whole number", value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: expected at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: expected at most {maximum}, got {value}")
    return value


def parse_shard(obj: Any) -> DesiredShard:
    """Validate one item of a "desired" message. Unknown fields are ignored (newer servers add them).

    Fields are checked in a fixed order, so a shard with several faults is always refused for the
    same one."""
    if not isinstance(obj, dict):
        raise _bad("shard", "an object", obj)
    shard = _shard_id(obj)
    engine = _str(obj, "engine", max_len=32)
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {', '.join(sorted(ENGINES))}, got {engine!r}")
    model = _str(obj, "model", max_len=200)
    source = _str(obj, "source")
    if not source.startswith("/"):
        raise ValueError(f"source: expected an absolute path on the node, got {source!r}")
    served_name = _str(obj, "served_name", default=model, max_len=200)
    api_key = _str(obj, "api_key", max_len=512)
    if any(c.isspace() or c == "," for c in api_key):
        raise ValueError("api_key: must not contain spaces or commas")
    port = _int(obj, "port", minimum=1, maximum=65535)
    host = _host(obj)
    gpu_indices = _gpu_indices(obj)
    cpu_cores = _cpu_cores(obj)
    extra_args = _extra_args(obj)
    env = _env(obj)
    nodes, rank, master_addr, master_port = _ranks(obj)
    devices, vendor = _devices(obj, gpu_indices)
    stop_grace = _stop_grace(obj)
    return DesiredShard(
        shard=shard,
        model=model,
        engine=engine,
        source=source,
        served_name=served_name,
        gpu_indices=list(gpu_indices),
        cpu_cores=float(cpu_cores),
        memory_bytes=_int(obj, "memory_bytes", default=0, minimum=0),
        context_size=_int(obj, "context_size", default=None, minimum=1),
        parallel=_int(obj, "parallel", default=1, minimum=1, maximum=4096),
        extra_args=list(extra_args),
        env=dict(env),
        api_key=api_key,
        port=port,
        host=host,
        nodes_per_replica=nodes,
        rank=rank,
        master_addr=master_addr,
        master_port=master_port,
        tensor_parallel=_int(obj, "tensor_parallel", default=None, minimum=1),
        pipeline_parallel=_int(obj, "pipeline_parallel", default=None, minimum=1),
        generation=_int(obj, "generation", default=0),
        stop_grace=float(stop_grace) if stop_grace is not None else None,
        devices=devices,
        vendor=vendor,
    )


def _shard_id(obj: dict[str, Any]) -> str:
    """The shard's id: it names files and processes on the node, so only a safe alphabet."""
    shard: str = _str(obj, "shard", max_len=200)
    if not _SHARD_ID.fullmatch(shard):
        raise ValueError(
            f"shard: {shard!r} is not a valid shard id (letters, digits and ._:@+- only, "
            "starting with a letter or digit)"
        )
    return shard


def _host(obj: dict[str, Any]) -> str:
    """The address the engine listens on: an IP address or a host name, loopback by default."""
    host: str = _str(obj, "host", default="127.0.0.1", max_len=255)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ValueError(f"host: expected an IP address or host name, got {host!r}") from None
    return host


def _gpu_indices(obj: dict[str, Any]) -> list[int]:
    """The GPU indices the shard runs on, each at most once; none (a CPU shard) when absent."""
    gpu_indices = obj.get("gpu_indices")
    if gpu_indices is None:
        gpu_indices = []
    if not isinstance(gpu_indices, list):
        raise _bad("gpu_indices", "a list of GPU indices", gpu_indices)
    for i, index in enumerate(gpu_indices):
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise _bad(f"gpu_indices[{i}]", "a GPU index (0 or more)", index)
    if len(set(gpu_indices)) != len(gpu_indices):
        raise ValueError(f"gpu_indices: {gpu_indices} lists a GPU twice")
    return gpu_indices


def _cpu_cores(obj: dict[str, Any]) -> int | float:
    """The CPU cores the shard may use, 0 or more (not NaN); 0 when absent."""
    cpu_cores = obj.get("cpu_cores", 0)
    if cpu_cores is None:
        cpu_cores = 0
    if isinstance(cpu_cores, bool) or not isinstance(cpu_cores, int | float) or cpu_cores != cpu_cores:
        raise _bad("cpu_cores", "a number of cores", cpu_cores)
    if cpu_cores < 0:
        raise ValueError(f"cpu_cores: cannot be negative, got {cpu_cores}")
    return cpu_cores


def _extra_args(obj: dict[str, Any]) -> list[str]:
    """The engine's extra command-line arguments: strings without NUL, none when absent."""
    extra_args = obj.get("extra_args")
    if extra_args is None:
        extra_args = []
    if not isinstance(extra_args, list):
        raise _bad("extra_args", "a list of strings", extra_args)
    for i, arg in enumerate(extra_args):
        if not isinstance(arg, str) or "\x00" in arg:
            raise _bad(f"extra_args[{i}]", "a string", arg)
    return extra_args


def _env(obj: dict[str, Any]) -> dict[str, str]:
    """The engine's extra environment: valid variable names to strings without NUL."""
    env = obj.get("env")
    if env is None:
        env = {}
    if not isinstance(env, dict):
        raise _bad("env", "a mapping of names to values", env)
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.fullmatch(key):
            raise _bad("env", "environment variable names (letters, digits, _)", key)
        if not isinstance(value, str) or "\x00" in value:
            raise _bad(f"env.{key}", "a string", value)
    return env


def _ranks(obj: dict[str, Any]) -> tuple[int, int, str | None, int | None]:
    """``nodes_per_replica``, this node's ``rank`` below it, and the master's address and port,
    which a replica over several nodes needs."""
    nodes = _int(obj, "nodes_per_replica", default=1, minimum=1)
    rank = _int(obj, "rank", default=0, minimum=0)
    if rank >= nodes:
        raise ValueError(f"rank: expected less than nodes_per_replica ({nodes}), got {rank}")
    master_addr = _str(obj, "master_addr", default=None, max_len=255)
    master_port = _int(obj, "master_port", default=None, minimum=1, maximum=65535)
    if nodes > 1 and (master_addr is None or master_port is None):
        raise ValueError(f"master_addr/master_port: required when nodes_per_replica is {nodes}")
    return nodes, rank, master_addr, master_port


def _stop_grace(obj: dict[str, Any]) -> int | float | None:
    """Seconds from SIGTERM to SIGKILL, 0 to 3600; None (the agent's default) when absent."""
    stop_grace = obj.get("stop_grace")
    if stop_grace is not None and (
        isinstance(stop_grace, bool) or not isinstance(stop_grace, int | float) or not 0 <= stop_grace <= 3600
    ):
        raise _bad("stop_grace", "seconds from 0 to 3600", stop_grace)
    return stop_grace


_DEVICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_./:-]{0,199}")


def _devices(obj: dict[str, Any], gpu_indices: list[int]) -> tuple[list[str], str]:
    """The shard's device ids and vendor: one id per GPU index where given, and always for a
    slice, whose index says nothing the engine can use (a MIG device is started by its UUID)."""
    vendor = _str(obj, "vendor", default="nvidia", max_len=16)
    if vendor not in ("nvidia", "amd"):
        raise ValueError(f"vendor: expected nvidia or amd, got {vendor!r}")
    devices = obj.get("devices")
    if devices is None:
        devices = []
    if not isinstance(devices, list):
        raise _bad("devices", "a list of device ids", devices)
    for i, device in enumerate(devices):
        if not isinstance(device, str) or not _DEVICE_ID.fullmatch(device):
            raise _bad(f"devices[{i}]", "a device id (a MIG UUID, a ROCm index)", device)
    if devices and len(devices) != len(gpu_indices):
        raise ValueError(f"devices: {len(devices)} ids for {len(gpu_indices)} GPU indices")
    slices = [index for index in gpu_indices if index >= SLICE_BASE]
    if slices and not devices:
        raise ValueError(f"devices: GPU {slices[0]} is a slice of a card and the shard does not say its device id")
    if vendor == "amd" and gpu_indices and not devices:
        raise ValueError("devices: an AMD shard names its devices' ROCm indices")
    return list(devices), vendor
