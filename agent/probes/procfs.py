"""Parsers for ``/proc/cpuinfo``, ``lscpu``, ``/proc/stat``, ``/proc/meminfo``, ``/proc/loadavg``
and ``/proc/<pid>/stat``, plus a reader that sums the CPU time and RSS of a process group.

Everything except :func:`process_group_usage` is a pure function over text.  A leading UTF-8 BOM
is ignored.  A number is 1 to 20 ASCII digits (the kernel prints unsigned 64-bit counters); any
other value in a numeric field (``１２３``, ``12e5``, ``-``, a runaway digit string) is a warning
that names the field, and the rest of what was read is kept.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = [
    "CpuInfo",
    "CpuTimes",
    "LoadAverage",
    "MemInfo",
    "PidStat",
    "ProcessGroupUsage",
    "avx_warning",
    "cpu_utilisation",
    "parse_cpuinfo",
    "parse_load_average",
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


# --------------------------------------------------------------------------- numbers

# int() alone would take "１２３", "1_000" and " 12 ", and str.isdigit() passes "²", which int()
# then refuses; 2**64 - 1 has 20 digits, and int() gives up on strings past 4300.
_COUNT_RE = re.compile(r"[0-9]{1,20}")
_DIGITS_RE = re.compile(r"[0-9]+")


def _lines(text: str | None) -> list[str]:
    return (text or "").lstrip("\ufeff").splitlines()


def _count(value: str) -> int | None:
    """A non-negative kernel counter: 1 to 20 ASCII digits; None otherwise."""
    return int(value) if _COUNT_RE.fullmatch(value) else None


def _not_a_number(source: str, field_name: str, value: str) -> str:
    if _DIGITS_RE.fullmatch(value):
        return f"{source}: {field_name} has {len(value)} digits, more than a 64-bit counter holds; ignored"
    shown = value if len(value) <= 40 else value[:40] + "..."
    return f"{source}: {field_name} is not a plain number ({shown!r}); ignored"


def _field_count(value: str, source: str, field_name: str, warnings: list[str]) -> int | None:
    """:func:`_count`, with a warning naming the field when ``value`` is not one."""
    number = _count(value)
    if number is None:
        warnings.append(_not_a_number(source, field_name, value))
    return number


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
    return _count(value.strip())


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
    for raw in _lines(text):
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

    processors = [
        b
        for b in blocks
        if "processor" in b and _field_count(b["processor"], "/proc/cpuinfo", "processor", cpu.warnings) is not None
    ]
    if not processors:
        cpu.warnings.append("no 'processor' entries found: unknown /proc/cpuinfo layout")
        return cpu
    first = processors[0]
    cpu.logical_cpus = len(processors)
    cpu.vendor = _collapse(first.get("vendor_id"))
    cpu.model = _collapse(first.get("model name"))
    physical_ids = {b["physical id"] for b in processors if "physical id" in b}
    cpu.sockets = len(physical_ids) if physical_ids else None
    cpu.cores_per_socket = _cpuinfo_count(first, "cpu cores", cpu.warnings)
    siblings = _cpuinfo_count(first, "siblings", cpu.warnings)
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


def _cpuinfo_count(block: dict[str, str], key: str, warnings: list[str]) -> int | None:
    value = block.get(key)
    return None if value is None else _field_count(value, "/proc/cpuinfo", key, warnings)


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
    for raw in _lines(text):
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
_BUSY_FIELDS = ("user", "nice", "system", "irq", "softirq", "steal")
_IDLE_FIELDS = ("idle", "iowait")


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
    """Parse the CPU lines of ``/proc/stat``; the rest (intr, ctxt, softirq, ...) is ignored.

    A field of the ``cpu`` line that is not a number is left out of ``total`` with a warning; the
    other fields are kept, and ``busy``/``idle`` are None when a field they add up is the one lost.
    """
    times = CpuTimes()
    found = False
    lost: set[str] = set()
    for raw in _lines(text):
        parts = raw.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        if parts[0] == "cpu":
            found = True
            values: dict[str, int] = {}
            lost = set()
            for name, value in zip(_CPU_FIELDS, parts[1:], strict=False):
                number = _field_count(value, "/proc/stat", f"cpu {name}", times.warnings)
                if number is None:
                    lost.add(name)
                else:
                    values[name] = number
            times.total = values
        elif _count(parts[0][3:]) is not None:
            times.per_cpu += 1
    if not found:
        times.warnings.append("no aggregate 'cpu' line in /proc/stat")
        return times
    t = times.total
    # Old kernels print fewer columns; the first four are always there.
    if "idle" in t and not lost & set(_IDLE_FIELDS):
        times.idle = t["idle"] + t.get("iowait", 0)
    if {"user", "nice", "system"} <= t.keys() and not lost & set(_BUSY_FIELDS):
        times.busy = sum(t.get(k, 0) for k in _BUSY_FIELDS)
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


# "Key:   value [unit]"; a line of any other shape is not a field and is skipped.
_MEMINFO_RE = re.compile(r"^(?P<key>[^:\s]+):\s*(?P<value>\S+)(?:\s+(?P<unit>\S+))?$")
_MEMINFO_UNITS = {"": 1, "b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}


def parse_meminfo(text: str) -> MemInfo:
    """Parse ``/proc/meminfo``.  A field whose value is not a number (or whose unit is unknown) is
    left out with a warning naming it; every other field is kept."""
    values: dict[str, int] = {}
    seen: set[str] = set()  # keys met, whether or not their value could be read
    warnings: list[str] = []
    for raw in _lines(text):
        m = _MEMINFO_RE.match(raw.strip())
        if not m or m.group("key") in values:
            continue
        key = m.group("key")
        seen.add(key)
        unit = m.group("unit") or ""
        factor = _MEMINFO_UNITS.get(unit.lower())
        if factor is None:
            shown = unit if len(unit) <= 20 else unit[:20] + "..."
            warnings.append(f"/proc/meminfo: {key} has an unknown unit ({shown!r}); ignored")
            continue
        number = _field_count(m.group("value"), "/proc/meminfo", key, warnings)
        if number is not None:
            values[key] = number * factor
    info = MemInfo(
        total_bytes=values.get("MemTotal"),
        available_bytes=values.get("MemAvailable"),
        free_bytes=values.get("MemFree"),
        warnings=warnings,
    )
    if "MemTotal" not in seen:
        info.warnings.append("no MemTotal line in /proc/meminfo")
    return info


_LOAD_NAMES = ("1-minute load", "5-minute load", "15-minute load")
# A load average as the kernel prints it ("0.52"): ASCII digits, one optional fraction.
_LOAD_RE = re.compile(r"[0-9]{1,10}(?:\.[0-9]{1,10})?")


@dataclass
class LoadAverage:
    """The three averages of ``/proc/loadavg``; each None when it could not be read."""

    one: float | None = None
    five: float | None = None
    fifteen: float | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def values(self) -> tuple[float, float, float] | None:
        """All three averages, or None when any is unknown."""
        if self.one is None or self.five is None or self.fifteen is None:
            return None
        return self.one, self.five, self.fifteen


def parse_load_average(text: str) -> LoadAverage:
    """Parse ``/proc/loadavg`` (``0.52 0.58 0.59 1/467 12345``).  An average that is not a number
    is None with a warning naming it; the other averages are kept."""
    load = LoadAverage()
    parts = " ".join(_lines(text)).split()
    numbers: list[float | None] = []
    for name, value in zip(_LOAD_NAMES, parts, strict=False):
        if _LOAD_RE.fullmatch(value):
            numbers.append(float(value))
        else:
            numbers.append(None)
            load.warnings.append(_not_a_number("/proc/loadavg", name, value))
    if len(parts) < 3:
        load.warnings.append(f"/proc/loadavg has {len(parts)} of the 3 load averages")
    numbers += [None] * (3 - len(numbers))
    load.one, load.five, load.fifteen = numbers
    return load


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    """The three averages of ``/proc/loadavg``; None unless all three are numbers."""
    return parse_load_average(text).values


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
    fields are counted from the *last* ``)``.  None when a field it needs is not a number."""
    text = (text or "").lstrip("\ufeff")
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
    numbers = [_count(v) for v in (text[:open_paren].strip(), rest[2], rest[11], rest[12], rest[21])]
    pid, pgrp, utime, stime, rss = numbers
    if pid is None or pgrp is None or utime is None or stime is None or rss is None:
        return None
    return PidStat(
        pid=pid,
        comm=text[open_paren + 1 : close_paren],
        state=rest[0],
        pgrp=pgrp,
        cpu_ticks=utime + stime,
        rss_pages=rss,
    )


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
