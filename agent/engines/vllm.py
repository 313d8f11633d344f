"""vLLM's OpenAI-compatible server (`vllm serve`), on one node or as one rank of a multi-node replica.

    vllm serve <source> --host H --port P --served-model-name N
               --tensor-parallel-size T --pipeline-parallel-size PP
               [--max-model-len <context_size>] --max-num-seqs <parallel>
               [--distributed-executor-backend mp --nnodes N --node-rank R
                --master-addr A --master-port MP [--headless]]  [extra_args...]
    env: VLLM_API_KEY=<api key>, the devices (agent.engines.device_env: CUDA_VISIBLE_DEVICES, or
         ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES for vLLM's ROCm build on AMD);
         multi-node also NCCL_DEBUG=WARN, NCCL_IB_DISABLE=0 (NCCL_SOCKET_IFNAME and the like
         come from the spec's env, which wins over these defaults)

Multi-node replicas use vLLM's multiprocessing executor across nodes (no Ray cluster to
manage): every node runs `vllm serve` with the same model and parallel sizes plus
--nnodes/--node-rank/--master-addr/--master-port; rank 0 serves the API and the other ranks
run --headless (no HTTP server, so the supervisor only watches that their process lives).
The parallel sizes default to the doc's advice: tensor parallel over the GPUs of one node,
pipeline parallel over the nodes; their product must equal the GPUs of the whole replica.

The API key goes in VLLM_API_KEY (read by vLLM when --api-key is absent), not on the command
line. /health answers without the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.engines import device_env, join_env

if TYPE_CHECKING:
    from agent.engines import ShardSpec

__all__ = ["HEALTH_PATH", "build_command", "parallel_sizes", "serves_http"]

HEALTH_PATH = "/health"
NCCL_DEFAULTS = {"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}


def serves_http(spec: ShardSpec) -> bool:
    return spec.rank == 0


def parallel_sizes(spec: ShardSpec) -> tuple[int, int]:
    """(tensor parallel, pipeline parallel), checked against the GPUs of the replica."""
    gpus = len(spec.gpu_indices)
    if spec.tensor_parallel is None and spec.pipeline_parallel is None:
        tp, pp = max(1, gpus), spec.nodes_per_replica
    elif spec.tensor_parallel is None:
        pp = spec.pipeline_parallel or 1
        total = max(1, gpus) * spec.nodes_per_replica
        if total % pp:
            raise ValueError(f"pipeline_parallel: {pp} does not divide the replica's {total} GPUs")
        tp = total // pp
    else:
        tp = spec.tensor_parallel
        pp = spec.pipeline_parallel or 1
    if gpus and tp * pp != gpus * spec.nodes_per_replica:
        raise ValueError(
            f"tensor_parallel x pipeline_parallel is {tp} x {pp} = {tp * pp}, but the replica has "
            f"{gpus} GPUs on each of {spec.nodes_per_replica} node(s) = {gpus * spec.nodes_per_replica}"
        )
    return tp, pp


def build_command(spec: ShardSpec, binary: str) -> tuple[list[str], dict[str, str]]:
    tp, pp = parallel_sizes(spec)
    argv = [
        binary,
        "serve",
        spec.source,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--served-model-name",
        spec.served_name,
        "--tensor-parallel-size",
        str(tp),
        "--pipeline-parallel-size",
        str(pp),
    ]
    if spec.context_size is not None:
        argv += ["--max-model-len", str(spec.context_size)]
    argv += ["--max-num-seqs", str(spec.parallel)]
    defaults: dict[str, str] = {}
    if spec.multi_node:
        argv += [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(spec.nodes_per_replica),
            "--node-rank",
            str(spec.rank),
            "--master-addr",
            str(spec.master_addr),
            "--master-port",
            str(spec.master_port),
        ]
        if spec.rank > 0:
            argv.append("--headless")
        defaults.update(NCCL_DEFAULTS)
    argv += spec.extra_args
    env = join_env(
        spec,
        defaults,
        {
            "VLLM_API_KEY": spec.api_key,
            **device_env(spec),
        },
    )
    return argv, env
