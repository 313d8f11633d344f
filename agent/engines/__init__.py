"""The command line for each engine, for one shard the server asked for.

A shard's shape is `agent.protocol.DesiredShard` (also `ShardSpec` here): the server builds
it, sends it in the "desired" message, and `parse_shard()` (DesiredShard.parse) reads it back
or raises ValueError naming the field. `build_command(spec, binary)` gives the argv and extra
environment for the spec's engine; the supervisor starts it.

A shard's API key is passed in the environment where the engine reads it from there
(llama.cpp: LLAMA_API_KEY, vLLM: VLLM_API_KEY), so it does not show in `ps` to other users of
the node; SGLang only takes it on the command line.

No Django import; importable on Python 3.11.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict
from typing import Any

from agent.protocol import ENGINES, DesiredShard

ShardSpec = DesiredShard
parse_shard = DesiredShard.parse

__all__ = [
    "ENGINES",
    "ShardSpec",
    "build_command",
    "cuda_visible_devices",
    "device_env",
    "health_path",
    "join_env",
    "parse_shard",
    "serves_http",
    "spec_fingerprint",
]

#: Fields that do not change the running process: the shard's identity, its API name in the
#: catalog (the engine serves `served_name`) and its memory claim (bookkeeping for placement).
_NOT_RESTARTING = frozenset({"shard", "model", "memory_bytes", "stop_grace"})


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
    """The NVIDIA devices the engine may see: a MIG slice by its UUID (CUDA's only name for it),
    a whole card by its index; "" hides every GPU from a CPU shard."""
    return ",".join(spec.devices) if spec.devices else ",".join(str(i) for i in spec.gpu_indices)


def device_env(spec: ShardSpec) -> dict[str, str]:
    """The variables that give the engine the devices placement chose, and no other.

    NVIDIA: CUDA_VISIBLE_DEVICES (indices, or MIG UUIDs). AMD: ROCR_VISIBLE_DEVICES names the
    devices by their ROCm index (a compute partition is a device of its own there); HIP, and
    CUDA_VISIBLE_DEVICES which HIP reads as its alias, then number them 0..n-1, which is what
    they see; GGML_VK_VISIBLE_DEVICES for llama.cpp's Vulkan build. A CPU shard sees no GPU."""
    if spec.vendor != "amd" or not spec.gpu_indices:
        return {"CUDA_VISIBLE_DEVICES": cuda_visible_devices(spec)}
    seen = ",".join(str(i) for i in range(len(spec.devices)))
    listed = ",".join(spec.devices)
    return {
        "ROCR_VISIBLE_DEVICES": listed,
        "HIP_VISIBLE_DEVICES": seen,
        "CUDA_VISIBLE_DEVICES": seen,
        "GGML_VK_VISIBLE_DEVICES": listed,
    }


def join_env(spec: ShardSpec, defaults: dict[str, str], forced: dict[str, str]) -> dict[str, str]:
    """The engine's defaults, the spec's env over them (the operator's word wins), and last what
    must not be overridden: the shard's API key and the GPUs placement gave it."""
    merged = dict(defaults)
    merged.update(spec.env)
    merged.update(forced)
    return merged
