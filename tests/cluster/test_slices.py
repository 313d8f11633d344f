"""MIG slices and AMD cards through the control plane: a node registered with the devices its agent
makes of real captures, placement on a slice, the shard told the slice's UUID (or the AMD device's
ROCm index), and a device the agent says cannot be trusted never placed on."""

from __future__ import annotations

from typing import Any

import pytest

from agent.devices import amd_devices, nvidia_devices
from agent.engines import device_env, parse_shard
from agent.probes import amd, mig, nvidia
from apps.cluster import enrolment, reports
from apps.cluster.inventory import build_inventory
from apps.cluster.models import Gpu, Node, Replica
from apps.cluster.reconciler import desired_shards, reconcile
from tests.agent.fixturefiles import fixture_text
from tests.builders import make_model, make_node

pytestmark = pytest.mark.django_db

UUID_2 = "MIG-00000002-0000-0000-0000-000000000002"


def mig_devices() -> list[dict[str, Any]]:
    report = nvidia.parse_nvidia_smi_text(fixture_text("nvidia-smi-q", "h100-mig-enabled-drv590-idle-masked.txt"))
    listing = mig.parse_mig_list(
        fixture_text("nvidia-smi-mig-list", "L-h100-80gb-hbm3-4mig-3g40-2g20-1g10x2-drv590-masked.txt")
    )
    devices, _ = nvidia_devices(report, listing)
    for device in devices:
        device["foreign_processes"] = len(device.pop("process_pids", None) or [])
    return devices


def mi300x_devices() -> list[dict[str, Any]]:
    monitor = amd.parse_amd_smi_text(fixture_text("amd-smi-text", "monitor-ptumv-8gpu-mi300x-idle-changelog.txt"))
    static = amd.AmdReport(gpus=[amd.AmdGpu(index=i, name="AMD Instinct MI300X") for i in range(8)])
    devices, _ = amd_devices(amd.merge_reports(static, monitor))
    return devices


def register(name: str, devices: list[dict[str, Any]], **hardware: Any) -> Node:
    node = make_node(name, gpus=0, engines=("vllm", "llama.cpp"))
    body = {
        "agent_version": "0.1.0",
        "hardware": {
            "cpus": 64,
            "memory_total_bytes": 512 * 1024**3,
            "engines": ["vllm", "llama.cpp"],
            "gpus": devices,
            **hardware,
        },
        "sample": {"gpus": devices},
    }
    return enrolment.register_node(node.pk, body)


def test_a_slice_profile_runs_on_a_slice_and_its_engine_is_told_the_slice_s_uuid() -> None:
    node = register("h100-mig", mig_devices())
    rows = {g.index: g for g in Gpu.objects.filter(node=node)}
    assert rows[0].split and rows[0].kind == "gpu"
    assert (rows[1002].kind, rows[1002].parent_index, rows[1002].device_id) == ("mig", 0, UUID_2)
    assert rows[1002].label == "GPU 0 MIG 2 (1g.10gb)" and rows[1002].share == pytest.approx(1 / 7)
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1, replicas=2)
    make_model("whole", accelerators=("H100-80GB",), gpus=1, replicas=1)
    reconcile()
    small = Replica.objects.filter(model__name="small").prefetch_related("shards")
    assert sorted(r.shards.get().gpu_indices[0] for r in small) == [1002, 1003]
    whole = Replica.objects.get(model__name="whole")
    assert whole.state == "pending" and not whole.shards.exists()
    assert any("1 of them are split into slices" in r["message"] for r in whole.rejections)
    shard = parse_shard(next(s for s in desired_shards(node) if s["gpu_indices"] == [1002]))
    assert shard.devices == [UUID_2] and shard.vendor == "nvidia"
    assert device_env(shard) == {"CUDA_VISIBLE_DEVICES": UUID_2}


def test_an_amd_card_is_given_to_a_build_that_drives_it_and_told_its_rocm_index() -> None:
    node = register("mi300x", mi300x_devices(), engine_builds={"llama.cpp": "cpu-x64", "vllm": "rocm700"})
    assert set(Gpu.objects.filter(node=node).values_list("gpu_class", flat=True)) == {"MI300X-192GB"}
    make_model("on-llama", accelerators=("MI300X-192GB",), gpus=1, engine="llama.cpp")
    make_model("on-vllm", accelerators=("MI300X-192GB",), gpus=2)
    reconcile()
    refused = Replica.objects.get(model__name="on-llama")
    assert refused.state == "pending"
    assert any(
        "runs the cpu-x64 build of llama.cpp, which cannot drive MI300X-192GB (AMD)" in r["message"]
        for r in refused.rejections
    )
    placed = Replica.objects.get(model__name="on-vllm").shards.get()
    shard = parse_shard(next(s for s in desired_shards(node) if s["gpu_indices"] == placed.gpu_indices))
    assert (shard.devices, shard.vendor) == (["0", "1"], "amd")
    assert device_env(shard) == {
        "ROCR_VISIBLE_DEVICES": "0,1",
        "HIP_VISIBLE_DEVICES": "0,1",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "GGML_VK_VISIBLE_DEVICES": "0,1",
    }


def test_a_device_its_agent_cannot_trust_is_shown_with_why_and_never_placed_on() -> None:
    devices = mig_devices()
    why = "nvidia-smi -L lists 3 MIG device(s) on GPU 0, -q describes 4"
    for device in devices:
        device["fault"] = why
    node = register("h100-mig", devices)
    assert set(Gpu.objects.filter(node=node).values_list("fault", flat=True)) == {why}
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1)
    reconcile()
    replica = Replica.objects.get(model__name="small")
    assert replica.state == "pending"
    assert any(f"GPU 0 MIG 2 (1g.10gb) cannot be trusted now: {why}" in r["message"] for r in replica.rejections)
    # The next heartbeat says the layout is whole again: the rows are healthy and the slice is placed.
    health = reports.sample_health({"gpus": mig_devices()})
    reports.write_gpu_health(node.pk, health, reports.sample_health({"gpus": devices}))
    assert not Gpu.objects.filter(node=node).exclude(fault="").exists()
    assert build_inventory().free_count(node.pk, "H100-80GB-1g.10gb") == 2
