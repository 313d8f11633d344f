"""Start a real control plane and any number of real agents, each on its own fixture hardware.

    with ControlPlane(tmp_path) as plane:            # `llmgw up` on PostgreSQL+Redis or SQLite
        gpu = plane.add_agent("gpu1", HOSTS["h100x8"])
        gpu.wait_registered()
        plane.ctl("nodes")

Each agent is the real `llmgw agent` process. Its /proc and /sys are a folder built from the
captured files in ../shared/fixtures, and its nvidia-smi and dmesg are scripts that print
captured output, so one CPU machine can stand in for a rack of GPU servers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tests import processes
from tests.e2e.helpers import REPO, Browser, Running, descendants, llmgw_up

FIXTURES = Path(os.environ.get("LLMGW_FIXTURES_DIR") or REPO.parent / "shared" / "fixtures")


@dataclass(frozen=True)
class HostSpec:
    """Which captured files make up one fake host (paths relative to the fixtures folder)."""

    cpuinfo: str
    meminfo: str
    stat: str
    loadavg: str = "0.52 0.58 0.59 1/467 12345\n"
    nvidia_text: str | None = None  # `nvidia-smi -q`
    nvidia_xml: str | None = None  # `nvidia-smi -q -x`
    nvlink_errors: str | None = None
    dmesg: str | None = None
    hwmon_tree: str | None = None  # a `grep -r .` listing of /sys/class/hwmon
    rapl_tree: str | None = None  # a `grep -r .` listing of /sys/class/powercap
    os_release: str = 'PRETTY_NAME="Ubuntu 22.04.4 LTS"\n'
    kernel: str = "5.15.0-105-generic\n"
    # A capture of /sys/.../infiniband (JSON path -> contents), laid out as real files with
    # /sys/class/infiniband/<dev> links; sminfo and saquery answer from files under <root>/ib.
    ib_tree: str | None = None
    nvidia_topo: str | None = None  # `nvidia-smi topo -m`
    # A tray of a multi-node NVLink domain (ClusterUUID, CliqueId, cards): `nvidia-smi -q` and
    # `topo -m` are written under <root>/nvidia from the captures' shapes, so a test can change a
    # card's fabric; nvidia-imex-ctl answers from <root>/imex, with channel0 under <root>/dev.
    nvlink_domain: tuple[str, int, int] | None = None
    nvidia_list: str | None = None  # `nvidia-smi -L` (read where a card is in MIG mode)
    mig_profiles: str | None = None  # `nvidia-smi mig -lgip`
    # AMD: amd-smi's text answers (its --json calls are refused, as a tool without JSON would):
    # `static` from amd_static (a fixture path, or "mi300x:<cards>" for the MI300X board below),
    # `monitor -ptumv` and `topology`; or rocm-smi `-a` and rocminfo where amd-smi is missing.
    amd_static: str | None = None
    amd_monitor: str | None = None
    amd_topology: str | None = None
    rocm_smi_all: str | None = None
    rocminfo: str | None = None
    rocm_version: str | None = None


HOSTS = {
    "h100x8": HostSpec(
        cpuinfo="proc-cpuinfo/telegraf-xeon-platinum-8480plus-sapphire-rapids-avx512-amx-4cpu-trimmed.txt",
        meminfo="proc-meminfo/procfs-fixture-16gb-with-zswap.txt",
        stat="proc-stat/procfs-fixture-8cpu-laptop-huge-intr-line.txt",
        nvidia_text="nvidia-smi-q/h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt",
        nvlink_errors="nvidia-smi-nvlink/e-h100-error-counters-abridged.txt",
        dmesg="xid/xid48-dbe-xid63-rowremap-xid94-contained.log.txt",
        hwmon_tree="hwmon-sensors/sysfs-coretemp-2socket-node-exporter-fixture-grep-r.txt",
        rapl_tree="rapl-powercap/sysfs-intel-rapl-package-core-node-exporter-fixture-grep-r.txt",
    ),
    "cpu": HostSpec(
        cpuinfo="proc-cpuinfo/procfs-fixture-i7-8650u-8cpu-avx2.txt",
        meminfo="proc-meminfo/sysstat-root1-8gb-desktop-memavailable.txt",
        stat="proc-stat/sysstat-root1-i7-2600-8cpu.txt",
    ),
    "rtx3090": HostSpec(
        cpuinfo="proc-cpuinfo/sysstat-root1-i7-2600-avx.txt",
        meminfo="proc-meminfo/sysstat-root1-8gb-desktop-memavailable.txt",
        stat="proc-stat/sysstat-root1-i7-2600-8cpu.txt",
        nvidia_xml="nvidia-smi-q-xml/rtx3090-drv590-schema-v13.xml",
    ),
}
HOSTS["h100x8"] = replace(HOSTS["h100x8"], nvidia_topo="nvidia-smi-topo/m-h100-8gpu-nv18-ht-cpu-affinity.txt")
# A GB200 NVL72 compute tray: four Blackwell cards in domain 3b4f…/7 (no GB200 `nvidia-smi -q` is
# captured yet: the H100 report of the same driver generation, its Fabric block filled as GB200
# trays print it, its matrix cut to four cards).
GB200_CLUSTER = "3b4f1a2c-9d0e-4b7f-8a61-5c2d9e0f7a11"
HOSTS["gb200"] = replace(HOSTS["h100x8"], nvidia_text=None, nvidia_topo=None, nvlink_domain=(GB200_CLUSTER, 7, 4))
# Eight HDR ports, two of them INIT (a link, no subnet manager activating it).
HOSTS["h100-ib"] = replace(
    HOSTS["h100x8"], ib_tree="sysfs-infiniband/dgx-a100-cx6-hdr-two-ports-2-INIT-ipoib-down.json.txt"
)
# A GB200 tray also on the InfiniBand fabric (the same ports as h100-ib): the fallback.
HOSTS["gb200-ib"] = replace(HOSTS["gb200"], ib_tree=HOSTS["h100-ib"].ib_tree)
# Eight ports all trained at 100 Gb/s EDR instead of 200 HDR.
HOSTS["h100-ib-edr"] = replace(
    HOSTS["h100x8"], ib_tree="sysfs-infiniband/dgx-a100-cx6-ports-at-100-edr-instead-of-hdr.json.txt"
)


# A card of each vendor's split kind: an H100 in MIG mode (3g.40gb, 2g.20gb and two 1g.10gb, idle),
# its `-q` and `-L` captured on the same machine.
HOSTS["h100-mig"] = replace(
    HOSTS["h100x8"],
    nvidia_text="nvidia-smi-q/h100-mig-enabled-drv590-idle-masked.txt",
    nvidia_list="nvidia-smi-mig-list/L-h100-80gb-hbm3-4mig-3g40-2g20-1g10x2-drv590-masked.txt",
    nvidia_topo=None,
    nvlink_errors=None,
    dmesg=None,
)
# Eight MI300X on one XGMI board: `amd-smi monitor -ptumv` and `amd-smi topology` as captured (ROCm
# 6.1 changelog); no `amd-smi static` of an MI300X board is captured, so its text is the captured
# MI300A report's layout with each card's name, id, address (the topology's), memory (the
# monitor's) and power cap (rocm-smi's MI300X capture) put in (`mi300x_static`).
HOSTS["mi300x"] = replace(
    HOSTS["cpu"],
    amd_static="mi300x:8",
    amd_monitor="amd-smi-text/monitor-ptumv-8gpu-mi300x-idle-changelog.txt",
    amd_topology="amd-smi-text/topology-8gpu-xgmi-weight15-5-tables-changelog.txt",
    rocm_version="6.1.0",
)
# Four MI300X read with rocm-smi alone (no amd-smi), their memory from rocminfo of the same host.
HOSTS["mi300x-rocm-smi"] = replace(
    HOSTS["cpu"],
    rocm_smi_all="rocm-smi/showallinfo-a-mi300x-x4-sriov-vbios-drv6.7.0.txt",
    rocminfo="rocminfo/mi300x-x4-epyc-9474f-2socket-trailing-spaces.txt",
)

MI300A_STATIC = "amd-smi-text/static-4x-mi300a-apu-with-cpu-smu-drv6.9.0-rc5-docs.txt"


def _topology_addresses() -> list[str]:
    text = (FIXTURES / "amd-smi-text" / "topology-8gpu-xgmi-weight15-5-tables-changelog.txt").read_text()
    return text.splitlines()[1].split()


def mi300x_static(
    cards: int, compute: str = "SPX", memory: str = "NPS1", parts: int = 1, split: set[int] | None = None
) -> str:
    """`amd-smi static` of an MI300X board: the captured MI300A report's GPU block for each card as
    an MI300X; the cards in `split` (all by default) in `compute`/`memory` mode, as `parts`
    compute partitions each (memory split by `parts`), numbered on from the cards before them."""
    text = (FIXTURES / MI300A_STATIC).read_text(encoding="utf-8")
    block = text[text.index("GPU: 0\n") : text.index("GPU: 1\n")]
    addresses = _topology_addresses()
    out = []
    index = 0
    for card in range(cards):
        many = parts if split is None or card in split else 1
        for part in range(many):
            one = block.replace("GPU: 0\n", f"GPU: {index}\n")
            one = one.replace("MARKET_NAME: MI300A", "MARKET_NAME: AMD Instinct MI300X")
            one = one.replace("DEVICE_ID: 0x74a0", "DEVICE_ID: 0x74a1")
            one = one.replace("[Instinct MI300A]", "[Instinct MI300X]")
            one = one.replace("BDF: 0000:01:00.0", f"BDF: {addresses[card][:-1]}{part}")
            one = one.replace("SIZE: 64289 MB", f"SIZE: {196300 // many} MB")
            one = re.sub(r"(MAX_POWER|SOCKET_POWER): 550 W", r"\1: 750 W", one)
            if many > 1:
                one = one.replace("COMPUTE_PARTITION: SPX", f"COMPUTE_PARTITION: {compute}")
                one = one.replace("MEMORY_PARTITION: NPS1", f"MEMORY_PARTITION: {memory}")
            out.append(one)
            index += 1
    return "".join(out)


def fixtures_available() -> bool:
    return FIXTURES.is_dir()


def _materialise_tree(listing: str, root: Path, anchor: str, target: str) -> None:
    """Write a `grep -r .` listing as real files: everything from `anchor` on goes under target."""
    for line in listing.splitlines():
        path, sep, value = line.partition(":")
        # Directory names such as intel-rapl:0 hold colons: split at the colon before the file's value.
        match = re.match(r"^(.*?/[^/:]+(?::\d+)*/[^/:]+):(.*)$", line)
        if match:
            path, value = match.group(1), match.group(2)
        elif not sep:
            continue
        index = path.find(anchor)
        if index < 0:
            continue
        destination = root / target / path[index:]
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(value + "\n")


def build_host(spec: HostSpec, root: Path) -> dict[str, str]:
    """Lay out a fake host under root; return the agent's tools mapping."""

    def fixture(name: str) -> str:
        return (FIXTURES / name).read_text(encoding="utf-8", errors="replace")

    proc = root / "proc"
    (proc / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "cpuinfo").write_text(fixture(spec.cpuinfo))
    (proc / "meminfo").write_text(fixture(spec.meminfo))
    (proc / "stat").write_text(fixture(spec.stat))
    (proc / "loadavg").write_text(spec.loadavg)
    (proc / "sys" / "kernel" / "osrelease").write_text(spec.kernel)
    (proc / "self" / "mountinfo").write_text("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "os-release").write_text(spec.os_release)
    if spec.hwmon_tree:
        _materialise_tree(fixture(spec.hwmon_tree), root, "hwmon", "sys/class/hwmon-src")
        # hwmonN directories sit directly under /sys/class/hwmon on a live host
        src = root / "sys" / "class" / "hwmon-src"
        dest = root / "sys" / "class" / "hwmon"
        dest.mkdir(parents=True, exist_ok=True)
        for folder in src.rglob("hwmon[0-9]*"):
            if folder.is_dir() and not (dest / folder.name).exists():
                folder.rename(dest / folder.name)
    if spec.rapl_tree:
        _materialise_tree(fixture(spec.rapl_tree), root, "intel-rapl", "sys/class/powercap")

    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    tools = {}
    cases = []
    if spec.nvidia_xml:
        cases.append(f'  "-q -x") cat {shlex.quote(str(FIXTURES / spec.nvidia_xml))} ;;')
    else:
        cases.append('  "-q -x") echo "Invalid combination of input arguments." >&2; exit 2 ;;')
    if spec.nvidia_text:
        cases.append(f'  "-q") cat {shlex.quote(str(FIXTURES / spec.nvidia_text))} ;;')
    if spec.nvlink_errors:
        cases.append(f'  "nvlink -e") cat {shlex.quote(str(FIXTURES / spec.nvlink_errors))} ;;')
    if spec.nvidia_topo:
        cases.append(f'  "topo -m") cat {shlex.quote(str(FIXTURES / spec.nvidia_topo))} ;;')
    if spec.nvlink_domain:
        tools.update(_nvlink_tray(spec.nvlink_domain, root, bin_dir, cases))
    if spec.nvidia_list:
        cases.append(f'  "-L") cat {shlex.quote(str(FIXTURES / spec.nvidia_list))} ;;')
    if spec.mig_profiles:
        cases.append(f'  "mig -lgip") cat {shlex.quote(str(FIXTURES / spec.mig_profiles))} ;;')
    if spec.nvidia_text or spec.nvidia_xml or spec.nvlink_domain:
        script = bin_dir / "nvidia-smi"
        script.write_text('#!/bin/sh\ncase "$*" in\n' + "\n".join(cases) + "\n  *) exit 2 ;;\nesac\n")
        script.chmod(0o755)
        tools["nvidia-smi"] = str(script)
    else:
        tools["nvidia-smi"] = str(bin_dir / "no-nvidia-smi-here")
    dmesg = bin_dir / "dmesg"
    dmesg.write_text(
        f"#!/bin/sh\ncat {shlex.quote(str(FIXTURES / spec.dmesg))}\n" if spec.dmesg else "#!/bin/sh\nexit 0\n"
    )
    dmesg.chmod(0o755)
    tools["dmesg"] = str(dmesg)
    if spec.ib_tree:
        tools.update(_infiniband(json.loads(fixture(spec.ib_tree)), root, bin_dir))
    tools.update(_amd(spec, root, bin_dir))
    return tools


AMD_SMI = """#!/bin/sh
# amd-smi: the text of each command from <root>/amd (its --json calls refused, as a tool without them).
case "$*" in
  "static") cat {amd}/static ;;
  "monitor -ptumv") cat {amd}/monitor ;;
  "topology") cat {amd}/topology ;;
  *) echo "amd-smi: unrecognized arguments: $*" >&2; exit 2 ;;
esac
"""

ROCM_SMI = """#!/bin/sh
# rocm-smi: `-a` as captured; any other question is not answered.
case "$*" in
  "-a") cat {amd}/rocm-smi ;;
  *) echo "rocm-smi: unrecognized arguments" >&2; exit 2 ;;
esac
"""


def _amd(spec: HostSpec, root: Path, bin_dir: Path) -> dict[str, str]:
    """amd-smi, rocm-smi and rocminfo of an AMD host, /dev/kfd and /dev/dri, and the ROCm release;
    on any other host the AMD tools are missing, as on a real one."""
    tools = {name: str(bin_dir / f"no-{name}-here") for name in ("amd-smi", "rocm-smi", "rocminfo")}
    amd = root / "amd"
    if spec.amd_static:
        amd.mkdir(exist_ok=True)
        static = spec.amd_static
        text = (
            mi300x_static(int(static.split(":")[1]))
            if static.startswith("mi300x:")
            else (FIXTURES / static).read_text()
        )
        (amd / "static").write_text(text)
        for name, path in (("monitor", spec.amd_monitor), ("topology", spec.amd_topology)):
            (amd / name).write_text((FIXTURES / path).read_text() if path else "")
        script = bin_dir / "amd-smi"
        script.write_text(AMD_SMI.format(amd=shlex.quote(str(amd))))
        script.chmod(0o755)
        tools["amd-smi"] = str(script)
    if spec.rocm_smi_all:
        amd.mkdir(exist_ok=True)
        (amd / "rocm-smi").write_text((FIXTURES / spec.rocm_smi_all).read_text())
        script = bin_dir / "rocm-smi"
        script.write_text(ROCM_SMI.format(amd=shlex.quote(str(amd))))
        script.chmod(0o755)
        tools["rocm-smi"] = str(script)
    if spec.rocminfo:
        script = bin_dir / "rocminfo"
        script.write_text(f"#!/bin/sh\ncat {shlex.quote(str(FIXTURES / spec.rocminfo))}\n")
        script.chmod(0o755)
        tools["rocminfo"] = str(script)
    if spec.amd_static or spec.rocm_smi_all:
        (root / "dev" / "dri").mkdir(parents=True, exist_ok=True)
        (root / "dev" / "kfd").write_text("")
        (root / "dev" / "dri" / "renderD128").write_text("")
    if spec.rocm_version:
        (root / "opt" / "rocm" / ".info").mkdir(parents=True, exist_ok=True)
        (root / "opt" / "rocm" / ".info" / "version").write_text(spec.rocm_version + "\n")
    return tools


def set_amd_static(root: Path, text: str) -> None:
    """What `amd-smi static` prints on this host from now on (a partition mode change)."""
    (root / "amd" / "static").write_text(text)


SMINFO = """#!/bin/sh
# sminfo -C <dev> -P <port>: the master this port sees, from <root>/ib/master (empty: no answer).
master=$(cat {ib}/master-"$2" 2>/dev/null || cat {ib}/master)
if [ -z "$master" ]; then echo "sminfo: iberror: failed: query" >&2; exit 255; fi
echo "sminfo: sm lid 1 sm guid $master, activity count 41234 priority 14 state 3 SMINFO_MASTER"
"""

SAQUERY = """#!/bin/sh
# saquery -C <dev> -P <port> SMIR: the subnet managers of the fabric, from <root>/ib/smir.
cat {ib}/smir
"""


IBNETDISCOVER = """#!/bin/sh
# ibnetdiscover -C <dev> -P <port>: the fabric's topology, from <root>/ib/ibnetdiscover.
if [ ! -f {ib}/ibnetdiscover ]; then echo "ibnetdiscover: iberror: failed: discover failed" >&2; exit 255; fi
cat {ib}/ibnetdiscover
"""


IB_WRITE_BW = """#!/bin/sh
# ib_write_bw: perftest's table as a real run printed it (<root>/ib/perftest), with its arguments logged.
echo "$*" >> {ib}/perftest.log
case "$1" in --version) echo "Version: 6.10"; exit 0 ;; esac
cat {ib}/perftest
"""


def smir(*managers: tuple[str, int, int]) -> str:
    """saquery SMIR's text for (guid, priority, state) managers, as rdma-core prints it."""
    blocks = []
    for lid, (guid, priority, state) in enumerate(managers, start=1):
        blocks.append(
            "SMInfoRecord dump:\n\t\tRID\n\t\tLID...................{lid}\n\t\tSMInfo dump:\n"
            "\t\tGUID..................0x{guid:0>16}\n\t\tSM_Key................0x0000000000000000\n"
            "\t\tActCount..............1234\n\t\tPriority..............{priority}\n"
            "\t\tSMState...............{state}\n".format(
                lid=lid, guid=guid.removeprefix("0x"), priority=priority, state=state
            )
        )
    return "".join(blocks)


def _infiniband(tree: dict[str, str], root: Path, bin_dir: Path) -> dict[str, str]:
    devices: dict[str, Path] = {}
    for path, value in tree.items():
        destination = root / path.lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        destination.write_text(value)
        parts = Path(path).parts
        if "infiniband" in parts:
            at = parts.index("infiniband")
            if at + 1 < len(parts):
                devices[parts[at + 1]] = root / Path(*parts[1 : at + 2])
    links = root / "sys" / "class" / "infiniband"
    links.mkdir(parents=True, exist_ok=True)
    for name, target in devices.items():
        if not (links / name).exists():
            (links / name).symlink_to(target)
    ib = root / "ib"
    ib.mkdir(exist_ok=True)
    (ib / "master").write_text("0x0002c90300a1b2c3\n")
    (ib / "smir").write_text(smir(("0x0002c90300a1b2c3", 14, 3), ("0x0002c90300a1b2d0", 10, 2)))
    tools = {}
    (ib / "perftest").write_text(
        (FIXTURES / "perftest" / "ib_write_bw-report-gbits-roce-q4-rdma-cm-oci-100g.txt").read_text()
    )
    scripts = (("sminfo", SMINFO), ("saquery", SAQUERY), ("ibnetdiscover", IBNETDISCOVER), ("ib_write_bw", IB_WRITE_BW))
    for name, text in scripts:
        script = bin_dir / name
        script.write_text(text.format(ib=shlex.quote(str(ib))))
        script.chmod(0o755)
        tools[name] = str(script)
    # `ip -j addr` answers with the addresses of the host's RoCE v2 GIDs (a /24 each), as the
    # kernel would list them on those netdevs; a host of InfiniBand ports only has none.
    from agent.probes.infiniband import read_ports

    addresses: dict[str, list[dict[str, Any]]] = {}
    for port in read_ports(str(root)).ports:
        for gid in port.roce_gids:
            entry = {"family": "inet", "local": gid.ip, "prefixlen": 24}
            if gid.netdev and gid.ip and gid.family == 4 and entry not in addresses.get(gid.netdev, []):
                addresses.setdefault(gid.netdev, []).append(entry)
    listing = [{"ifname": name, "addr_info": info} for name, info in sorted(addresses.items())]
    (ib / "ip.json").write_text(json.dumps(listing))
    ip = bin_dir / "ip"
    ip.write_text(f"#!/bin/sh\ncat {shlex.quote(str(ib / 'ip.json'))}\n")
    ip.chmod(0o755)
    tools["ip"] = str(ip)
    return tools


TRAY_BASE = "nvidia-smi-q/h100-sxm-80gb-x8-drv565-fabric-clique0-zero-uuid.txt"
_GPU_BLOCK_RE = re.compile(r"(?m)^GPU [0-9A-Fa-f]{8}:")
_FABRIC_RE = re.compile(r"(?m)^    Fabric\n(?:        .*\n)+")


def fabric_block(
    cluster: str | None,
    clique: int | None,
    state: str = "Completed",
    status: str = "Success",
    health: str = "Healthy",
    bandwidth: str = "Full",
) -> str:
    """A card's Fabric block as `nvidia-smi -q` prints it (N/A where the fabric gave nothing)."""
    rows = [
        ("State", state),
        ("Status", status if state == "Completed" else "N/A"),
        ("CliqueId", str(clique) if clique is not None else "N/A"),
        ("ClusterUUID", cluster or "N/A"),
    ]
    lines = ["    Fabric"] + [f"        {key:<34}: {value}" for key, value in rows]
    lines += ["        Health", f"            {'Summary':<30}: {health}", f"            {'Bandwidth':<30}: {bandwidth}"]
    return "\n".join(lines) + "\n"


def tray_report(cluster: str, clique: int, cards: int, fabrics: dict[int, str] | None = None) -> str:
    """`nvidia-smi -q` of a tray: the base capture's first `cards` GPUs named GB200, each with its Fabric."""
    text = (FIXTURES / TRAY_BASE).read_text()
    starts = [m.start() for m in _GPU_BLOCK_RE.finditer(text)] + [len(text)]
    head = re.sub(r"(Attached GPUs\s+:) \d+", rf"\1 {cards}", text[: starts[0]])
    blocks = []
    for index in range(cards):
        block = text[starts[index] : starts[index + 1]].replace("NVIDIA H100 80GB HBM3", "NVIDIA GB200")
        fabric = (fabrics or {}).get(index) or fabric_block(cluster, clique)
        blocks.append(_FABRIC_RE.sub(lambda _m, f=fabric: f, block, count=1))
    return head + "".join(blocks)


def tray_topology(cards: int) -> str:
    """`nvidia-smi topo -m` of a tray: every card on NV18 to the others, two per NUMA node, one NIC each."""
    names = [f"GPU{i}" for i in range(cards)] + [f"NIC{i}" for i in range(cards)]
    lines = ["\t" + "\t".join(names) + "\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID"]
    for i in range(cards):
        cells = [" X " if j == i else "NV18" for j in range(cards)]
        cells += ["PIX" if j == i else "SYS" for j in range(cards)]
        numa = i * 2 // cards
        lines.append(f"GPU{i}\t" + "\t".join(cells) + f"\t{numa * 72}-{numa * 72 + 71}\t{numa}\t\tN/A")
    for i in range(cards):
        cells = ["PIX" if j == i else "SYS" for j in range(cards)]
        cells += [" X " if j == i else "SYS" for j in range(cards)]
        lines.append(f"NIC{i}\t" + "\t".join(cells) + "\t\t\t")
    lines += ["", "Legend:", "", "  X    = Self", "  NV#  = Connection traversing a bonded set of # NVLinks", ""]
    lines += ["NIC Legend:", ""] + [f"  NIC{i}: mlx5_{i}" for i in range(cards)]
    return "\n".join(lines) + "\n"


def imex_nodes(addresses: list[str], states: list[str] | None = None, domain: str = "UP") -> str:
    """`nvidia-imex-ctl -N` of a domain, in the capture's layout."""
    legend = (FIXTURES / "nvidia-imex-ctl" / "N-gh200-2node-domain-up-drv570.txt").read_text().split("\n\n")[0]
    states = states or ["READY"] * len(addresses)
    rows = [
        f"Node #{i:<3} - {address:<15} - {state}"
        for i, (address, state) in enumerate(zip(addresses, states, strict=True))
    ]
    header = " Nodes From\\To  " + "  ".join(str(i) for i in range(len(addresses)))
    matrix = [
        f"       {i}        "
        + "  ".join("C" if states[i] == "READY" and states[j] == "READY" else "N" for j in range(len(addresses)))
        for i in range(len(addresses))
    ]
    return "\n".join(
        [legend, "", "3/25/2025 10:42:08.082", "Nodes:", *rows, "", header, *matrix, f"Domain State: {domain}", ""]
    )


IMEX_CTL = """#!/bin/sh
# nvidia-imex-ctl -q / -N: the daemon's state and the domain, from <root>/imex.
case "$1" in
  -q) cat {imex}/q ;;
  -N) cat {imex}/N ;;
  *) exit 2 ;;
esac
"""


def _nvlink_tray(domain: tuple[str, int, int], root: Path, bin_dir: Path, cases: list[str]) -> dict[str, str]:
    cluster, clique, cards = domain
    nvidia = root / "nvidia"
    nvidia.mkdir(exist_ok=True)
    (nvidia / "q.txt").write_text(tray_report(cluster, clique, cards))
    (nvidia / "topo.txt").write_text(tray_topology(cards))
    cases.append(f'  "-q") cat {shlex.quote(str(nvidia / "q.txt"))} ;;')
    cases.append(f'  "topo -m") cat {shlex.quote(str(nvidia / "topo.txt"))} ;;')
    imex = root / "imex"
    imex.mkdir(exist_ok=True)
    (imex / "q").write_text("READY\n")
    (imex / "N").write_text(imex_nodes(["127.0.0.1"]))
    channels = root / "dev" / "nvidia-caps-imex-channels"
    channels.mkdir(parents=True, exist_ok=True)
    (channels / "channel0").write_text("")
    script = bin_dir / "nvidia-imex-ctl"
    script.write_text(IMEX_CTL.format(imex=shlex.quote(str(imex))))
    script.chmod(0o755)
    return {"nvidia-imex-ctl": str(script)}


@dataclass
class FleetAgent:
    name: str
    config_path: Path
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> FleetAgent:
        handle = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "agent", "--config", str(self.config_path)],
            cwd=REPO,
            env=self.env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    def finish(self) -> None:
        """Kill the agent and every process it started: its engines live in sessions of their own,
        so they outlive it (by design, for an agent that restarts) and would outlive the test."""
        self.stop(signal.SIGKILL)
        processes.kill_marked(processes.OWNER_MARK, self.env[processes.OWNER_MARK])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def root(self) -> Path:
        return self.config_path.parent

    def set_port(self, device: str, state: str, phys_state: str) -> None:
        """Bring one InfiniBand port down or up, as a cable pulled or plugged in would."""
        for port in (self.root / "sys" / "class" / "infiniband" / device / "ports").iterdir():
            (port / "state").write_text(state + "\n")
            (port / "phys_state").write_text(phys_state + "\n")

    def set_port_guid(self, device: str, guid: str) -> None:
        """Give a port its GUID (the low half of its gids/0, as the kernel shows it)."""
        digits = guid.removeprefix("0x").rjust(16, "0")
        groups = ":".join(digits[i : i + 4] for i in range(0, 16, 4))
        gids = self.root / "sys" / "class" / "infiniband" / device / "ports" / "1" / "gids"
        gids.mkdir(exist_ok=True)
        (gids / "0").write_text(f"fe80:0000:0000:0000:{groups}\n")

    def set_topology(self, text: str | None) -> None:
        """What ibnetdiscover prints on this host (None: it fails)."""
        target = self.root / "ib" / "ibnetdiscover"
        if text is None:
            target.unlink(missing_ok=True)
        else:
            target.write_text(text)

    def set_fabrics(self, domain: tuple[str, int, int], fabrics: dict[int, str] | None = None) -> None:
        """What each card's Fabric block says now (`fabric_block`); cards not named are joined."""
        cluster, clique, cards = domain
        (self.root / "nvidia" / "q.txt").write_text(tray_report(cluster, clique, cards, fabrics))

    def set_imex(self, state: str = "READY", nodes: str | None = None, channel: bool = True) -> None:
        """The IMEX daemon's state (`-q`), its domain (`-N`, see imex_nodes) and whether channel0 exists."""
        (self.root / "imex" / "q").write_text(state + "\n")
        if nodes is not None:
            (self.root / "imex" / "N").write_text(nodes)
        target = self.root / "dev" / "nvidia-caps-imex-channels" / "channel0"
        if channel:
            target.write_text("")
        else:
            target.unlink(missing_ok=True)

    def set_subnet_managers(self, master: str, *managers: tuple[str, int, int]) -> None:
        """Which master every port sees now, and the managers saquery lists (a failover, a new fabric)."""
        (self.root / "ib" / "master").write_text(master + "\n")
        (self.root / "ib" / "smir").write_text(smir(*managers))


@dataclass
class ControlPlane:
    """`llmgw up` for real, with an administrator signed in and an API key for ctl."""

    tmp: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    local_agent: bool = True
    # More arguments for `llmgw up`, e.g. ["--keep-engines"].
    up_args: list[str] = field(default_factory=list)
    # To start again on an earlier plane's state: its data directory, database and administrator.
    reuse: ControlPlane | None = None
    keep_database: bool = False
    agents: list[FleetAgent] = field(default_factory=list)
    running: Running | None = None
    key: str = ""
    password: str = ""
    email: str = ""
    browser: Browser | None = None
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def __enter__(self) -> ControlPlane:
        args = ([] if self.local_agent else ["--no-agent"]) + self.up_args
        earlier = self.reuse
        self.running = self._stack.enter_context(
            llmgw_up(
                self.tmp,
                *args,
                data_dir=Path(earlier.running.env["LLMGW_DATA_DIR"]) if earlier and earlier.running else None,
                database=earlier.running.database if earlier and earlier.running else None,
                keep_database=self.keep_database,
                **self.extra_env,
            )
        )
        if earlier is not None:
            self.email, self.password = earlier.email, earlier.password
        else:
            match = self.running.wait_for_line(r"created the first administrator (\S+) with password (\S+)")
            self.email, self.password = match.group(1), match.group(2)
        self.running.wait_for_line(r"llmgw up: ready at ")
        self.browser = Browser(self.url)
        status, page = self.browser.post_form("/login/", {"username": self.email, "password": self.password})
        assert status == 200, page[:300]
        status, page = self.browser.post_form("/account/keys/", {"name": "fleet", "expires": "7"})
        self.key = re.search(r'id="new-key">(llmgw_[^<]+)<', page).group(1)  # type: ignore[union-attr]
        return self

    def stop(self, timeout: float = 60) -> int:
        """Stop `llmgw up` as an operator would (SIGTERM), leaving what it does not own running."""
        assert self.running is not None
        self.running.process.send_signal(signal.SIGTERM)
        return self.running.process.wait(timeout=timeout)

    def __exit__(self, *exc: object) -> None:
        for agent in self.agents:
            agent.finish()
        self._stack.close()

    @property
    def url(self) -> str:
        assert self.running is not None
        return self.running.url

    def api(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/api/v1/{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def serves(self, model: str) -> bool:
        """Whether the gateway lists `model` with a ready replica for this plane's key."""
        request = urllib.request.Request(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                data = json.load(response)["data"]
        except urllib.error.HTTPError:
            return False  # a new key has not reached the gateway's table yet
        return any(m["id"] == model and m["llmgw"]["ready_replicas"] for m in data)

    def ctl(self, *args: str) -> tuple[int, str, str]:
        from llmgw.cli import main

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["ctl", "--server", self.url, "--key", self.key, *args])
        return code, out.getvalue(), err.getvalue()

    def add_agent(
        self,
        name: str,
        spec: HostSpec,
        *,
        labels: dict[str, str] | None = None,
        heartbeat: float = 1.0,
        start: bool = True,
        settings: dict[str, Any] | None = None,
    ) -> FleetAgent:
        """An agent on a host built from captured output; `settings` adds to or replaces its agent.yaml."""
        answer = self.api("POST", "nodes/enrollments", {"name": name, "labels": labels or {}})
        root = self.tmp / "hosts" / name
        root.mkdir(parents=True)
        extra = dict(settings or {})
        # A test's agents never fetch from a real package index (a source build of an engine).
        tools = {"package-index": "http://127.0.0.1:9/simple", **build_host(spec, root), **extra.pop("tools", {})}
        config = {
            "server": self.url,
            "token": answer["token"],
            "state_dir": str(root / "state"),
            "root": str(root),
            "tools": tools,
            "heartbeat_interval": heartbeat,
            "hostname": name,
            "model_dirs": [],
            "labels": {},
            **extra,
        }
        config_path = root / "agent.yaml"
        config_path.write_text(yaml.safe_dump(config))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_"))}
        env[processes.OWNER_MARK] = processes.owner(config_path)
        agent = FleetAgent(name=name, config_path=config_path, env=env, log_path=root / "agent.log")
        self.agents.append(agent)
        return agent.start() if start else agent

    def wait_for(self, predicate: Any, timeout: float = 60, what: str = "") -> Any:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = predicate()
            if last:
                return last
            time.sleep(0.3)
        logs = "\n".join(f"--- {a.name}\n{a.log()[-3000:]}" for a in self.agents)
        output = "".join(self.running.lines[-60:]) if self.running else ""
        log = Path(self.running.env["LLMGW_DATA_DIR"]) / "logs" / "up.log" if self.running else None
        full = log.read_text(errors="replace")[-6000:] if log is not None and log.exists() else ""
        raise AssertionError(
            f"timed out waiting for {what or predicate}: {last!r}\n{logs}\n--- up\n{output}\n--- up.log\n{full}"
        )

    def node(self, name: str) -> dict[str, Any]:
        """The node as the API shows it; {} while it does not exist yet."""
        try:
            return self.api("GET", f"nodes/{name}")  # type: ignore[no-any-return]
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return {}
            raise

    def children(self) -> set[int]:
        assert self.running is not None
        return descendants(self.running.process.pid)
