"""What one engine process is asked to run (a shard), and the command line for each engine.

The server's "desired" message lists shards as JSON objects; `parse_shard()` turns one into a
`ShardSpec` (or raises ValueError naming the field). `build_command(spec, binary)` gives the
argv and extra environment for the spec's engine; the supervisor starts it.

A shard's API key is passed in the environment where the engine reads it from there
(llama.cpp: LLAMA_API_KEY, vLLM: VLLM_API_KEY), so it does not show in `ps` to other users of
the node; SGLang only takes it on the command line.

No Django import; importable on Python 3.11.
"""

from __future__ import annotations

import hashlib
import importlib
import ipaddress
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "ENGINES",
    "ShardSpec",
    "build_command",
    "cuda_visible_devices",
    "health_path",
    "join_env",
    "parse_shard",
    "serves_http",
    "spec_fingerprint",
]

#: Engine name (as the catalog spells it) -> module in this package.
ENGINES = {"llama.cpp": "llamacpp", "vllm": "vllm", "sglang": "sglang"}

_SHARD_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,199}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class ShardSpec:
    """One engine process on this node: a whole single-node replica, or one rank of a multi-node one."""

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

    @property
    def is_cpu(self) -> bool:
        return not self.gpu_indices

    @property
    def multi_node(self) -> bool:
        return self.nodes_per_replica > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- parsing


def _bad(name: str, expected: str, value: Any) -> ValueError:
    shown = repr(value) if not isinstance(value, str) else repr(value[:80])
    return ValueError(f"{name}: expected {expected}, got {shown}")


def _str(data: dict[str, Any], name: str, *, default: Any = ..., allow_empty: bool = False,
         max_len: int = 4096) -> Any:
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


def _int(data: dict[str, Any], name: str, *, default: Any = ..., minimum: int | None = None,
         maximum: int | None = None) -> Any:
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


def parse_shard(obj: Any) -> ShardSpec:
    """Validate one item of a "desired" message. Unknown fields are ignored (newer servers add them)."""
    if not isinstance(obj, dict):
        raise _bad("shard", "an object", obj)
    shard = _str(obj, "shard", max_len=200)
    if not _SHARD_ID.fullmatch(shard):
        raise ValueError(f"shard: {shard!r} is not a valid shard id (letters, digits and ._:@+- only, "
                         "starting with a letter or digit)")
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
    host = _str(obj, "host", default="127.0.0.1", max_len=255)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ValueError(f"host: expected an IP address or host name, got {host!r}") from None

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

    cpu_cores = obj.get("cpu_cores", 0)
    if cpu_cores is None:
        cpu_cores = 0
    if isinstance(cpu_cores, bool) or not isinstance(cpu_cores, int | float) or cpu_cores != cpu_cores:
        raise _bad("cpu_cores", "a number of cores", cpu_cores)
    if cpu_cores < 0:
        raise ValueError(f"cpu_cores: cannot be negative, got {cpu_cores}")

    extra_args = obj.get("extra_args")
    if extra_args is None:
        extra_args = []
    if not isinstance(extra_args, list):
        raise _bad("extra_args", "a list of strings", extra_args)
    for i, arg in enumerate(extra_args):
        if not isinstance(arg, str) or "\x00" in arg:
            raise _bad(f"extra_args[{i}]", "a string", arg)

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

    nodes = _int(obj, "nodes_per_replica", default=1, minimum=1)
    rank = _int(obj, "rank", default=0, minimum=0)
    if rank >= nodes:
        raise ValueError(f"rank: expected less than nodes_per_replica ({nodes}), got {rank}")
    master_addr = _str(obj, "master_addr", default=None, max_len=255)
    master_port = _int(obj, "master_port", default=None, minimum=1, maximum=65535)
    if nodes > 1 and (master_addr is None or master_port is None):
        raise ValueError(f"master_addr/master_port: required when nodes_per_replica is {nodes}")

    return ShardSpec(
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
    )


#: Fields that do not change the running process: the shard's identity, its API name in the
#: catalog (the engine serves `served_name`) and its memory claim (bookkeeping for placement).
_NOT_RESTARTING = frozenset({"shard", "model", "memory_bytes"})


def spec_fingerprint(spec: ShardSpec) -> str:
    """A hash of everything whose change needs the engine restarted (generation included, so the
    server can ask for a restart by bumping it)."""
    data = {k: v for k, v in asdict(spec).items() if k not in _NOT_RESTARTING}
    raw = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- engines


def _module(spec: ShardSpec) -> Any:
    try:
        name = ENGINES[spec.engine]
    except KeyError:
        raise ValueError(f"engine: no command builder for {spec.engine!r}") from None
    return importlib.import_module(f"{__name__}.{name}")


def build_command(spec: ShardSpec, binary: str) -> tuple[list[str], dict[str, str]]:
    """argv and the environment to add for `spec` (ValueError when the spec cannot run on this engine)."""
    argv, env = _module(spec).build_command(spec, binary)
    return argv, env


def serves_http(spec: ShardSpec) -> bool:
    """False for the headless ranks of a multi-node replica: only rank 0 answers HTTP."""
    return bool(_module(spec).serves_http(spec))


def health_path(spec: ShardSpec) -> str:
    return str(_module(spec).HEALTH_PATH)


def cuda_visible_devices(spec: ShardSpec) -> str:
    """The GPUs the engine may see; "" hides every GPU from a CPU shard."""
    return ",".join(str(i) for i in spec.gpu_indices)


def join_env(spec: ShardSpec, defaults: dict[str, str], forced: dict[str, str]) -> dict[str, str]:
    """The engine's defaults, the spec's env over them (the operator's word wins), and last what
    must not be overridden: the shard's API key and the GPUs placement gave it."""
    merged = dict(defaults)
    merged.update(spec.env)
    merged.update(forced)
    return merged
