"""SGLang's server (`python -m sglang.launch_server`); the engine "binary" is the Python
interpreter of the environment SGLang is installed in.

    <python> -m sglang.launch_server --model-path <source> --host H --port P --api-key K
             --served-model-name N --tp T [--pp-size PP] [--context-length <context_size>]
             --max-running-requests <parallel> --enable-metrics [--device cpu]
             [--nnodes N --node-rank R --dist-init-addr A:MP]  [extra_args...]
    env: the devices (agent.engines.device_env: CUDA_VISIBLE_DEVICES, on AMD ROCR/HIP_VISIBLE_DEVICES);
         multi-node also NCCL_DEBUG=WARN, NCCL_IB_DISABLE=0

SGLang's --tp is the tensor-parallel size of the whole replica (16 for two nodes of 8 GPUs);
by default it covers every GPU of the replica divided by the pipeline size. Only rank 0
serves HTTP; the other ranks run the scheduler only. SGLang takes its API key only on the
command line (no environment variable), so it is visible in `ps` on the node.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.engines import device_env, join_env

if TYPE_CHECKING:
    from agent.engines import ShardSpec

__all__ = ["HEALTH_PATH", "build_command", "dist_init_addr", "parallel_sizes", "serves_http"]

HEALTH_PATH = "/health"
NCCL_DEFAULTS = {"NCCL_DEBUG": "WARN", "NCCL_IB_DISABLE": "0"}


def serves_http(spec: ShardSpec) -> bool:
    return spec.rank == 0


def parallel_sizes(spec: ShardSpec) -> tuple[int, int]:
    """(tensor parallel over the whole replica, pipeline parallel), checked against its GPUs."""
    gpus = len(spec.gpu_indices)
    total = max(1, gpus) * spec.nodes_per_replica
    pp = spec.pipeline_parallel or 1
    if spec.tensor_parallel is None:
        if total % pp:
            raise ValueError(f"pipeline_parallel: {pp} does not divide the replica's {total} GPUs")
        tp = total // pp
    else:
        tp = spec.tensor_parallel
    if gpus and tp * pp != total:
        raise ValueError(
            f"tensor_parallel x pipeline_parallel is {tp} x {pp} = {tp * pp}, but the replica has "
            f"{gpus} GPUs on each of {spec.nodes_per_replica} node(s) = {total}"
        )
    return tp, pp


def dist_init_addr(spec: ShardSpec) -> str:
    host = str(spec.master_addr)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{spec.master_port}"


def build_command(spec: ShardSpec, binary: str) -> tuple[list[str], dict[str, str]]:
    tp, pp = parallel_sizes(spec)
    argv = [
        binary,
        "-m",
        "sglang.launch_server",
        "--model-path",
        spec.source,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--api-key",
        spec.api_key,
        "--served-model-name",
        spec.served_name,
        "--tp",
        str(tp),
    ]
    if pp > 1:
        argv += ["--pp-size", str(pp)]
    if spec.context_size is not None:
        argv += ["--context-length", str(spec.context_size)]
    # --enable-metrics: its /metrics page, which the agent reads for llmgw_engine_* (agent.engine_metrics).
    argv += ["--max-running-requests", str(spec.parallel), "--enable-metrics"]
    if not spec.gpu_indices:
        argv += ["--device", "cpu"]
    defaults: dict[str, str] = {}
    if spec.multi_node:
        argv += [
            "--nnodes",
            str(spec.nodes_per_replica),
            "--node-rank",
            str(spec.rank),
            "--dist-init-addr",
            dist_init_addr(spec),
        ]
        defaults.update(NCCL_DEFAULTS)
    argv += spec.extra_args
    env = join_env(spec, defaults, device_env(spec))
    return argv, env
