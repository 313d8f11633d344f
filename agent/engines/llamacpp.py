"""llama.cpp's `llama-server`: one process serves a GGUF file on CPU, on GPUs, or both.

    llama-server -m <source> --host H --port P --alias <served_name> --ctx-size <context_size * parallel>
                 --parallel <parallel> --threads <cpu cores, at least 1> --metrics --no-webui
                 [-ngl 999]  [extra_args...]
    env: LLAMA_API_KEY=<api key>, the devices (agent.engines.device_env: CUDA_VISIBLE_DEVICES=<gpu
         indices or MIG UUIDs>, "" on a CPU shard; on AMD ROCR_/HIP_/GGML_VK_VISIBLE_DEVICES)

llama-server splits --ctx-size evenly between its --parallel slots, so the per-request
context the catalog asks for is multiplied by the number of slots. The API key goes in
LLAMA_API_KEY (llama-server's environment name for --api-key), not the command line, so other
users of the node cannot read it from `ps`. /health answers without the key (200 once the model
is loaded, 503 while loading); every other endpoint needs it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from agent.engines import device_env, join_env

if TYPE_CHECKING:
    from agent.engines import ShardSpec

__all__ = ["HEALTH_PATH", "build_command", "serves_http", "threads"]

HEALTH_PATH = "/health"
ALL_LAYERS = "999"


def threads(spec: ShardSpec) -> int:
    """The claimed cores, rounded to the nearest whole thread, at least one."""
    if spec.cpu_cores <= 0:
        return 1
    return max(1, math.floor(spec.cpu_cores + 0.5))


def serves_http(spec: ShardSpec) -> bool:
    return True


def build_command(spec: ShardSpec, binary: str) -> tuple[list[str], dict[str, str]]:
    if spec.nodes_per_replica > 1:
        raise ValueError(f"nodes_per_replica: llama.cpp runs a replica on one node, got {spec.nodes_per_replica}")
    argv = [
        binary,
        "-m",
        spec.source,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--alias",
        spec.served_name,
    ]
    if spec.context_size is not None:
        argv += ["--ctx-size", str(spec.context_size * spec.parallel)]
    argv += [
        "--parallel",
        str(spec.parallel),
        "--threads",
        str(threads(spec)),
        "--metrics",
        "--no-webui",
    ]
    if spec.gpu_indices:
        argv += ["-ngl", ALL_LAYERS]
    argv += spec.extra_args
    env = join_env(
        spec,
        {},
        {
            "LLAMA_API_KEY": spec.api_key,
            **device_env(spec),
        },
    )
    return argv, env
