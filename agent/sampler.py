"""What a node is and how busy it is, from the probes.

Every probe runs on its own: one that fails or meets output it does not understand adds
a warning and leaves its figures out. Nothing here raises, because a dead agent tells the
operator less than a partial sample with a warning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import socket
import time
from collections.abc import Callable
from typing import Any, cast

from agent import devices as gpu_devices
from agent import protocol
from agent.config import AgentConfig
from agent.fabrics import FabricWatcher
from agent.messages import (
    GpuFigures,
    HeartbeatSample,
    HeldSource,
    IbPortFigures,
    ImexState,
    StoragePoolFigures,
    SubnetManagers,
)
from agent.probes import amd, hwmon, mig, nvidia, nvlink, procfs, rapl, storage, xid
from agent.runner import CommandRunner

__all__ = ["Sampler"]

log = logging.getLogger("llmgw.agent")

#: What `rocm-smi --json` is asked for where amd-smi is missing (one call; the partitions are
#: asked by name, as `-a` leaves them out on some versions).
ROCM_SMI_ARGS = (
    "--showid",
    "--showproductname",
    "--showbus",
    "--showuniqueid",
    "--showtemp",
    "--showuse",
    "--showmemuse",
    "--showpower",
    "--showmaxpower",
    "--showmeminfo",
    "vram",
    "--showtopo",
    "--showdriverversion",
)
MAX_HELD = 4096  # sources one storage pool reports (the protocol's bound); past it the pool is partial
GPU_INTERVAL_S = 10.0  # the default of agent.yaml's sample_interval: a sample is taken at most this often


def _read(root: str, relative: str) -> str | None:
    try:
        with open(os.path.join(root, relative.lstrip("/")), encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _gpu_dict(gpu: nvidia.GpuInfo) -> dict[str, Any]:
    data = dataclasses.asdict(gpu)
    data.pop("mig_devices", None)  # each MIG device is a device of its own (agent.devices)
    # Keep the message small and free of Nones the server would only store.
    return {key: value for key, value in data.items() if value is not None}


def _rocm_version(root: str) -> str | None:
    """The ROCm release installed (``/opt/rocm/.info/version``: "6.3.1-48"), None without one."""
    text = (_read(root, "opt/rocm/.info/version") or "").strip()
    return text.split()[0][:32] if text else None


def _in_domain(fabric: nvidia.FabricInfo | None) -> bool:
    """Whether a card reports a multi-node NVLink domain (a non-zero ClusterUUID)."""
    return fabric is not None and not nvlink.zero_cluster_uuid(fabric.cluster_uuid)


class Sampler:
    def __init__(
        self,
        config: AgentConfig,
        runner: CommandRunner | None = None,
        managed_pids: Callable[[], set[int]] | None = None,
    ) -> None:
        self.config = config
        self.root = config.root
        self.runner = runner or CommandRunner(config.tools)
        self.managed_pids = managed_pids or (lambda: set())
        self._prev_stat: procfs.CpuTimes | None = None
        self._prev_rapl: rapl.RaplSample | None = None
        self._last_sample: HeartbeatSample | None = None
        self._last_sample_at = 0.0
        self._slow_at = 0.0
        self._nvlink: dict[int, dict[str, int]] = {}
        self._xids: dict[str, dict[int, int]] = {}
        self._xids_read = False  # whether the kernel log was read: then a card without XIDs has none
        self._has_nvidia: bool | None = None
        self._has_amd: bool | None = None
        self._amd_static: amd.AmdReport | None = None
        self._amd_links: amd.AmdReport | None = None  # amd-smi topology, as read
        self._amd_merged: amd.AmdReport | None = None  # the last read of every AMD tool, joined
        self._rocminfo: amd.RocmInfo | None = None
        self._mig_profiles: list[mig.MigProfile] | None = None
        # Per card, its MIG or partition layout as the node registered it (agent.devices.layout_of);
        # a sample whose layout differs marks the changed cards untrusted and asks to register again.
        self._layout: dict[int, str] | None = None
        self.layout_changed: dict[int, str] = {}
        self._layout_note: dict[str, Any] | None = None
        self._imex: ImexState | None = None
        self.fabrics = FabricWatcher(
            self.root,
            config.fabrics,
            self.runner,
            check_interval=config.fabric_check_interval,
            change_interval=config.fabric_change_interval,
        )

    # Registration ---------------------------------------------------------------------

    async def hardware(self) -> tuple[dict[str, Any], list[str]]:
        warnings: list[str] = []
        cpu = procfs.parse_cpuinfo(_read(self.root, "proc/cpuinfo") or "")
        warnings += cpu.warnings
        avx = procfs.avx_warning(cpu)
        if avx:
            warnings.append(avx)
        mem = procfs.parse_meminfo(_read(self.root, "proc/meminfo") or "")
        warnings += mem.warnings
        hardware: dict[str, Any] = {
            "hostname": self.config.hostname or socket.gethostname(),
            "cpu_model": cpu.model,
            "cpus": cpu.logical_cpus,
            "sockets": cpu.sockets,
            "cpu_flags": sorted(cpu.flags) if cpu.flags else None,
            "has_avx2": cpu.has_avx2,
            "has_avx512": cpu.has_avx512,
            "os": self._os_name(),
            "kernel": (_read(self.root, "proc/sys/kernel/osrelease") or "").strip() or None,
            "arch": cpu.architecture if self.root != "/" and cpu.architecture else platform.machine() or None,
            "memory_total_bytes": mem.total_bytes,
        }
        report = await self._gpu_report(warnings)
        hardware["driver_version"] = report.driver_version if report else None
        hardware["cuda_version"] = report.cuda_version if report else None
        devices = await self._devices(report, warnings, registering=True)
        hardware["gpus"] = [self._registered(d) for d in devices]
        if report is not None and report.gpus:
            hardware["gpu_topology"] = await self._gpu_topology(warnings)
        elif self._amd_merged is not None and devices:
            hardware["gpu_topology"] = gpu_devices.amd_topology(self._amd_merged, devices)
        if self._mig_profiles:
            hardware["mig_profiles"] = [
                {"gpu": p.gpu, "name": p.name, "free": p.free, "total": p.total, "memory_gib": p.memory_gib}
                for p in self._mig_profiles[:256]
            ]
        if self._has_amd:
            hardware["rocm_version"] = _rocm_version(self.root)
            hardware["amd_driver_version"] = self._amd_static.driver_version if self._amd_static else None
        self._layout = gpu_devices.layout_of(devices)
        self.layout_changed = {}
        if self._layout_note is not None:
            hardware["gpu_layout_changed"] = self._layout_note
        return {k: v for k, v in hardware.items() if v is not None or k == "gpus"}, warnings

    def _os_name(self) -> str | None:
        text = _read(self.root, "etc/os-release") or ""
        for line in text.splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"') or None
        return None

    # Heartbeats -------------------------------------------------------------------------

    async def sample(self, *, force: bool = False) -> HeartbeatSample:
        now = time.monotonic()
        if not force and self._last_sample is not None and now - self._last_sample_at < self.config.sample_interval:
            return self._last_sample
        warnings: list[str] = []
        sample: HeartbeatSample = {"taken_at": time.time()}
        self._cpu_and_memory(sample, warnings)
        self._temperatures(sample, warnings)
        # Off the event loop: a model directory on a slow filer, or GGUF headers read for the first
        # time, must not hold up the agent's websocket.
        await asyncio.to_thread(self._storage, sample, warnings)
        try:
            ports, managers = await self.fabrics.sample(warnings)
            # agent.fabrics builds them for its own "fabrics" message too, in the same shapes.
            if ports:
                sample["ib_ports"] = cast(list[IbPortFigures], ports)
            if managers:
                sample["subnet_managers"] = cast(list[SubnetManagers], managers)
        except Exception as exc:
            log.exception("reading the InfiniBand ports failed")
            warnings.append(f"InfiniBand ports could not be read: {exc}")
        report = await self._gpu_report(warnings)
        slow = now - self._slow_at >= self.config.gpu_check_interval
        if report is not None and slow:
            await self._slow_gpu_checks(report, warnings)
        if slow:
            self._slow_at = now
        devices = await self._devices(report, warnings, registering=False, refresh=slow)
        if report is not None or devices:
            sample["gpus"] = self._gpus(report, self._check_layout(devices, warnings))
            if self._imex is not None:
                sample["imex"] = self._imex
        sample["warnings"] = warnings
        self._last_sample, self._last_sample_at = sample, now
        return sample

    def _cpu_and_memory(self, sample: HeartbeatSample, warnings: list[str]) -> None:
        try:
            stat = procfs.parse_proc_stat(_read(self.root, "proc/stat") or "")
            warnings += stat.warnings
            if stat.per_cpu:
                sample["cpus"] = stat.per_cpu
            if self._prev_stat is not None:
                util = procfs.cpu_utilisation(self._prev_stat, stat)
                if util is not None:
                    sample["cpu_utilization_pct"] = round(util, 2)
            self._prev_stat = stat
            load = procfs.parse_load_average(_read(self.root, "proc/loadavg") or "")
            warnings += load.warnings
            if load.values is not None:  # the protocol takes all three averages or none
                sample["load"] = list(load.values)
            mem = procfs.parse_meminfo(_read(self.root, "proc/meminfo") or "")
            warnings += mem.warnings
            if mem.total_bytes is not None:
                sample["memory_total_bytes"] = mem.total_bytes
            if mem.available_bytes is not None:
                sample["memory_available_bytes"] = mem.available_bytes
                if mem.total_bytes is not None:
                    sample["memory_used_bytes"] = mem.total_bytes - mem.available_bytes
        except Exception as exc:  # a parser bug must cost a figure, not the agent
            log.exception("reading /proc failed")
            warnings.append(f"/proc could not be read: {exc}")

    def _temperatures(self, sample: HeartbeatSample, warnings: list[str]) -> None:
        try:
            temps = hwmon.read_hwmon(self.root)
            if temps.cpu_package_c is not None:
                sample["cpu_package_temp_c"] = temps.cpu_package_c
            if temps.inlet_c is not None:
                sample["inlet_temp_c"] = temps.inlet_c
        except Exception as exc:
            log.exception("reading hwmon failed")
            warnings.append(f"hwmon could not be read: {exc}")
        try:
            current = rapl.read_rapl(self.root)
            if self._prev_rapl is not None:
                watts = rapl.package_power_w(self._prev_rapl, current)
                if watts:
                    sample["cpu_package_power_w"] = round(sum(watts.values()), 2)
            self._prev_rapl = current
        except Exception as exc:
            log.exception("reading RAPL failed")
            warnings.append(f"RAPL could not be read: {exc}")

    def _storage(self, sample: HeartbeatSample, warnings: list[str]) -> None:
        if not self.config.model_dirs:
            return  # told to look nowhere: report nothing, which reads as unknown
        try:
            mounts = storage.parse_mountinfo(_read(self.root, "proc/self/mountinfo") or "")
            pools = storage.storage_pools(self.config.model_dirs, mounts)
            sample["storage"] = [self._pool(pool, warnings) for pool in pools]
        except Exception as exc:
            log.exception("reading storage failed")
            warnings.append(f"storage could not be read: {exc}")

    @staticmethod
    def _pool(pool: storage.StoragePool, warnings: list[str]) -> StoragePoolFigures:
        """One storage pool as the sample gives it: each source held whole below its directories,
        by its path on this node (what a model's source names), and the directories whose scan
        stopped at its bounds (`partial`: a source not listed in one may still be there)."""
        held: dict[str, HeldSource] = {}
        partial = []
        for directory in pool.directories:
            scan = storage.scan_weights(directory)
            if not scan.complete:
                partial.append(directory)
                warnings.append(f"model directory {directory}: {scan.stopped}")
            for entry in storage.weights_held(directory, scan):
                held.setdefault(entry["path"], entry)  # a directory inside another names it once
        entries = [held[path] for path in sorted(held)]
        if len(entries) > MAX_HELD:
            warnings.append(
                f"storage pool {pool.mount_point or '-'}: {len(entries)} models held; the first {MAX_HELD} are reported"
            )
            entries = entries[:MAX_HELD]
            partial = list(pool.directories)
        out: StoragePoolFigures = {
            "mount_point": pool.mount_point or "",
            "fstype": pool.fstype,
            "shared": pool.shared,
            "total_bytes": pool.total_bytes,
            "free_bytes": pool.free_bytes,
            "directories": pool.directories,
            "weights": [entry["path"] for entry in entries],
            "held": entries,
        }
        if partial:
            out["partial"] = partial
        return out

    # GPUs --------------------------------------------------------------------------------

    async def _gpu_report(self, warnings: list[str]) -> nvidia.GpuReport | None:
        if self._has_nvidia is False:
            return None
        result = await self.runner.run("nvidia-smi", "-q", "-x")
        if result.returncode is None and "No such file" in result.stderr:
            self._has_nvidia = False  # no NVIDIA driver here: a CPU node, nothing to warn about
            return None
        report: nvidia.GpuReport | None = None
        try:
            if result.stdout.strip():
                report = nvidia.parse_nvidia_smi_xml(result.stdout)
            if report is None or (not report.gpus and report.warnings):
                text = await self.runner.run("nvidia-smi", "-q")
                if text.stdout.strip():
                    report = nvidia.parse_nvidia_smi_text(text.stdout)
        except Exception as exc:
            log.exception("parsing nvidia-smi failed")
            warnings.append(f"nvidia-smi output could not be read: {exc}")
            return None
        if report is None:
            warnings.append(f"nvidia-smi gave no report: {(result.stderr or 'no output').strip()[:200]}")
            return None
        self._has_nvidia = True
        warnings += [f"nvidia-smi: {w}" for w in report.warnings]
        return report

    async def _gpu_topology(self, warnings: list[str]) -> dict[str, Any] | None:
        """`nvidia-smi topo -m`: which cards are linked, their NUMA nodes and closest adapters."""
        try:
            result = await self.runner.run("nvidia-smi", "topo", "-m")
            if not result.ok:
                warnings.append(f"nvidia-smi topo -m could not be read: {(result.stderr or 'no output').strip()[:200]}")
                return None
            topology = nvlink.parse_topo_matrix(result.stdout)
        except Exception as exc:
            log.exception("parsing nvidia-smi topo -m failed")
            warnings.append(f"nvidia-smi topo -m could not be read: {exc}")
            return None
        warnings += [f"nvidia-smi topo -m: {w}" for w in topology.warnings]
        if not topology.gpus:
            return None
        groups = nvlink.nvlink_groups(topology)
        gpus = []
        for gpu in topology.gpus:
            entry: dict[str, Any] = {
                "index": gpu.index,
                "group": groups.get(gpu.index),
                "links": {str(k): v for k, v in gpu.links.items()},
                "paths": {str(k): v[:16] for k, v in gpu.paths.items()},
                "nics": {k[:16]: v[:16] for k, v in gpu.nics.items()},
                "nearest_nics": [n[:64] for n in gpu.nearest_nics],
                "nearest_path": gpu.nearest_path,
                "numa_node": gpu.numa_node,
                "cpu_affinity": gpu.cpu_affinity[:400] if gpu.cpu_affinity else None,
            }
            gpus.append(entry)
        return {"gpus": gpus[:256], "nics": [n[:64] for n in topology.nics][:256]}

    async def _read_imex(self, report: nvidia.GpuReport, warnings: list[str]) -> ImexState | None:
        """IMEX, on a node whose cards are in a multi-node NVLink domain (None elsewhere: not asked)."""
        if not any(_in_domain(gpu.fabric) for gpu in report.gpus):
            return None
        channels = nvlink.imex_channels(self.root)
        state = await self.runner.run("nvidia-imex-ctl", "-q", timeout=10)
        if state.returncode is None and not state.stdout:
            return {"installed": False, "channels": channels, "error": state.stderr.strip()[:500] or None}
        imex: ImexState = {"installed": True, "channels": channels}
        imex["state"] = nvlink.parse_imex_state(state.stdout + "\n" + state.stderr)
        nodes = await self.runner.run("nvidia-imex-ctl", "-N", timeout=10)
        domain = nvlink.parse_imex_nodes(nodes.stdout + "\n" + nodes.stderr)
        imex["configured"] = domain.configured
        imex["domain_state"] = domain.domain_state
        imex["nodes"] = [
            {"index": n.index, "address": n.address[:200], "state": n.state[:200], "version": n.version}
            for n in domain.nodes[:256]
        ]
        warnings += [f"nvidia-imex-ctl -N: {w}" for w in domain.warnings[:8]]
        return imex

    async def _slow_gpu_checks(self, report: nvidia.GpuReport, warnings: list[str]) -> None:
        try:
            self._imex = await self._read_imex(report, warnings)
        except Exception as exc:
            log.exception("reading IMEX failed")
            warnings.append(f"IMEX could not be read: {exc}")
        try:
            result = await self.runner.run("nvidia-smi", "nvlink", "-e")
            if result.ok:
                self._nvlink = nvidia.parse_nvlink_errors(result.stdout)
        except Exception as exc:
            warnings.append(f"nvidia-smi nvlink -e could not be read: {exc}")
        try:
            result = await self.runner.run("dmesg")
            if result.ok:
                self._xids = xid.count_xids(xid.parse_xid_lines(result.stdout))
                self._xids_read = True
        except Exception as exc:
            warnings.append(f"kernel log could not be read for XIDs: {exc}")

    def _gpus(self, report: nvidia.GpuReport | None, devices: list[dict[str, Any]]) -> list[GpuFigures]:
        managed = self.managed_pids()
        cards = {gpu.index: gpu for gpu in report.gpus} if report is not None else {}
        gpus: list[GpuFigures] = []
        for device in devices:
            figures = dict(device)
            pids = figures.pop("process_pids", None)
            # agent.devices builds each device from the probes' dataclasses: what is left once the
            # pids are out are GpuFigures' keys (tests/agent/test_message_types.py holds them to it).
            data = cast(GpuFigures, figures)
            if pids is not None:
                data["foreign_processes"] = sum(1 for pid in pids if pid not in managed)
            gpu = cards.get(data["index"]) if data.get("vendor") == "nvidia" and data.get("kind") == "gpu" else None
            if gpu is None:
                gpus.append(data)
                continue
            if gpu.processes is not None:
                data["foreign_processes"] = sum(1 for p in gpu.processes if p.pid not in managed)
            pci = xid.bus_id_to_xid_pci(gpu.pci_bus_id)
            if pci and pci in self._xids:
                data["xids"] = {str(code): count for code, count in self._xids[pci].items()}
            elif pci and self._xids_read:
                data["xids"] = {}  # the log was read and holds none for this card ("none", not unknown)
            if gpu.index in self._nvlink:
                data["nvlink_errors"] = self._nvlink[gpu.index]
            gpus.append(data)
        return gpus

    @staticmethod
    def _registered(device: dict[str, Any]) -> dict[str, Any]:
        """A device as the registration lists it: a slice's processes as a count, as a card's are."""
        data = dict(device)
        pids = data.pop("process_pids", None)
        if pids is not None:
            data["foreign_processes"] = len(pids)
        return data

    # Devices: cards, MIG slices, AMD cards and partitions ----------------------------------

    async def _devices(
        self, report: nvidia.GpuReport | None, warnings: list[str], *, registering: bool, refresh: bool = False
    ) -> list[dict[str, Any]]:
        """Every device of the node (agent.devices), NVIDIA's first, then AMD's. Never raises: a
        reader that fails costs its devices and says why."""
        devices: list[dict[str, Any]] = []
        if report is not None:
            try:
                listing = await self._mig_list(report, warnings)
                if registering and listing is not None:
                    self._mig_profiles = await self._read_mig_profiles(warnings)
                found, said = gpu_devices.nvidia_devices(report, listing, self._mig_profiles)
                devices += found
                warnings += said
            except Exception as exc:
                log.exception("reading the MIG layout failed")
                warnings.append(f"the MIG layout could not be read: {exc}")
                devices += [{**_gpu_dict(g), "vendor": "nvidia", "kind": "gpu"} for g in report.gpus]
        try:
            found_amd = await self._amd_devices(
                warnings, full=registering or refresh, first=len(report.gpus) if report else 0
            )
            devices += found_amd
        except Exception as exc:
            log.exception("reading the AMD GPUs failed")
            warnings.append(f"the AMD GPUs could not be read: {exc}")
        if len(devices) > protocol.MAX_DEVICES:
            warnings.append(f"{len(devices)} GPU devices; the first {protocol.MAX_DEVICES} are reported")
            devices = devices[: protocol.MAX_DEVICES]
        return devices

    async def _mig_list(self, report: nvidia.GpuReport, warnings: list[str]) -> mig.MigList | None:
        """`nvidia-smi -L`, read only where a card is in MIG mode (or describes MIG devices)."""
        if not any((g.mig_mode or "").lower() == "enabled" or g.mig_devices for g in report.gpus):
            return None
        result = await self.runner.run("nvidia-smi", "-L")
        if not result.ok:
            warnings.append(f"nvidia-smi -L could not be read: {(result.stderr or 'no output').strip()[:200]}")
            return None
        listing = mig.parse_mig_list(result.stdout)
        warnings += listing.warnings
        return listing

    async def _read_mig_profiles(self, warnings: list[str]) -> list[mig.MigProfile] | None:
        """`nvidia-smi mig -lgip`: the GPU instance profiles each MIG card offers (for the node page
        and a slice's share of its card); read at registration."""
        result = await self.runner.run("nvidia-smi", "mig", "-lgip")
        if not result.ok:
            return None
        return mig.parse_mig_profiles(result.stdout) or None

    async def _amd_devices(self, warnings: list[str], *, full: bool, first: int) -> list[dict[str, Any]]:
        report = await self._amd_report(warnings, full=full)
        if report is None or not report.gpus:
            return []
        found, said = gpu_devices.amd_devices(report, self._rocminfo, first_index=first)
        warnings += said
        return found

    async def _amd_report(self, warnings: list[str], *, full: bool) -> amd.AmdReport | None:
        """amd-smi, else rocm-smi; None on a node with neither tool. Each sample reads the cards'
        list and readings (`list`, `metric`; a tool without JSON is read in its text: `static`,
        `monitor`), and `static` again when asked (`full`) or when the list of devices changed
        (a partition mode change); the topology and rocminfo only when `full`."""
        if self._has_amd is False:
            return None
        listed = await self.runner.run("amd-smi", "list", "--json")
        if listed.returncode is None and not listed.stdout:
            return await self._rocm_smi_report(warnings, full=full)
        self._has_amd = True
        listing = amd.parse_amd_smi_json(listed.stdout) if listed.ok else None
        known = self._amd_static
        if full or known is None or listing is None or len(known.gpus) != len(listing.gpus):
            self._amd_static = await self._amd_smi(warnings, ("static",), ())
        if self._amd_static is None or not self._amd_static.gpus:
            warnings.append("amd-smi describes no GPU")
            return None
        if full:
            topology = await self.runner.run("amd-smi", "topology")
            self._amd_links = amd.parse_amd_topology(topology.stdout) if topology.ok else None
            await self._read_rocminfo()
        readings = await self._amd_smi(warnings, ("metric",), ("monitor", "-ptumv"))
        report = amd.merge_reports(
            listing if listing and listing.gpus else None, self._amd_static, readings, self._amd_links
        )
        self._amd_merged = report
        return report

    async def _amd_smi(
        self, warnings: list[str], command: tuple[str, ...], text: tuple[str, ...]
    ) -> amd.AmdReport | None:
        """One amd-smi read: its JSON, else its text (`text`, the command itself when empty)."""
        result = await self.runner.run("amd-smi", *command, "--json")
        report = amd.parse_amd_smi_json(result.stdout) if result.ok and result.stdout.lstrip()[:1] in "[{" else None
        if report is None or not report.gpus:
            plain = await self.runner.run("amd-smi", *(text or command))
            report = amd.parse_amd_smi_text(plain.stdout) if plain.ok else None
        if report is not None:
            warnings += [f"amd-smi {command[0]}: {w}" for w in report.warnings]
        return report

    async def _rocm_smi_report(self, warnings: list[str], *, full: bool) -> amd.AmdReport | None:
        result = await self.runner.run("rocm-smi", *ROCM_SMI_ARGS, "--json")
        if result.returncode is None and not result.stdout:
            self._has_amd = False  # neither amd-smi nor rocm-smi: no AMD GPU to read
            return None
        self._has_amd = True
        report = amd.parse_rocm_smi_json(result.stdout) if result.stdout.strip() else None
        if report is None or not report.gpus:
            text = await self.runner.run("rocm-smi", "-a")
            report = amd.parse_rocm_smi_text(text.stdout)
        warnings += [f"rocm-smi: {w}" for w in report.warnings]
        if full:
            await self._read_rocminfo()
        self._amd_static = report
        self._amd_merged = amd.merge_reports(report)
        return self._amd_merged

    async def _read_rocminfo(self) -> None:
        result = await self.runner.run("rocminfo")
        self._rocminfo = amd.parse_rocminfo(result.stdout) if result.stdout.strip() else None

    def _check_layout(self, devices: list[dict[str, Any]], warnings: list[str]) -> list[dict[str, Any]]:
        """Compare the cards' layout with the registered one: a changed card and its slices are
        marked untrusted (placed on by nobody) and the agent is asked to register again."""
        if self._layout is None:
            return devices
        changes = gpu_devices.layout_changes(self._layout, gpu_devices.layout_of(devices))
        self.layout_changed = changes
        if not changes:
            return devices
        self._layout_note = {"at": time.time(), "cards": {str(card): why for card, why in changes.items()}}
        marked = []
        for device in devices:
            card = device["index"] if device.get("parent") is None else device["parent"]
            if card in changes:
                device = {**device, "fault": f"GPU {card}: {changes[card]}"}
            marked.append(device)
        warnings += [f"GPU {card}: {why}" for card, why in changes.items()]
        return marked
