"""The shapes of the messages both ends read: a heartbeat's sample and the "desired" message.

agent.protocol checks what arrives (SAMPLE, SCHEMAS["desired"]); these types say what the
checked message holds, for mypy, so that a misspelt key at either end fails the type check
instead of showing as "-" on the node page. They add nothing at run time: no check, no
conversion, and the wire format is the protocol's.

- HeartbeatSample: built by agent.sampler.Sampler.sample (with "shards" and "mirror" added
  by agent.main), read by apps.cluster (reports, history, rollup, engine_history, selectors).
  A key the agent may leave out is optional (`total=False`), and a value the protocol lets be
  null may be None: unknown is not zero. The keys the protocol requires are `Required`.
- DesiredMessage: built by apps.cluster.reconciler.desired_message; the agent reads its shards
  back through agent.protocol.parse_shard and parse_draining, which refuse what it cannot run.

tests/agent/test_message_types.py holds these to what the agent's sampler sends on the
captured hosts, both ways.
"""

# No `from __future__ import annotations` here: with string annotations, Python computes a
# TypedDict's __required_keys__ without seeing `Required`, and the test reads them.

from typing import Any, Required, TypedDict

__all__ = [
    "DesiredMessage",
    "DesiredShardMessage",
    "DrainingShardMessage",
    "GpuFabric",
    "GpuFigures",
    "GpuProcess",
    "HeartbeatSample",
    "HeldSource",
    "IbPortFigures",
    "ImexNode",
    "ImexState",
    "MirrorState",
    "ShardFigures",
    "StoragePoolFigures",
    "SubnetManager",
    "SubnetManagers",
]


# A heartbeat's sample ----------------------------------------------------------------------


class GpuProcess(TypedDict, total=False):
    """A process holding a context on a card (nvidia-smi's Processes section)."""

    pid: int | None
    name: str | None
    used_memory_mib: int | None
    process_type: str | None  # "C", "G" or "C+G"
    gpu_instance_id: int | None  # on a card in MIG mode, the MIG device it runs in
    compute_instance_id: int | None


class GpuFabric(TypedDict, total=False):
    """A card's NVLink fabric registration (NVSwitch or a multi-node NVLink domain)."""

    state: str | None
    status: str | None
    clique_id: int | None
    cluster_uuid: str | None
    health_summary: str | None
    bandwidth: str | None
    health_faults: list[str] | None


class GpuFigures(TypedDict, total=False):
    """One device of a sample or of a registration's hardware: a card, or a slice of one (a MIG
    device, an AMD partition: `kind`, `parent`). The same shape in both (protocol.GPU)."""

    index: Required[int]
    uuid: str | None
    name: str | None
    architecture: str | None
    gpu_class: str | None
    pci_bus_id: str | None
    memory_total_mib: int | None
    memory_used_mib: int | None
    utilization_gpu_pct: float | None
    utilization_memory_pct: float | None
    sm_clock_mhz: float | None
    temperature_gpu_c: float | None
    temperature_memory_c: float | None
    power_draw_w: float | None
    power_limit_w: float | None
    throttle_reasons: list[str] | None
    ecc_uncorrected_volatile: int | None
    ecc_uncorrected_aggregate: int | None
    retired_pages_pending: bool | None
    remapped_rows_pending: bool | None
    remapped_rows_failure: bool | None
    remapped_rows_uncorrectable: int | None
    pcie_replay_count: int | None
    mig_mode: str | None
    mig_pending: str | None
    vendor: str | None  # "nvidia" or "amd"
    kind: str | None  # "gpu", "mig" or "partition"
    parent: int | None  # a slice's card
    profile: str | None
    device_id: str | None  # what the engine is told to use
    share: float | None  # a slice's share of its card
    split: bool | None
    memory_group: str | None
    fault: str | None  # why the device cannot be trusted now
    gpu_instance_id: int | None
    compute_instance_id: int | None
    temperature_edge_c: float | None
    temperature_junction_c: float | None
    ecc_corrected: int | None
    compute_partition: str | None
    memory_partition: str | None
    processes: list[GpuProcess] | None
    fabric: GpuFabric | None
    xids: dict[str, int] | None  # XID code -> count; {} when the kernel log was read and holds none
    nvlink_errors: dict[str, int] | None
    foreign_processes: int | None  # processes llmgw did not start


class HeldSource(TypedDict, total=False):
    """One source held whole below a model directory, by its path on the node."""

    path: Required[str]
    bytes: int | None


class StoragePoolFigures(TypedDict, total=False):
    """One filesystem that holds model directories."""

    mount_point: Required[str]
    fstype: str | None
    shared: bool | None
    total_bytes: int | None
    free_bytes: int | None
    directories: list[str]
    weights: list[str] | None
    held: list[HeldSource] | None
    partial: list[str]  # directories whose scan stopped at its bounds


class IbPortFigures(TypedDict, total=False):
    """One InfiniBand or RoCE port (agent.fabrics)."""

    device: Required[str]
    port: Required[int]
    fabric: str
    link_layer: str | None
    state: int | None
    state_name: str | None
    phys_state: int | None
    phys_state_name: str | None
    up: bool | None
    rate_gbps: float | None
    lid: int | None
    sm_lid: int | None
    node_guid: str | None
    port_guid: str | None
    sm_guid: str | None
    netdev: str | None
    roce_ip: str | None
    roce_gid_index: int | None
    network: str | None
    xmit_bytes: int | None
    rcv_bytes: int | None
    errors: dict[str, int] | None
    flaps: int | None


class SubnetManager(TypedDict, total=False):
    guid: Required[str]
    lid: int | None
    priority: int | None
    state: int | None
    act_count: int | None


class SubnetManagers(TypedDict, total=False):
    """The subnet managers one port's fabric lists, as seen from that port (`via`)."""

    via: Required[str]
    master: Required[str]
    managers: list[SubnetManager]


class ImexNode(TypedDict, total=False):
    index: Required[int]
    address: str | None
    state: str | None
    version: str | None


class ImexState(TypedDict, total=False):
    """IMEX on a node whose cards are in a multi-node NVLink domain."""

    installed: Required[bool]
    state: str | None
    domain_state: str | None
    configured: bool | None
    nodes: list[ImexNode]
    channels: list[int] | None
    error: str | None


class ShardFigures(TypedDict, total=False):
    """One running engine's process group (agent.supervisor.process_usage) and, for rank 0, its own
    figures in llmgw's names (`engine`, agent.engine_metrics)."""

    shard: Required[str]
    pid: int | None
    processes: int
    memory_bytes: int | None
    cpu_seconds: float
    cpu_cores: float | None  # cores used since the previous sample; absent on the first
    engine: dict[str, float | None] | None


class MirrorState(TypedDict, total=False):
    """One mirror version the node was told to keep (agent.mirror.Mirror.report)."""

    version: Required[int | None]
    dir: Required[str]
    state: Required[str]  # held, fetching, refused, failed
    message: str  # the file being fetched, or why it was refused or failed


class HeartbeatSample(TypedDict, total=False):
    """What a node measures now: the "sample" of a heartbeat (and of a registration)."""

    taken_at: float | None  # the agent's clock, seconds since the epoch
    cpu_utilization_pct: float | None
    cpus: int | None
    load: list[float] | None  # the 1, 5 and 15 minute load averages
    memory_total_bytes: int | None
    memory_available_bytes: int | None
    memory_used_bytes: int | None
    cpu_package_temp_c: float | None
    inlet_temp_c: float | None
    cpu_package_power_w: float | None
    gpus: list[GpuFigures]
    storage: list[StoragePoolFigures]
    ib_ports: list[IbPortFigures]
    subnet_managers: list[SubnetManagers]
    imex: ImexState | None
    shards: list[ShardFigures]
    warnings: list[str]
    mirror: list[MirrorState]


# The "desired" message -----------------------------------------------------------------------


class DesiredShardMessage(TypedDict):
    """agent.protocol.DesiredShard as the control plane sends it (`to_message`): every field."""

    shard: str
    model: str
    engine: str
    source: str
    api_key: str
    port: int
    served_name: str
    gpu_indices: list[int]
    cpu_cores: float
    memory_bytes: int
    context_size: int | None
    parallel: int
    extra_args: list[str]
    env: dict[str, str]
    host: str
    nodes_per_replica: int
    rank: int
    master_addr: str | None
    master_port: int | None
    tensor_parallel: int | None
    pipeline_parallel: int | None
    generation: int
    stop_grace: float | None
    devices: list[str]
    vendor: str


class DrainingShardMessage(TypedDict):
    """agent.protocol.DrainingShard as the control plane sends it (`to_message`)."""

    shard: str
    grace: float
    left: float
    settle: float


class DesiredMessage(TypedDict, total=False):
    """The body of a "desired" message. The engines and mirror versions are read by the agent's
    installer and mirror, which check each item themselves (protocol.DESIRED_ENGINE, DESIRED_MIRROR)."""

    shards: Required[list[DesiredShardMessage]]
    draining: list[DrainingShardMessage]
    engines: list[dict[str, Any]]
    mirror: list[dict[str, Any]]
    generation: int
