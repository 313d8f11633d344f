"""The devices a node offers for placement, as the registration and heartbeats list them.

A device is a whole card (``kind`` "gpu") or a slice of one: a MIG device of an NVIDIA card
(``kind`` "mig") or a compute partition of an AMD card (``kind`` "partition"). Every device is
one entry of the message's ``gpus`` list, with:

- ``index``: a card's is its position on the node (below agent.probes.mig.SLICE_BASE); a slice's
  is ``slice_index(card, number)``, so it names its card even after the slice is gone;
- ``vendor`` ("nvidia", "amd"), ``kind``, ``parent`` (a slice's card), ``profile`` (``1g.10gb``,
  ``cpx.nps4``), ``gpu_class`` (a slice's is its card's and its profile: ``H100-80GB-1g.10gb``);
- ``device_id``: what the engine is told to use (``MIG-…`` in CUDA_VISIBLE_DEVICES, the ROCm index
  in ROCR_VISIBLE_DEVICES); absent for an NVIDIA card, which is told its index as before;
- ``share``: the part of its card a slice has (a 1g of 7 = 1/7), which GPU-hours and power count;
- ``split``: a card cut into slices, never offered whole;
- ``memory_group``: slices that share memory (compute instances of one MIG GPU instance, compute
  partitions of one NUMA memory partition), of which one engine at a time is given one;
- ``fault``: why the device cannot be trusted now (a MIG layout the tools disagree on, a mode
  change waiting for a reset, a partition mode that is not what the node registered): shown, and
  nothing is placed on it.

Pure functions of the probes' reports; no I/O, no Django. Python 3.11+.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agent.probes import amd, mig, nvidia

__all__ = ["amd_devices", "layout_of", "layout_changes", "nvidia_devices"]


def _clean(data: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if value is not None}


def _card(gpu: nvidia.GpuInfo) -> dict[str, Any]:
    data = dataclasses.asdict(gpu)
    data.pop("mig_devices", None)
    for process in data.get("processes") or []:
        process.pop("gpu_instance_id", None)
        process.pop("compute_instance_id", None)
    data["vendor"] = "nvidia"
    data["kind"] = "gpu"
    return _clean(data)


def _mig_slots(gpu: nvidia.GpuInfo, profiles: list[mig.MigProfile] | None) -> int:
    """How many compute slices the card has: its largest GPU instance profile (7g, 4g on an A30)
    where ``mig -lgip`` was read, else 4 on an A30 and 7 on every other MIG card."""
    sizes = [n for p in profiles or () if p.gpu == gpu.index and (n := mig.profile_slices(p.name)) is not None]
    if sizes:
        return max(sizes)
    return 4 if "A30" in (gpu.name or "") else 7


def _mig_slice(
    gpu: nvidia.GpuInfo, device: nvidia.MigDevice, slots: int, fault: str | None, index: int
) -> dict[str, Any]:
    processes = mig.device_processes(gpu, device)
    group = f"{gpu.index}:gi{device.gpu_instance_id}" if device.gpu_instance_id is not None else None
    return _clean(
        {
            "index": index,
            "vendor": "nvidia",
            "kind": "mig",
            "parent": gpu.index,
            "profile": device.profile,
            "name": gpu.name,
            "gpu_class": f"{gpu.gpu_class}-{device.profile}" if gpu.gpu_class and device.profile else None,
            "uuid": device.uuid,
            "device_id": device.uuid,
            "pci_bus_id": gpu.pci_bus_id,
            "memory_total_mib": device.memory_total_mib,
            "memory_used_mib": device.memory_used_mib,
            "ecc_uncorrected_volatile": device.ecc_uncorrected_volatile,
            "share": mig.mig_share(device.profile, slots),
            "memory_group": group,
            "gpu_instance_id": device.gpu_instance_id,
            "compute_instance_id": device.compute_instance_id,
            "process_pids": [
                p.pid
                for p in gpu.processes or []
                if p.pid is not None
                and p.gpu_instance_id == device.gpu_instance_id
                and (p.compute_instance_id is None or p.compute_instance_id == device.compute_instance_id)
            ]
            if processes is not None
            else None,
            "fault": fault or (None if device.uuid and device.profile else "nvidia-smi -L gave no UUID for it"),
        }
    )


def nvidia_devices(
    report: nvidia.GpuReport, listing: mig.MigList | None, profiles: list[mig.MigProfile] | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each card, and each MIG device of a card in MIG mode, as device entries; with warnings
    (a card whose slices cannot be trusted is said once)."""
    problems = mig.merge_mig_list(report, listing) if any(g.mig_mode or g.mig_devices for g in report.gpus) else {}
    devices: list[dict[str, Any]] = []
    warnings: list[str] = []
    for gpu in report.gpus:
        card = _card(gpu)
        enabled = (gpu.mig_mode or "").strip().lower() == "enabled"
        if enabled or gpu.mig_devices:
            card["split"] = True
        fault = problems.get(gpu.index)
        if fault:
            card["fault"] = fault
            warnings.append(f"GPU {gpu.index}: {fault}")
        devices.append(card)
        if not gpu.mig_devices:
            continue
        slots = _mig_slots(gpu, profiles)
        for device in gpu.mig_devices:
            index = mig.slice_index(gpu.index, device.index)
            if index is not None:
                devices.append(_mig_slice(gpu, device, slots, fault, index))
    for index, problem in problems.items():
        if index not in {g.index for g in report.gpus}:
            warnings.append(problem)
    return devices, warnings


# --------------------------------------------------------------------------- AMD


def _card_key(gpu: amd.AmdGpu) -> str:
    """The physical card a device belongs to: its PCI domain, bus and device (partitions differ in
    the function, or share the address and differ in partition id); its own index without one."""
    if gpu.bdf:
        return gpu.bdf.rsplit(".", 1)[0]
    return f"index:{gpu.index}"


def _amd_entry(gpu: amd.AmdGpu, index: int) -> dict[str, Any]:
    return _clean(
        {
            "index": index,
            "vendor": "amd",
            "kind": "gpu",
            "name": gpu.name,
            "gpu_class": gpu.gpu_class,
            "architecture": gpu.gfx,
            "uuid": gpu.uuid,
            "device_id": str(gpu.hip_id if gpu.hip_id is not None else gpu.index),
            "pci_bus_id": gpu.bdf,
            "memory_total_mib": gpu.memory_total_mib,
            "memory_used_mib": gpu.memory_used_mib,
            "utilization_gpu_pct": gpu.utilization_gpu_pct,
            "utilization_memory_pct": gpu.utilization_memory_pct,
            # The one temperature shown beside NVIDIA cards' is the hottest sensor: the junction.
            "temperature_gpu_c": gpu.temperature_junction_c
            if gpu.temperature_junction_c is not None
            else gpu.temperature_edge_c,
            "temperature_edge_c": gpu.temperature_edge_c,
            "temperature_junction_c": gpu.temperature_junction_c,
            "temperature_memory_c": gpu.temperature_memory_c,
            "power_draw_w": gpu.power_draw_w,
            "power_limit_w": gpu.power_limit_w,
            "ecc_uncorrected_volatile": gpu.ecc_uncorrectable,
            "ecc_corrected": gpu.ecc_correctable,
            "compute_partition": gpu.compute_partition,
            "memory_partition": gpu.memory_partition,
        }
    )


def _partition_fault(members: list[amd.AmdGpu]) -> str | None:
    modes = {(g.compute_partition, g.memory_partition) for g in members}
    if len(modes) > 1:
        return "its partitions report different partition modes: " + ", ".join(
            sorted(f"{c or '-'}/{m or '-'}" for c, m in modes)
        )
    compute = members[0].compute_partition
    count = amd.PARTITIONS.get(compute or "")
    if count is None:
        return None if compute is None else f"compute partition mode {compute} is not one llmgw knows"
    if len(members) != count:
        return (
            f"compute partition {compute} makes {count} devices of the card, and the tool lists {len(members)}: "
            "the partitions cannot be told apart"
        )
    ids = [g.partition_id for g in members]
    if None not in ids and len(set(ids)) != len(ids):
        return "two of its partitions report one partition id"
    return None


#: The memory of cards sold with one size, for a card whose partitions each report a part of it
#: (how a partition reports the memory it shares with others in its NUMA memory partition is not
#: the same across drivers, so it is not added up where the card's size is known).
_CARD_MIB = {"MI300X": 192 * 1024, "MI325X": 256 * 1024, "MI350X": 288 * 1024, "MI355X": 288 * 1024}


def _partitioned_memory(first: amd.AmdGpu, members: list[amd.AmdGpu]) -> int | None:
    known = _CARD_MIB.get(amd.amd_class(first.name, None, first.device_id) or "")
    if known is not None:
        return known
    sizes = [g.memory_total_mib for g in members]
    return sum(size for size in sizes if size is not None) if None not in sizes else None


def _partitioned(members: list[amd.AmdGpu], card_index: int) -> list[dict[str, Any]]:
    """A card in a compute partition mode: the card (split, never offered whole) and each
    partition as a slice of it, partitions sharing a memory partition in one memory group."""
    members = sorted(members, key=lambda g: (g.partition_id if g.partition_id is not None else g.index, g.index))
    first = members[0]
    fault = _partition_fault(members)
    compute, memory = first.compute_partition or "", first.memory_partition or ""
    count = max(len(members), 1)
    domains = max(int(memory[3:]) if memory.startswith("NPS") and memory[3:].isdigit() else 1, 1)
    per_domain = max(count // domains, 1)
    card_memory = _partitioned_memory(first, members)
    card_class = amd.amd_class(first.name, card_memory, first.device_id)
    card = _amd_entry(first, card_index)
    card.update(gpu_class=card_class, memory_total_mib=card_memory, split=True, device_id=None)
    for key in ("memory_used_mib", "utilization_gpu_pct", "power_draw_w"):
        card.pop(key, None)  # a partition's reading is not the card's
    readings = [g.power_draw_w for g in members]
    if members and all(r is not None for r in readings):
        card["power_draw_w"] = max(r for r in readings if r is not None)  # each reads the socket's power
    if fault:
        card["fault"] = fault
    devices = [_clean(card)]
    profile = f"{compute.lower()}.{memory.lower()}" if compute and memory else compute.lower() or None
    for number, gpu in enumerate(members):
        index = mig.slice_index(card_index, gpu.partition_id if gpu.partition_id is not None else number)
        if index is None:
            continue
        entry = _amd_entry(gpu, index)
        entry.update(
            kind="partition",
            parent=card_index,
            profile=profile,
            gpu_class=f"{card_class}-{profile}" if card_class and profile else None,
            share=1 / count,
            memory_group=f"{card_index}:mem{number // per_domain}",
        )
        entry.pop("power_draw_w", None)  # the socket's, counted once on the card
        if fault:
            entry["fault"] = fault
        devices.append(_clean(entry))
    return devices


def amd_devices(
    report: amd.AmdReport, rocminfo: amd.RocmInfo | None = None, first_index: int = 0
) -> tuple[list[dict[str, Any]], list[str]]:
    """Each AMD card (from ``first_index`` on, after a node's NVIDIA cards), and each compute
    partition of a partitioned card as a slice of it; with warnings for cards whose partitions
    cannot be trusted. Memory a tool did not give is taken from ``rocminfo``'s agent of the same
    position, where the two list as many GPUs."""
    if rocminfo is not None and len(rocminfo.gpus) == len(report.gpus):
        for gpu, agent in zip(report.gpus, rocminfo.gpus, strict=True):
            if gpu.memory_total_mib is None and agent.memory_kib:
                gpu.memory_total_mib = agent.memory_kib // 1024
                gpu.gpu_class = amd.amd_class(gpu.name or agent.marketing_name, gpu.memory_total_mib, gpu.device_id)
            gpu.gfx = gpu.gfx or agent.name
    cards: dict[str, list[amd.AmdGpu]] = {}
    for gpu in report.gpus:
        cards.setdefault(_card_key(gpu), []).append(gpu)
    devices: list[dict[str, Any]] = []
    warnings: list[str] = []
    for position, members in enumerate(sorted(cards.values(), key=lambda m: min(g.index for g in m))):
        card_index = first_index + position
        if card_index >= mig.SLICE_BASE:
            break
        compute = members[0].compute_partition
        if len(members) == 1 and compute in (None, "SPX"):
            devices.append(_amd_entry(members[0], card_index))
            continue
        entries = _partitioned(members, card_index)
        if "fault" in entries[0]:
            warnings.append(f"AMD GPU {card_index} ({members[0].bdf or '-'}): {entries[0]['fault']}")
        devices += entries
    return devices, warnings


def amd_topology(report: amd.AmdReport, devices: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The links between AMD cards as the registration's gpu_topology has NVLink's: per card its
    XGMI peers and the path to each other card, and its XGMI group (cards joined by XGMI)."""
    by_amd = {
        d["device_id"]: d["index"]
        for d in devices
        if d.get("vendor") == "amd" and d.get("kind") == "gpu" and d.get("device_id") is not None
    }
    cards = {str(g.index): by_amd.get(str(g.hip_id if g.hip_id is not None else g.index)) for g in report.gpus}
    if not report.links or not cards:
        return None
    peers: dict[int, dict[str, Any]] = {}
    for link in report.links:
        a, b = cards.get(link.a), cards.get(link.b)
        if a is None or b is None:
            continue
        for one, other in ((a, b), (b, a)):
            entry = peers.setdefault(one, {"index": one, "links": {}, "paths": {}})
            entry["paths"][str(other)] = link.kind[:16]
            if link.kind == "XGMI":
                entry["links"][str(other)] = 1
    groups = _groups({i: [int(k) for k in e["links"]] for i, e in peers.items()})
    gpus = []
    for index in sorted(peers):
        entry = peers[index]
        entry["group"] = groups.get(index)
        entry["link_kind"] = "XGMI"
        gpus.append(entry)
    return {"gpus": gpus[:256], "nics": []}


def _groups(adjacent: dict[int, list[int]]) -> dict[int, str]:
    """Cards joined by links, directly or through others, share a group named by its lowest card."""
    group: dict[int, str] = {}
    for start in sorted(adjacent):
        if start in group or not adjacent[start]:
            continue
        seen, stack = {start}, [start]
        while stack:
            for peer in adjacent.get(stack.pop(), []):
                if peer not in seen:
                    seen.add(peer)
                    stack.append(peer)
        for member in seen:
            group[member] = f"xgmi{min(seen)}"
    return group


# --------------------------------------------------------------------------- layout


def layout_of(devices: list[dict[str, Any]]) -> dict[int, str]:
    """Per card index, what its layout is: whether it is split and into which slices (their
    profiles and device ids). Two reads of one node with different layouts mean an operator
    changed MIG or partition modes between them."""
    out: dict[int, list[str]] = {}
    for device in devices:
        parent = device.get("parent")
        card = device["index"] if parent is None else parent
        mode = "/".join(str(device.get(k) or "-") for k in ("mig_mode", "compute_partition", "memory_partition"))
        if parent is None:
            out.setdefault(card, []).insert(0, f"{device.get('uuid') or device['index']}:{mode}")
        else:
            out.setdefault(card, []).append(f"{device['index']}={device.get('profile')}@{device.get('device_id')}")
    return {card: ";".join(parts) for card, parts in out.items()}


def layout_changes(registered: dict[int, str], now: dict[int, str]) -> dict[int, str]:
    """Per card whose layout is not the one registered, what changed, in words."""
    changes: dict[int, str] = {}
    for card in sorted(set(registered) | set(now)):
        before, after = registered.get(card), now.get(card)
        if before == after:
            continue
        if before is None:
            changes[card] = "the card appeared after the node registered"
        elif after is None:
            changes[card] = "the card is gone since the node registered"
        else:
            changes[card] = (
                f"its MIG or partition layout changed since the node registered ({_slices(before)} slices then, "
                f"{_slices(after)} now): the agent registers again"
            )
    return changes


def _slices(layout: str) -> int:
    return max(layout.count(";"), 0)
