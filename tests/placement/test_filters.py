"""Each built-in filter's refusal, in words and with its numbers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from apps.cluster.placement import (
    CapacityQuota,
    Claim,
    Inventory,
    NodeSnapshot,
    ProfileSpec,
    Registry,
    ReplicaRequest,
    explain,
    place,
)

from .builders import A100, GIB, H100, L40S, cpu_node, cpu_profile, gpu_node, gpu_profile, req

CASES = [
    pytest.param(
        gpu_node(1, "n1", ready=False, status="no heartbeat for 5 min"),
        gpu_profile(),
        [],
        "not_ready",
        "node n1 is not ready (no heartbeat for 5 min)",
        id="not-ready",
    ),
    pytest.param(
        gpu_node(1, "n1", ready=False),
        gpu_profile(),
        [],
        "not_ready",
        "node n1 is not ready (unknown)",
        id="not-ready-no-status",
    ),
    pytest.param(
        gpu_node(1, "n1", ready=False, extra={"status": "offline"}),
        gpu_profile(),
        [],
        "not_ready",
        "node n1 is not ready (offline)",
        id="not-ready-status-in-extra",
    ),
    pytest.param(
        gpu_node(1, "n1", cordoned=True, cordon_reason="ECC errors on GPU 3"),
        gpu_profile(),
        [],
        "cordoned",
        "node n1 is cordoned: ECC errors on GPU 3",
        id="cordoned",
    ),
    pytest.param(
        gpu_node(1, "n1", labels={"pool": "chat"}),
        gpu_profile(selector={"pool": "coding"}),
        [],
        "label",
        "node n1 lacks label pool=coding",
        id="selector",
    ),
    pytest.param(
        gpu_node(1, "n1", gpu_class=A100),
        gpu_profile(gpu_class=H100),
        [],
        "gpu_class",
        "node n1 has no H100-80GB GPUs (it has A100-80GB)",
        id="gpu-class",
    ),
    pytest.param(
        cpu_node(1, "n1"),
        gpu_profile(gpu_class=L40S),
        [],
        "gpu_class",
        "node n1 has no L40S-48GB GPUs (it has none)",
        id="gpu-class-on-cpu-node",
    ),
    pytest.param(
        gpu_node(1, "n1", gpus=8, unhealthy=(0, 1), claimed={2: "other"}),
        gpu_profile(gpus=6),
        [],
        "gpus",
        "node n1 has 5 free healthy H100-80GB GPUs, needs 6",
        id="free-gpus",
    ),
    pytest.param(
        gpu_node(1, "n1", gpus=4),
        gpu_profile(gpus=2),
        [Claim("old", 0, 1, (0, 1, 3), 0, 0, (), "standard", "x", False)],
        "gpus",
        "node n1 has 1 free healthy H100-80GB GPUs, needs 2",
        id="free-gpus-claims",
    ),
    pytest.param(
        cpu_node(1, "n1", memory_gb=8),
        cpu_profile(memory_gb=24),
        [],
        "memory",
        "node n1 has 8 GB of memory free of 8, needs 24",
        id="memory",
    ),
    pytest.param(
        cpu_node(1, "n1", memory_gb=31),
        cpu_profile(memory_gb=16),
        [Claim("old", 0, 1, (), 16 * GIB, 0, (), "standard", "x", False)],
        "memory",
        "node n1 has 15 GB of memory free of 31, needs 16",
        id="memory-owed",
    ),
    pytest.param(
        cpu_node(1, "n1", cpus=16),
        cpu_profile(cores=8),
        [Claim("old", 0, 1, (), 0, 9.5, (), "standard", "x", False)],
        "cpu",
        "node n1 has 6.5 of 16 CPU cores free, needs 8",
        id="cores",
    ),
    pytest.param(
        gpu_node(1, "n1", engines=frozenset({"llama.cpp"})),
        gpu_profile(engine="vllm"),
        [],
        "engine",
        "node n1 does not run the vllm engine",
        id="engine",
    ),
    pytest.param(
        gpu_node(1, "n1"),
        gpu_profile(nodes=2),
        [],
        "fabric",
        "node n1 is on no fabric, and a replica across 2 nodes needs one",
        id="fabric",
    ),
]


@pytest.mark.parametrize(("node", "profile", "claims", "code", "message"), CASES)
def test_filter_reason(node: NodeSnapshot, profile: ProfileSpec, claims: list[Claim], code: str, message: str) -> None:
    inventory = Inventory({node.id: node}, claims)
    result = place(inventory, req(profile))
    assert result.placement is None
    node_reasons = [r for r in result.rejections if r.node_id == node.id]
    assert [(r.code, r.message) for r in node_reasons] == [(code, message)]
    rejection = node_reasons[0]
    assert rejection.node_name == node.name
    assert rejection.profile_id == profile.id
    assert rejection.template % rejection.params == rejection.message
    summary = result.rejections[-1]
    assert summary.node_id is None and summary.code in {"no_fit", "no_fabric"}


def test_no_fit_summary_counts_nodes() -> None:
    inventory = Inventory({1: gpu_node(1, "a", gpu_class=A100), 2: gpu_node(2, "b", gpus=1)})
    result = place(inventory, req(gpu_profile(gpus=2, name="2xH100")))
    assert result.rejections[-1].message == "no node can take profile 2xH100: 2 of 2 nodes refused it"


@pytest.mark.parametrize(
    ("quota", "profile", "message"),
    [
        (CapacityQuota(gpus=8), gpu_profile(gpus=4), "quota of team:3: 6 of 8 GPUs in use, needs 4 more"),
        (
            CapacityQuota(cpu_cores=10),
            gpu_profile(gpus=1, cores=6),
            "quota of team:3: 6 of 10 CPU cores in use, needs 6 more",
        ),
        (
            CapacityQuota(memory_bytes=64 * GIB),
            gpu_profile(gpus=1, memory_gb=40),
            "quota of team:3: 30 of 64 GB of memory in use, needs 40 more",
        ),
        (CapacityQuota(replicas=1), gpu_profile(gpus=1), "quota of team:3: 1 of 1 replicas in use, needs 1 more"),
        (CapacityQuota(gpus=16), gpu_profile(gpus=6, nodes=2), "quota of team:3: 6 of 16 GPUs in use, needs 12 more"),
    ],
)
def test_quota_reason(quota: CapacityQuota, profile: ProfileSpec, message: str) -> None:
    nodes = {i: gpu_node(i, memory_gb=512, cpus=64, fabric="ib-a") for i in (1, 2, 3)}
    claims = [Claim("old", 0, 1, tuple(range(6)), 30 * GIB, 6, ("org:1", "team:3"), "standard", "x", False)]
    inventory = Inventory(nodes, claims, {"team:3": quota, "org:1": CapacityQuota()})
    result = place(inventory, req(profile, owner=("org:1", "team:3")))
    assert result.placement is None
    assert [r.message for r in result.rejections] == [message]
    assert result.rejections[0].node_id is None


def test_quota_none_is_unlimited_and_other_owners_do_not_count() -> None:
    nodes = {1: gpu_node(1)}
    claims = [Claim("old", 0, 1, (0, 1), 0, 0, ("team:9",), "standard", "x", False)]
    inventory = Inventory(nodes, claims, {"team:3": CapacityQuota(gpus=2, cpu_cores=None), "team:9": CapacityQuota()})
    assert place(inventory, req(gpu_profile(gpus=2), owner=("team:3",))).placement is not None
    assert place(inventory, req(gpu_profile(gpus=3), owner=("team:3",))).placement is None


def test_fabric_count_reason() -> None:
    nodes = {
        1: gpu_node(1, "a", fabric="ib-a"),
        2: gpu_node(2, "b", fabric="ib-b"),
        3: gpu_node(3, "c", fabric="ib-b", gpus=2),
    }
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2, name="2x4")))
    assert result.placement is None
    messages = [r.message for r in result.rejections if r.node_id is None]
    assert messages == [
        "only 1 nodes of fabric ib-a can take a shard, needs 2",
        "only 1 nodes of fabric ib-b can take a shard, needs 2",
        "no fabric has 2 nodes that can take a shard of profile 2x4 (2 fabrics tried)",
    ]
    assert [r.message for r in result.rejections if r.node_id == 3] == [
        "node c has 2 free healthy H100-80GB GPUs, needs 4"
    ]


def test_templates_are_literal_gettext_noop_calls() -> None:
    """makemessages extracts only literal gettext_noop("...") calls: every Reason template must be one."""
    source = Path(__file__).resolve().parents[2] / "apps/cluster/placement/reasons.py"
    tree = ast.parse(source.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "gettext_noop"]
    assert len(calls) >= 17
    for call in calls:
        assert len(call.args) == 1 and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Reason":
            assert isinstance(node.args[1], ast.Call) and node.args[1].func.id == "gettext_noop"  # type: ignore[attr-defined]


def test_placement_imports_no_django() -> None:
    root = Path(__file__).resolve().parents[2] / "apps/cluster/placement"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            assert not any(n.split(".")[0] in {"django", "rest_framework"} or n.startswith("apps.") for n in names), (
                path.name,
                names,
            )


MIRROR = "/data/models/mirror/acme--tiny-GGUF/" + "c" * 40
SOURCE = MIRROR + "/tiny-F32.gguf"


def _weights_reasons(node: NodeSnapshot, registry: Registry | None = None) -> list[str]:
    profile = cpu_profile(cores=1)
    request = ReplicaRequest(model="tiny", profiles=[profile], source=SOURCE)
    [verdict] = explain(Inventory({1: node}), request, registry=registry)
    return [r.message for r in verdict.nodes[0].reasons]


def test_a_node_that_refused_or_failed_to_fetch_the_weights_is_refused_with_its_reason() -> None:
    """The node's own word on the mirror's version wins over the directories it reports: one that
    refused the fetch (its model_dirs do not hold the directory) reports no weight dirs there."""
    refused = cpu_node(1, "vm", weight_dirs=frozenset({"/srv/models"}), fetches={MIRROR: ("refused", "outside")})
    assert _weights_reasons(refused) == [f"node vm refused to fetch {SOURCE}: outside"]
    failed = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}), fetches={MIRROR: ("failed", "digest")})
    assert _weights_reasons(failed) == [f"node vm could not fetch {SOURCE}: digest"]
    fetching = cpu_node(
        1, "vm", weight_dirs=frozenset({"/data/models"}), fetches={MIRROR: ("fetching", "tiny-F32.gguf")}
    )
    assert _weights_reasons(fetching) == [f"{SOURCE} is not on node vm yet: it is fetching tiny-F32.gguf"]
    missing = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}))
    assert _weights_reasons(missing) == [f"{SOURCE} is not on node vm"]
    held = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}), weights=frozenset({SOURCE}))
    assert _weights_reasons(held) == []
    # A directory whose scan stopped at its bound says nothing of what it did not look at.
    partial = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}), partial_dirs=frozenset({"/data/models"}))
    assert _weights_reasons(partial) == []
    # Unknown is not refused: a node that reports no model directories, and no word on the fetch.
    assert _weights_reasons(cpu_node(1, "vm")) == []


def test_before_a_node_is_told_to_fetch_only_a_source_outside_its_model_dirs_is_refused() -> None:
    from apps.cluster.placement import REGISTRY
    from apps.cluster.placement.filters import weights_can_arrive

    registry = REGISTRY.copy()
    registry.register_filter(weights_can_arrive, name="weights", order=75)
    inside = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}))
    assert _weights_reasons(inside, registry) == []  # it will fetch it
    outside = cpu_node(1, "vm", weight_dirs=frozenset({"/srv/a", "/srv/b"}))
    assert _weights_reasons(outside, registry) == [
        f"node vm would refuse to fetch {SOURCE}: it keeps models only in /srv/a, /srv/b (its agent.yaml's model_dirs)"
    ]
    refused = cpu_node(1, "vm", weight_dirs=frozenset({"/data/models"}), fetches={MIRROR: ("refused", "why")})
    assert _weights_reasons(refused, registry) == [f"node vm refused to fetch {SOURCE}: why"]
    assert _weights_reasons(cpu_node(1, "vm"), registry) == []
