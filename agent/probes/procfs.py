"""Parsers for ``/proc/cpuinfo``, ``lscpu``, ``/proc/stat``, ``/proc/meminfo``, ``/proc/loadavg``
and ``/proc/<pid>/stat``, plus a reader that sums the CPU time and RSS of a process group.

Everything except :func:`process_group_usage` is a pure function over text.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = [
    "CpuInfo",
    "CpuTimes",
    "MemInfo",
    "PidStat",
    "ProcessGroupUsage",
    "avx_warning",
    "cpu_utilisation",
    "parse_cpuinfo",
    "parse_loadavg",
    "parse_lscpu",
    "parse_meminfo",
    "parse_pid_stat",
    "parse_proc_pid_stat",
    "parse_proc_stat",
    "process_group_usage",
]

_X86_VENDORS = frozenset({"GenuineIntel", "AuthenticAMD", "HygonGenuine", "CentaurHauls", "Shanghai"})
_X86_ARCHITECTURES = frozenset({"x86_64", "i386", "i486", "i586", "i686", "x86", "amd64"})


# --------------------------------------------------------------------------- CPU model


@dataclass
class CpuInfo:
    """What the host's CPUs are.  ``flags`` holds the features every listed CPU has."""

    model: str | None = None
    logical_cpus: int | None = None
    sockets: int | None = None
    flags: frozenset[str] = frozenset()
    #: True/False on x86 when flags were listed; None on other architectures or without flags.
    has_avx2: bool | None = None
    has_avx512: bool | None = None
    warnings: list[str] = field(default_factory=list)
    vendor: str | None = None
    #: ``x86_64``/``aarch64``/... from lscpu; from /proc/cpuinfo inferred as x86_64, x86 or arm.
    architecture: str | None = None
    cores_per_socket: int | None = None
    threads_per_core: int | None = None
    numa_nodes: int | None = None

    @property
    def is_x86(self) -> bool | None:
        if self.architecture:
            return self.architecture.lower() in _X86_ARCHITECTURES
        if self.vendor:
            return self.vendor in _X86_VENDORS
        return None


def _collapse(value: str | None) -> str | None:
    if value is None:
        return None
    value = " ".join(value.split())
    return value or None


def _to_int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if re.fullmatch(r"\d+", value) else None


def _x86_features(cpu: CpuInfo) -> None:
    if cpu.is_x86 and cpu.flags:
        cpu.has_avx2 = "avx2" in cpu.flags
        cpu.has_avx512 = "avx512f" in cpu.flags
    else:
        cpu.has_avx2 = None
        cpu.has_avx512 = None
    if cpu.is_x86 and not cpu.flags:
        cpu.warnings.append("no CPU flags listed: AVX2/AVX-512 support is unknown")


def _intersect(sets: list[frozenset[str]]) -> frozenset[str]:
    if not sets:
        return frozenset()
    common = sets[0]
    for other in sets[1:]:
        common &= other
    return common


def parse_cpuinfo(text: str) -> CpuInfo:
    """Parse ``/proc/cpuinfo`` (x86 ``flags`` or ARM ``Features``; TAB or space separated)."""
    cpu = CpuInfo()
    if not text or not text.strip():
        cpu.warnings.append("/proc/cpuinfo is empty")
        return cpu
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for raw in text.lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r")
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if not sep:
            continue
        current.setdefault(key.strip().lower(), value.strip())
    if current:
        blocks.append(current)

    processors = [b for b in blocks if re.fullmatch(r"\d+", b.get("processor", ""))]
    if not processors:
        cpu.warnings.append("no 'processor' entries found: unknown /proc/cpuinfo layout")
        return cpu
    first = processors[0]
    cpu.logical_cpus = len(processors)
    cpu.vendor = _collapse(first.get("vendor_id"))
    cpu.model = _collapse(first.get("model name"))
    physical_ids = {b["physical id"] for b in processors if "physical id" in b}
    cpu.sockets = len(physical_ids) if physical_ids else None
    cpu.cores_per_socket = _to_int(first.get("cpu cores"))
    siblings = _to_int(first.get("siblings"))
    if siblings and cpu.cores_per_socket:
        cpu.threads_per_core = max(1, siblings // cpu.cores_per_socket)

    flag_key = "flags" if any("flags" in b for b in processors) else "features"
    cpu.flags = _intersect([frozenset(b[flag_key].split()) for b in processors if flag_key in b])
    if cpu.vendor in _X86_VENDORS or flag_key == "flags":
        cpu.architecture = "x86_64" if "lm" in cpu.flags else "x86"
    elif any(k in first for k in ("cpu implementer", "features", "cpu architecture")):
        cpu.architecture = "aarch64" if first.get("cpu architecture", "").strip() == "8" else "arm"
    _x86_features(cpu)

    if siblings and cpu.sockets and siblings * cpu.sockets > cpu.logical_cpus:
        cpu.warnings.append(
            f"/proc/cpuinfo lists {cpu.logical_cpus} processor(s) but 'siblings' says {siblings} per socket "
            f"on {cpu.sockets} socket(s): the output looks trimmed"
        )
    return cpu


_LSCPU_KEY_RE = re.compile(r"^(?P<indent>\s*)(?P<key>[^:\s][^:]*?):(?P<space>\s*)(?P<value>.*)$")


def parse_lscpu(text: str) -> CpuInfo:
    """Parse plain ``lscpu`` output: old flat and new indented layouts, heterogeneous (big.LITTLE)
    sections with several ``Model name`` entries, and ``Flags`` wrapped over several lines (a
    continuation indented exactly to the value column continues the previous word).

    Keys are matched in English: run ``LC_ALL=C lscpu``."""
    cpu = CpuInfo()
    if not text or not text.strip():
        cpu.warnings.append("lscpu output is empty")
        return cpu
    entries: list[list[str]] = []  # [key, value]
    value_col: int | None = None  # column where the current entry's value started
    trailing_space = False  # whether the previous physical line ended in whitespace
    for raw in text.lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r").expandtabs(8)
        ended_with_space = line != line.rstrip()
        if not line.strip():
            value_col = None
            trailing_space = False
            continue
        m = _LSCPU_KEY_RE.match(line)
        if m:
            entries.append([m.group("key").strip(), m.group("value").rstrip()])
            value_col = m.start("value")
        elif value_col is not None and entries and line[:1].isspace():
            # a continuation of the previous value, wrapped at the terminal width: indented exactly
            # to the value column it continues the previous word ("avx" + "2"), further in it
            # starts a new one
            chunk = line.strip()
            indent = len(line) - len(line.lstrip())
            glue = "" if indent == value_col and not trailing_space else " "
            entries[-1][1] = entries[-1][1] + glue + chunk
        trailing_space = ended_with_space

    def first(key: str) -> str | None:
        for k, v in entries:
            if k == key:
                return v.strip()
        return None

    def every(key: str) -> list[str]:
        return [v.strip() for k, v in entries if k == key]

    if not entries:
        cpu.warnings.append("no 'key: value' lines found: unknown lscpu layout")
        return cpu
    cpu.architecture = _collapse(first("Architecture"))
    cpu.vendor = _collapse(first("Vendor ID"))
    models: list[str] = []
    for model in every("Model name"):
        collapsed = _collapse(model)
        if collapsed and collapsed not in models:
            models.append(collapsed)
    cpu.model = " / ".join(models) if models else None
    cpu.logical_cpus = _to_int(first("CPU(s)"))
    sockets = [s for s in (_to_int(v) for v in every("Socket(s)")) if s is not None]
    cpu.sockets = max(sockets) if sockets else None
    cores = [c for c in (_to_int(v) for v in every("Core(s) per socket")) if c is not None]
    cpu.cores_per_socket = sum(cores) if len(models) > 1 and cores else (cores[0] if cores else None)
    cpu.threads_per_core = _to_int(first("Thread(s) per core"))
    cpu.numa_nodes = _to_int(first("NUMA node(s)"))
    cpu.flags = _intersect([frozenset(v.split()) for v in every("Flags")])
    if cpu.architecture is None and cpu.vendor is not None:
        if cpu.vendor in _X86_VENDORS:
            cpu.architecture = "x86_64" if "lm" in cpu.flags or "64-bit" in (first("CPU op-mode(s)") or "") else "x86"
        elif cpu.vendor in ("ARM", "Apple", "Ampere", "Cavium", "Qualcomm", "HiSilicon", "NVIDIA", "Fujitsu"):
            cpu.architecture = "aarch64"
    if cpu.logical_cpus is None:
        cpu.warnings.append("lscpu did not report 'CPU(s)'")
    _x86_features(cpu)
    return cpu


def avx_warning(cpu: CpuInfo) -> str | None:
    """A warning sentence for an x86 CPU without AVX2 (CPU inference engines need it); else None."""
    if cpu.is_x86 and cpu.has_avx2 is False:
        model = cpu.model or "this CPU"
        return (
            f"{model} has no AVX2: CPU inference builds (llama.cpp, vLLM CPU) need AVX2, "
            "so CPU-only models will be very slow or will not start on this host."
        )
    return None


# --------------------------------------------------------------------------- /proc/stat

_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")


@dataclass
class CpuTimes:
    """The aggregate ``cpu`` line of ``/proc/stat`` in jiffies (USER_HZ ticks)."""

    total: dict[str, int] = field(default_factory=dict)
    #: Number of ``cpuN`` lines (online CPUs).
    per_cpu: int = 0
    #: user+nice+system+irq+softirq+steal (guest time is already inside user/nice).
    busy: int | None = None
    #: idle+iowait.
    idle: int | None = None
    warnings: list[str] = field(default_factory=list)


def parse_proc_stat(text: str) -> CpuTimes:
    """Parse the CPU lines of ``/proc/stat``; the rest (intr, ctxt, softirq, ...) is ignored."""
    times = CpuTimes()
    for raw in (text or "").splitlines():
        parts = raw.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        if parts[0] == "cpu":
            values: dict[str, int] = {}
            for name, value in zip(_CPU_FIELDS, parts[1:], strict=False):
                if not value.isdigit():
                    times.warnings.append(f"unparsable /proc/stat cpu field {name}={value!r}")
                    break
                values[name] = int(value)
            times.total = values
        elif parts[0][3:].isdigit():
            times.per_cpu += 1
    if not times.total:
        times.warnings.append("no aggregate 'cpu' line in /proc/stat")
        return times
    t = times.total
    if "idle" in t:
        times.idle = t["idle"] + t.get("iowait", 0)
        times.busy = sum(t.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))
    return times


def cpu_utilisation(prev: CpuTimes, cur: CpuTimes) -> float | None:
    """Busy percentage of all CPUs between two samples; None without elapsed time or if counters went back."""
    if prev.busy is None or prev.idle is None or cur.busy is None or cur.idle is None:
        return None
    busy = cur.busy - prev.busy
    idle = cur.idle - prev.idle
    if busy < 0 or idle < 0:
        return None
    elapsed = busy + idle
    if elapsed <= 0:
        return None
    return 100.0 * busy / elapsed


# --------------------------------------------------------------------------- /proc/meminfo, /proc/loadavg


@dataclass
class MemInfo:
    total_bytes: int | None = None
    #: MemAvailable; None on kernels that do not report it (it is never estimated here).
    available_bytes: int | None = None
    free_bytes: int | None = None
    warnings: list[str] = field(default_factory=list)


_MEMINFO_RE = re.compile(r"^(?P<key>[^:\s]+):\s*(?P<value>\d+)(?:\s*(?P<unit>[kKmMgG]?B))?\s*$")


def parse_meminfo(text: str) -> MemInfo:
    values: dict[str, int] = {}
    for raw in (text or "").splitlines():
        m = _MEMINFO_RE.match(raw.strip())
        if not m:
            continue
        factor = {"": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3, "b": 1}[(m.group("unit") or "").lower()]
        values.setdefault(m.group("key"), int(m.group("value")) * factor)
    info = MemInfo(
        total_bytes=values.get("MemTotal"),
        available_bytes=values.get("MemAvailable"),
        free_bytes=values.get("MemFree"),
    )
    if info.total_bytes is None:
        info.warnings.append("no MemTotal line in /proc/meminfo")
    return info


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    parts = (text or "").split()
    if len(parts) < 3:
        return None
    try:
        return float(parts[0]), float(parts[1]), float(parts[2])
    except ValueError:
        return None


# --------------------------------------------------------------------------- /proc/<pid>/stat


@dataclass
class PidStat:
    pid: int
    comm: str
    state: str
    pgrp: int
    #: utime + stime, in clock ticks.
    cpu_ticks: int
    rss_pages: int


def parse_pid_stat(text: str) -> PidStat | None:
    """Parse ``/proc/<pid>/stat``.  The command name may contain spaces and parentheses, so the
    fields are counted from the *last* ``)``."""
    if not text:
        return None
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    rest = text[close_paren + 1 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3]
    if len(rest) < 22:
        return None
    try:
        return PidStat(
            pid=int(text[:open_paren].strip()),
            comm=text[open_paren + 1 : close_paren],
            state=rest[0],
            pgrp=int(rest[2]),
            cpu_ticks=int(rest[11]) + int(rest[12]),
            rss_pages=int(rest[21]),
        )
    except ValueError:
        return None


def parse_proc_pid_stat(text: str) -> tuple[int, int] | None:
    """``(utime + stime in clock ticks, rss in pages)`` of one ``/proc/<pid>/stat``; None if unparsable."""
    stat = parse_pid_stat(text)
    if stat is None:
        return None
    return stat.cpu_ticks, stat.rss_pages


@dataclass
class ProcessGroupUsage:
    """CPU time and resident memory of the live processes of one process group."""

    pgid: int
    processes: int
    #: Cumulative user+system CPU seconds of the live members (exited members are not counted);
    #: None when ``clk_tck`` is not a positive number.
    cpu_seconds: float | None
    rss_bytes: int
    pids: list[int] = field(default_factory=list)


def process_group_usage(root: str, pgid: int, clk_tck: int, page_size: int) -> ProcessGroupUsage | None:
    """Sum CPU time and RSS over ``<root>/proc/*/stat`` entries whose process group is ``pgid``.

    This is the one I/O function of the module.  Processes that exit while it reads are skipped;
    zombies (no RSS) count as members.  Returns None when ``<root>/proc`` cannot be listed.
    """
    proc = os.path.join(root, "proc")
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    usage = ProcessGroupUsage(pgid=pgid, processes=0, cpu_seconds=0.0, rss_bytes=0)
    ticks = 0
    pages = 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:  # vanished (ENOENT/ESRCH) or not ours to read
            continue
        stat = parse_pid_stat(text)
        if stat is None or stat.pgrp != pgid:
            continue
        usage.processes += 1
        usage.pids.append(stat.pid)
        ticks += stat.cpu_ticks
        pages += max(stat.rss_pages, 0)
    usage.pids.sort()
    usage.cpu_seconds = ticks / clk_tck if clk_tck > 0 else None
    usage.rss_bytes = pages * page_size
    return usage
