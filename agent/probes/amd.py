"""AMD GPUs from ``amd-smi`` (JSON where the tool has it, its text otherwise), ``rocm-smi`` and
``rocminfo``.

Every reader turns its tool's output into the same :class:`AmdReport`: cards with model,
memory, utilisation, temperatures (edge, junction, memory), power and its cap, ECC counts and
partition modes, and the links between cards (XGMI or PCIe). The shapes read, all from captures:

- ``amd-smi static|metric|list --json``: a top-level list ``[{"gpu": 0, ...}]`` (up to ROCm 6.3,
  and newer versions in compatibility mode) or ``{"gpu_data": [...]}``; a figure is a number, a
  string with its unit (``"300 W"``), ``{"value": 300, "unit": "W"}`` or ``"N/A"``; keys moved
  between versions (``total_correctable_count`` / ``total_correctable``), so each lookup lists
  the spellings it takes.
- ``amd-smi static`` / ``metric`` text: ``GPU: N`` blocks of indented ``KEY: VALUE`` lines, read
  into the same nested mapping as the JSON (keys lower-cased) and taken by the same code;
  ``amd-smi monitor``: a table whose figures carry their units as separate words;
  ``amd-smi topology``: ``LINK TYPE`` / ``HOPS`` / ``WEIGHT`` tables keyed by PCI address.
- ``rocm-smi --json``: ``{"cardN": {...}, "system": {...}}`` with the key names of its version
  (``GPU ID``, then ``Device ID``; ``Card series`` then ``Card Series``, sometimes a hex id where a
  name belongs); ``rocm-smi -a`` text: ``GPU[N] : key: value`` lines of the same keys; the
  concise table of plain ``rocm-smi``.
- ``rocminfo``: the HSA agents (a GPU's ``gfx`` target, marketing name, compute units, memory
  pool) and whether the ``ROCk module is loaded``.

A card's class is its marketed name and memory, as NVIDIA cards' are: ``MI300X-192GB``.
Unknown is None: ``N/A``, a missing key, NaN, infinity or a negative reading (a sensor that
failed) never become 0; a reading dropped for being impossible is said in ``warnings``.
Parsers never raise. No Django import; Python 3.11+.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.probes.jsontext import read_json
from agent.probes.nvidia import nvidia_class_memory_gb

__all__ = [
    "AmdGpu",
    "AmdLink",
    "AmdReport",
    "PARTITIONS",
    "RocmAgent",
    "RocmInfo",
    "amd_class",
    "merge_reports",
    "parse_amd_smi_json",
    "parse_amd_smi_text",
    "parse_amd_topology",
    "parse_rocm_smi_json",
    "parse_rocm_smi_text",
    "parse_rocminfo",
]

#: Compute partition modes and how many devices each makes of one card (CPX: one per XCD).
PARTITIONS = {"SPX": 1, "DPX": 2, "TPX": 3, "QPX": 4, "CPX": 8}
#: Marketed memory sizes (GB) of AMD cards, for the class: MI50 16/32, MI100 32, MI210 64,
#: MI250X 128, MI300A 128 (64 GB per partition seen), MI300X 192, MI325X 256, MI355X 288.
AMD_MARKETED_GB = (4, 8, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 288)
#: More cards than the protocol takes on one node.
MAX_GPUS = 256
_MAX_LINES = 200_000


@dataclass
class AmdGpu:
    """One AMD GPU (a whole card, or one compute partition of one)."""

    index: int  # amd-smi's "gpu", rocm-smi's cardN / GPU[N]
    name: str | None = None
    gpu_class: str | None = None
    device_id: str | None = None  # "0x74a1"
    gfx: str | None = None  # "gfx942"
    bdf: str | None = None  # "0000:0c:00.0"
    uuid: str | None = None
    hip_id: int | None = None  # the index HIP and ROCr give it, where amd-smi says
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    utilization_gpu_pct: float | None = None
    utilization_memory_pct: float | None = None
    temperature_edge_c: float | None = None
    temperature_junction_c: float | None = None
    temperature_memory_c: float | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None
    ecc_correctable: int | None = None
    ecc_uncorrectable: int | None = None
    compute_partition: str | None = None  # SPX, DPX, QPX, CPX
    memory_partition: str | None = None  # NPS1, NPS4
    partition_id: int | None = None
    compute_units: int | None = None
    numa_node: int | None = None


@dataclass
class AmdLink:
    """How two cards reach each other: ``a`` and ``b`` name them by PCI address (amd-smi) or
    index (rocm-smi's DRM devices); :func:`merge_reports` turns both into indices."""

    a: str
    b: str
    kind: str  # "XGMI", "PCIE"
    hops: int | None = None
    weight: int | None = None


@dataclass
class AmdReport:
    gpus: list[AmdGpu] = field(default_factory=list)
    links: list[AmdLink] = field(default_factory=list)
    driver_version: str | None = None
    tool: str | None = None  # "amd-smi", "rocm-smi"
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- values

_UNKNOWN = frozenset({"n/a", "na", "none", "unknown", "not supported", "unsupported", ""})
_NUMBER_RE = re.compile(
    r"^\(?\s*([+-]?\d{1,20}(?:\.\d{1,20})?(?:[eE][+-]?\d{1,3})?)\s*\)?\s*([^\d\s].{0,15})?$", re.ASCII
)
_HEX_RE = re.compile(r"^0x[0-9a-fA-F]{1,16}$")
_BDF_RE = re.compile(r"^(?:[0-9a-fA-F]{4,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")


def _text(value: Any, limit: int = 200) -> str | None:
    """A string figure, trimmed; None for the tool's spellings of unknown."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return str(value) if not isinstance(value, float) or math.isfinite(value) else None
    if not isinstance(value, str):
        return None
    cleaned = " ".join(value.replace("\x00", "").split())[:limit]
    return None if cleaned.lower() in _UNKNOWN else cleaned


def _figure(value: Any) -> tuple[float | None, str]:
    """(number, unit) of a figure in any of amd-smi's and rocm-smi's shapes."""
    if isinstance(value, Mapping):
        number, unit = _figure(value.get("value"))
        given = value.get("unit")
        return number, given if isinstance(given, str) else unit
    if isinstance(value, bool) or value is None:
        return None, ""
    if isinstance(value, int | float):
        number = float(value)
        return (number if math.isfinite(number) else None), ""
    text = _text(value, 60)
    if text is None:
        return None, ""
    match = _NUMBER_RE.match(text.replace(",", ""))
    if match is None:
        return None, ""
    try:
        number = float(match.group(1))
    except (ValueError, OverflowError):
        return None, ""
    return (number if math.isfinite(number) else None), (match.group(2) or "").strip()


class _Reader:
    """Figures read with the report's warnings at hand: an impossible one (negative, above its
    bound) is unknown, and said once per field."""

    def __init__(self, report: AmdReport, where: str) -> None:
        self.report = report
        self.where = where

    def reading(self, value: Any, what: str, high: float) -> float | None:
        number, _unit = _figure(value)
        if number is None:
            return None
        if number < 0 or number > high:
            self.report.warnings.append(f"{self.where}: {what} {number:g} is impossible; read as unknown")
            return None
        return number

    def count(self, value: Any, what: str) -> int | None:
        number = self.reading(value, what, 2.0**63)
        return int(number) if number is not None else None

    def mib(self, value: Any, what: str, default_unit: str = "MB") -> int | None:
        """A memory amount as MiB: amd-smi's MB are MiB (196300 MB on a 192 GB card), rocm-smi
        gives bytes."""
        number, unit = _figure(value)
        if number is None:
            return None
        factor = {"b": 1 / 2**20, "kb": 1 / 1024, "kib": 1 / 1024, "mb": 1.0, "mib": 1.0, "gb": 1024.0, "gib": 1024.0}
        scale = factor.get((unit or default_unit).lower())
        if scale is None or number < 0 or number * scale > 2**40:
            self.report.warnings.append(f"{self.where}: {what} {number:g} {unit} is not a memory amount; unknown")
            return None
        return int(round(number * scale))


def _pick(data: Any, *paths: str) -> Any:
    """The first of ``paths`` (dotted keys, case-insensitive) present in ``data``."""
    for path in paths:
        node: Any = data
        for key in path.split("."):
            if not isinstance(node, Mapping):
                node = None
                break
            found = node.get(key)
            if found is None:
                found = next((v for k, v in node.items() if isinstance(k, str) and k.lower() == key), None)
            node = found
        if isinstance(node, Mapping) or (node is not None and _text(node) is not None):
            return node
    return None


def _int(value: Any) -> int | None:
    number, _unit = _figure(value)
    if number is None or number != int(number) or abs(number) > 2**31:
        return None
    return int(number)


def _partition(value: Any) -> str | None:
    text = _text(value, 16)
    return text.upper() if text and re.fullmatch(r"[A-Za-z]{2,4}\d?", text) else None


def _bdf(value: Any) -> str | None:
    text = _text(value, 32)
    return text.lower() if text and _BDF_RE.match(text) else None


def _hex_id(value: Any) -> str | None:
    text = _text(value, 20)
    return text.lower() if text and _HEX_RE.match(text) else None


# --------------------------------------------------------------------------- class


_NAME_NOISE = frozenset({"amd", "ati", "instinct", "radeon", "graphics", "oam", "technologies", "inc.", "series"})
_MEMORY_WORD_RE = re.compile(r"^\d{1,4}(?:GB|G|GiB)$", re.IGNORECASE | re.ASCII)
_BRACKET_RE = re.compile(r"^(?P<code>[^\[]*)\[(?P<inside>[^\]]*)\]")
#: Product names by PCI device id, for a tool that prints an id where the name belongs.
_DEVICE_NAMES = {
    "0x74a1": "MI300X",
    "0x74a5": "MI325X",
    "0x74a0": "MI300A",
    "0x740f": "MI210",
    "0x740c": "MI250X",
    "0x738c": "MI100",
    "0x66a1": "MI50",
}


def _words(text: str) -> str:
    tokens = [t for t in re.split(r"[\s_]+", text.strip()) if t]
    kept = [t for t in tokens if t.lower() not in _NAME_NOISE and not _MEMORY_WORD_RE.match(t)]
    if kept and kept[0].lower() == "rx":  # "Radeon RX 7900 XTX" keeps its RX
        return "".join(kept)
    return "".join(kept) or "".join(tokens)


def _base_name(name: str | None, device_id: str | None) -> str | None:
    """The marketed name without vendor words: "AMD Instinct MI300X OAM" -> "MI300X";
    "Arcturus GL-XL [Instinct MI100]" -> "MI100"; a bracket naming several products ("Navi 22
    [Radeon RX 6700/6700 XT / 6800M]") -> the code name before it ("Navi22"), which names no
    product the card is not."""
    text = _text(name, 200)
    if text is None or _HEX_RE.match(text):
        return _DEVICE_NAMES.get(device_id or "")
    bracket = _BRACKET_RE.match(text)
    if bracket:
        inside = bracket.group("inside")
        text = inside if "/" not in inside and inside.strip() else bracket.group("code")
    mi = re.search(r"\bMI\d{2,3}[A-Z]?\b", text)
    if mi:
        return mi.group(0)
    return _words(text) or _DEVICE_NAMES.get(device_id or "")


def amd_class(name: str | None, memory_total_mib: int | None, device_id: str | None = None) -> str | None:
    """A short, stable class for scheduling: ``MI300X-192GB``, ``MI210-64GB``, ``Navi22-12GB``."""
    base = _base_name(name, device_id)
    if not base:
        return None
    memory_gb = nvidia_class_memory_gb(memory_total_mib, name, sizes=AMD_MARKETED_GB)
    return base if memory_gb is None else f"{base}-{memory_gb}GB"


# --------------------------------------------------------------------------- amd-smi (JSON and text)


def _entries(data: Any) -> list[Mapping[str, Any]]:
    if isinstance(data, Mapping):
        for key in ("gpu_data", "gpus"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
        else:
            data = [data] if "gpu" in data else []
    if not isinstance(data, list):
        return []
    return [entry for entry in data[:MAX_GPUS] if isinstance(entry, Mapping)]


def _amd_smi_gpu(entry: Mapping[str, Any], report: AmdReport, position: int) -> AmdGpu:
    index = _int(entry.get("gpu"))
    gpu = AmdGpu(index=index if index is not None and 0 <= index < MAX_GPUS else position)
    read = _Reader(report, f"amd-smi GPU {gpu.index}")
    gpu.name = _text(_pick(entry, "asic.market_name", "board.product_name", "market_name"))
    gpu.device_id = _hex_id(_pick(entry, "asic.device_id", "device_id"))
    gpu.gfx = _text(_pick(entry, "asic.target_graphics_version", "target_graphics_version"), 20)
    gpu.compute_units = _int(_pick(entry, "asic.num_compute_units"))
    gpu.bdf = _bdf(_pick(entry, "bus.bdf", "bdf"))
    gpu.uuid = _text(_pick(entry, "uuid"), 100)
    gpu.hip_id = _int(_pick(entry, "hip_id"))
    gpu.numa_node = _int(_pick(entry, "numa.node"))
    gpu.memory_total_mib = read.mib(_pick(entry, "mem_usage.total_vram", "vram.size", "vram_size"), "total memory")
    gpu.memory_used_mib = read.mib(_pick(entry, "mem_usage.used_vram", "used_vram"), "memory used")
    gpu.utilization_gpu_pct = read.reading(_pick(entry, "usage.gfx_activity", "gfx_activity"), "GFX activity", 100)
    gpu.utilization_memory_pct = read.reading(_pick(entry, "usage.umc_activity", "umc_activity"), "UMC activity", 100)
    gpu.temperature_edge_c = read.reading(_pick(entry, "temperature.edge"), "edge temperature", 200)
    gpu.temperature_junction_c = read.reading(
        _pick(entry, "temperature.hotspot", "temperature.junction"), "junction temperature", 200
    )
    gpu.temperature_memory_c = read.reading(_pick(entry, "temperature.mem", "temperature.vram"), "memory temp", 200)
    gpu.power_draw_w = read.reading(
        _pick(entry, "power.socket_power", "power.current_socket_power", "power.average_socket_power"), "power", 5000
    )
    gpu.power_limit_w = read.reading(
        _pick(entry, "limit.socket_power", "limit.power_cap", "power.power_limit", "limit.max_power"), "power cap", 5000
    )
    if gpu.power_limit_w == 0:  # an integrated GPU says 0 W where it has no cap of its own
        gpu.power_limit_w = None
    gpu.ecc_correctable = read.count(_pick(entry, "ecc.total_correctable_count", "ecc.total_correctable"), "ECC")
    gpu.ecc_uncorrectable = read.count(_pick(entry, "ecc.total_uncorrectable_count", "ecc.total_uncorrectable"), "ECC")
    gpu.compute_partition = _partition(_pick(entry, "partition.compute_partition", "compute_partition"))
    gpu.memory_partition = _partition(_pick(entry, "partition.memory_partition", "memory_partition"))
    gpu.partition_id = _int(_pick(entry, "partition.partition_id", "partition_id"))
    report.driver_version = report.driver_version or _driver(_pick(entry, "driver.version"))
    return gpu


def _classify(report: AmdReport) -> AmdReport:
    for gpu in report.gpus:
        gpu.gpu_class = amd_class(gpu.name, gpu.memory_total_mib, gpu.device_id)
    return report


def _driver(value: Any) -> str | None:
    """The amdgpu driver's version; amd-smi with the in-tree driver prints /proc/version's whole
    line without spaces instead, from which the kernel's version is taken."""
    text = _text(value, 400)
    if text is None:
        return None
    match = re.search(r"\d+\.\d+(?:\.\d+)?(?:[-.+][0-9A-Za-z.+_-]{0,40})?", text)
    return match.group(0)[:64] if match else None


def parse_amd_smi_json(text: str) -> AmdReport:
    """``amd-smi static|metric|list --json`` (any of them; merge them with :func:`merge_reports`)."""
    report = AmdReport(tool="amd-smi")
    data, notes = read_json((text or "").strip())
    report.warnings += [f"amd-smi --json: {note}" for note in notes]
    if data is None:
        if (text or "").strip():
            report.warnings.append("amd-smi --json output is not JSON")
        return report
    entries = _entries(data)
    if not entries:
        report.warnings.append("amd-smi --json describes no GPU")
    report.gpus = [_amd_smi_gpu(entry, report, position) for position, entry in enumerate(entries)]
    return _classify(report)


def _lines(text: str) -> list[str]:
    return (text or "").lstrip("\ufeff").replace("\x00", "").splitlines()[:_MAX_LINES]


_KEY_RE = re.compile(r"^(?P<key>[A-Za-z0-9_ ().%/-]{1,80}):\s*(?P<value>.*)$")
_GPU_BLOCK_RE = re.compile(r"^GPU:\s*(?P<index>\d{1,4})\s*$")


def _indented_tree(lines: list[str]) -> dict[str, Any]:
    """``KEY: VALUE`` lines nested by indentation into a dict of lower-cased keys (a key seen
    twice at one level keeps its first value, as a list of policies repeats POLICY_ID)."""
    root: dict[str, Any] = {}
    stack: list[tuple[int, dict[str, Any]]] = [(-1, root)]
    for raw in lines:
        line = raw.expandtabs(4).rstrip()
        body = line.lstrip(" ")
        match = _KEY_RE.match(body)
        if not body or match is None:
            continue
        indent = len(line) - len(body)
        while len(stack) > 1 and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1]
        key, value = match.group("key").strip().lower(), match.group("value").strip()
        if value:
            parent.setdefault(key, value)
            continue
        existing = parent.get(key)
        child: dict[str, Any] = existing if isinstance(existing, dict) else {}
        parent.setdefault(key, child)
        stack.append((indent, child))
    return root


_MONITOR_HEAD_RE = re.compile(r"^\s*GPU\s+(?:[A-Z_]+\s+){2,}[A-Z_]+\s*$")
_MONITOR_FIELDS = {
    "POWER": "power.socket_power",
    "GPU_TEMP": "temperature.hotspot",
    "HOTSPOT_TEMP": "temperature.hotspot",
    "EDGE_TEMP": "temperature.edge",
    "MEM_TEMP": "temperature.mem",
    "GFX_UTIL": "usage.gfx_activity",
    "MEM_UTIL": "usage.umc_activity",
    "VRAM_USED": "mem_usage.used_vram",
    "VRAM_TOTAL": "mem_usage.total_vram",
}


def _monitor_values(line: str) -> list[str]:
    """A monitor row's figures, each with the unit word that follows it ("171 W")."""
    values: list[str] = []
    for token in line.split():
        if values and not re.match(r"^[+-]?\d|^N/A$", token, re.IGNORECASE):
            values[-1] += " " + token
        else:
            values.append(token)
    return values


def _monitor(lines: list[str], report: AmdReport) -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = []
    header: list[str] | None = None
    for line in lines:
        if _MONITOR_HEAD_RE.match(line):
            header = line.split()
            continue
        if header is None or not line.strip():
            continue
        values = _monitor_values(line)
        if len(values) != len(header):
            report.warnings.append(f"amd-smi monitor: a row of {len(values)} figures under {len(header)} columns")
            continue
        entry: dict[str, Any] = {"gpu": values[0]}
        for column, value in zip(header[1:], values[1:], strict=True):
            path = _MONITOR_FIELDS.get(column)
            if path:
                section, key = path.split(".")
                entry.setdefault(section, {})[key] = value
        entries.append(entry)
    return entries


def parse_amd_smi_text(text: str) -> AmdReport:
    """``amd-smi static`` / ``metric`` (``GPU: N`` blocks), ``amd-smi monitor`` (a table) or
    ``amd-smi topology`` (its tables; :func:`parse_amd_topology`), in their human layouts."""
    report = AmdReport(tool="amd-smi")
    lines = _lines(text)
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    for line in lines:
        if line and not line[0].isspace():
            match = _GPU_BLOCK_RE.match(line.strip())
            if match and len(blocks) < MAX_GPUS:
                blocks.append((int(match.group("index")), []))
                current = blocks[-1][1]
            else:
                current = None  # a CPU block, a table: not a GPU's
        elif current is not None:
            current.append(line)
    entries: list[dict[str, Any]] = [{**_indented_tree(body), "gpu": index} for index, body in blocks]
    if not entries:
        entries = _monitor(lines, report)
    report.gpus = [_amd_smi_gpu(entry, report, position) for position, entry in enumerate(entries[:MAX_GPUS])]
    report.links = parse_amd_topology(text).links
    if not report.gpus and not report.links and (text or "").strip():
        report.warnings.append("amd-smi output of a layout not known: no GPU block, monitor table or topology table")
    return _classify(report)


_TABLE_RE = re.compile(r"^(?P<name>[A-Z][A-Z ]{1,40}) TABLE:\s*$")


def _tables(lines: list[str]) -> dict[str, tuple[list[str], dict[str, list[str]]]]:
    """``<NAME> TABLE:`` sections: name -> (column keys, row key -> cells)."""
    tables: dict[str, tuple[list[str], dict[str, list[str]]]] = {}
    current: tuple[list[str], dict[str, list[str]]] | None = None
    for line in lines:
        title = _TABLE_RE.match(line.strip())
        if title:
            current = ([], {})
            tables[title.group("name").strip()] = current
            continue
        if current is None or not line.strip():
            continue
        cells = line.split()
        if not current[0]:
            current[0].extend(cells[:MAX_GPUS])
        elif len(cells) == len(current[0]) + 1:
            current[1][cells[0]] = cells[1:]
    return tables


def parse_amd_topology(text: str) -> AmdReport:
    """``amd-smi topology`` (text): a link for each pair of cards, with its type, hops and weight."""
    report = AmdReport(tool="amd-smi")
    tables = _tables(_lines(text))
    types = tables.get("LINK TYPE")
    if types is None:
        return report
    hops, weights = tables.get("HOPS"), tables.get("WEIGHT")
    columns, rows = types
    for row, cells in rows.items():
        for column, kind in zip(columns, cells, strict=True):
            if column <= row or kind.upper() in ("SELF", "N/A"):
                continue
            position = columns.index(column)
            report.links.append(
                AmdLink(
                    a=row.lower(),
                    b=column.lower(),
                    kind=kind.upper()[:16],
                    hops=_int(hops[1].get(row, [None] * len(columns))[position]) if hops else None,
                    weight=_int(weights[1].get(row, [None] * len(columns))[position]) if weights else None,
                )
            )
    return report


# --------------------------------------------------------------------------- rocm-smi


_CARD_RE = re.compile(r"^card(\d{1,4})$")
_TOPO_KEY_RE = re.compile(
    r"^\(Topology\) (?P<what>Weight|Hops|Link type) between DRM devices (?P<a>\d{1,4}) and (?P<b>\d{1,4})$"
)


def _rocm_gpu(index: int, card: Mapping[str, Any], report: AmdReport) -> AmdGpu:
    gpu = AmdGpu(index=index)
    read = _Reader(report, f"rocm-smi GPU {index}")
    gpu.device_id = _hex_id(_pick(card, "Device ID", "GPU ID", "Card Model", "Card model"))
    series = _pick(card, "Card Series", "Card series", "Device Name", "Card SKU")
    gpu.name = None if _hex_id(series) else _text(series)
    gpu.gfx = _text(_pick(card, "GFX Version"), 20)
    gpu.bdf = _bdf(_pick(card, "PCI Bus"))
    gpu.uuid = _text(_pick(card, "Unique ID"), 100)
    gpu.numa_node = _int(_pick(card, "(Topology) Numa Node"))
    gpu.memory_total_mib = read.mib(_pick(card, "VRAM Total Memory (B)"), "total memory", "B")
    gpu.memory_used_mib = read.mib(_pick(card, "VRAM Total Used Memory (B)"), "memory used", "B")
    gpu.utilization_gpu_pct = read.reading(_pick(card, "GPU use (%)"), "GPU use", 100)
    gpu.utilization_memory_pct = read.reading(_pick(card, "GPU Memory Read/Write Activity (%)"), "memory activity", 100)
    gpu.temperature_edge_c = read.reading(_pick(card, "Temperature (Sensor edge) (C)"), "edge temperature", 200)
    gpu.temperature_junction_c = read.reading(
        _pick(card, "Temperature (Sensor junction) (C)"), "junction temperature", 200
    )
    gpu.temperature_memory_c = read.reading(_pick(card, "Temperature (Sensor memory) (C)"), "memory temp", 200)
    gpu.power_draw_w = read.reading(
        _pick(
            card,
            "Current Socket Graphics Package Power (W)",
            "Average Graphics Package Power (W)",
            "Current Graphics Package Power (W)",
        ),
        "power",
        5000,
    )
    gpu.power_limit_w = read.reading(_pick(card, "Max Graphics Package Power (W)"), "power cap", 5000) or None
    gpu.compute_partition = _partition(_pick(card, "Compute Partition"))
    gpu.memory_partition = _partition(_pick(card, "Memory Partition"))
    return gpu


def _rocm_links(system: Mapping[str, Any]) -> list[AmdLink]:
    pairs: dict[tuple[str, str], dict[str, str]] = {}
    for key, value in list(system.items())[:20_000]:
        match = _TOPO_KEY_RE.match(str(key))
        text = _text(value, 20)
        if match and text is not None:
            pairs.setdefault((match.group("a"), match.group("b")), {})[match.group("what")] = text
    return [
        AmdLink(a, b, seen["Link type"].upper()[:16], hops=_int(seen.get("Hops")), weight=_int(seen.get("Weight")))
        for (a, b), seen in sorted(pairs.items())
        if "Link type" in seen
    ]


def _rocm_report(cards: Mapping[str, Any], report: AmdReport) -> AmdReport:
    for key, card in cards.items():
        match = _CARD_RE.match(str(key))
        if match and isinstance(card, Mapping) and len(report.gpus) < MAX_GPUS:
            report.gpus.append(_rocm_gpu(int(match.group(1)), card, report))
    report.gpus.sort(key=lambda g: g.index)
    system = cards.get("system")
    if isinstance(system, Mapping):
        report.driver_version = _driver(_pick(system, "Driver version"))
        report.links = _rocm_links(system)
    return _classify(report)


def parse_rocm_smi_json(text: str) -> AmdReport:
    """``rocm-smi ... --json``: ``{"card0": {...}, "system": {...}}`` of any version."""
    report = AmdReport(tool="rocm-smi")
    data, notes = read_json((text or "").strip())
    report.warnings += [f"rocm-smi --json: {note}" for note in notes]
    if not isinstance(data, Mapping):
        if (text or "").strip():
            report.warnings.append("rocm-smi --json output is not a JSON object")
        return report
    _rocm_report(data, report)
    if not report.gpus:
        report.warnings.append("rocm-smi --json describes no card")
    return report


_SHOWALL_RE = re.compile(r"^GPU\[(?P<index>\d{1,4})\]\s*:\s*(?P<key>[^:]{1,100}?)\s*:\s*(?P<value>.*)$")
_CONCISE_RE = re.compile(
    r"^(?P<index>\d{1,4})\s+(?:\[(?P<id>0x[0-9a-fA-F]{1,8})\s*:\s*0x[0-9a-fA-F]{1,4}\]\s+)?(?P<rest>.*)$"
)


def _concise(lines: list[str], report: AmdReport) -> None:
    """Plain ``rocm-smi``'s table: each row's temperature, power, partitions, cap and use, and
    the name on the line below it (newer layouts)."""
    for position, line in enumerate(lines):
        match = _CONCISE_RE.match(line.strip())
        if match is None or "%" not in line or len(report.gpus) >= MAX_GPUS:
            continue
        rest = match.group("rest")
        gpu = AmdGpu(index=int(match.group("index")), device_id=(match.group("id") or "").lower() or None)
        read = _Reader(report, f"rocm-smi GPU {gpu.index}")
        temps = re.findall(r"(-?[\d.]+)\s*°?C\b", rest)
        watts = re.findall(r"(-?[\d.]+)\s*W\b", rest)
        percents = re.findall(r"(-?[\d.]+)%", rest)
        gpu.temperature_junction_c = read.reading(temps[0], "temperature", 200) if temps else None
        gpu.power_draw_w = read.reading(watts[0], "power", 5000) if watts else None
        gpu.power_limit_w = read.reading(watts[-1], "power cap", 5000) if len(watts) > 1 else None
        if len(percents) >= 2:
            gpu.utilization_gpu_pct = read.reading(percents[-1], "GPU use", 100)
        parts = re.search(r"\b(NPS\d)\s*,\s*([A-Z]PX)\b", rest)
        if parts:
            gpu.memory_partition, gpu.compute_partition = parts.group(1), parts.group(2)
        below = lines[position + 1].strip() if position + 1 < len(lines) else ""
        if below and not _CONCISE_RE.match(below) and not below.startswith("="):
            gpu.name = _text(below, 60)
        report.gpus.append(gpu)


def parse_rocm_smi_text(text: str) -> AmdReport:
    """``rocm-smi -a`` (``GPU[N] : key: value`` lines, the keys of ``--json``) or plain
    ``rocm-smi`` (the concise table)."""
    report = AmdReport(tool="rocm-smi")
    lines = _lines(text)
    cards: dict[str, dict[str, str]] = {}
    for line in lines:
        match = _SHOWALL_RE.match(line.strip())
        if match:
            card = cards.setdefault(f"card{match.group('index')}", {})
            card.setdefault(match.group("key").strip(), match.group("value").strip())
        elif line.startswith("Driver version:"):
            cards.setdefault("system", {})["Driver version"] = line.split(":", 1)[1].strip()
    if any(key.startswith("card") for key in cards):
        return _rocm_report(cards, report)
    _concise(lines, report)
    if not report.gpus and (text or "").strip():
        report.warnings.append("rocm-smi output of a layout not known: no GPU[N] lines and no concise table")
    return _classify(report)


# --------------------------------------------------------------------------- rocminfo


@dataclass
class RocmAgent:
    """One GPU agent of ``rocminfo``."""

    node: int | None
    name: str | None  # the gfx target, "gfx942"
    marketing_name: str | None
    uuid: str | None
    compute_units: int | None
    memory_kib: int | None  # the first GLOBAL pool


@dataclass
class RocmInfo:
    #: Whether the amdgpu kernel driver (KFD) is loaded: "ROCk module is loaded"; None: not said.
    kfd_loaded: bool | None = None
    runtime_version: str | None = None
    gpus: list[RocmAgent] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _agent_fields(lines: list[str]) -> tuple[dict[str, str], int | None]:
    fields: dict[str, str] = {}
    pool: int | None = None
    for line in lines:
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "Size" and pool is None:
            number = re.match(r"^(\d{1,15})", value)
            pool = int(number.group(1)) if number and "KB" in value else None
        elif key not in fields:
            fields[key] = value
    return fields, pool


def parse_rocminfo(text: str) -> RocmInfo:
    """``rocminfo``: the KFD state, the runtime's version and every GPU agent."""
    info = RocmInfo()
    lines = _lines(text)
    for line in lines[:20]:
        lowered = line.strip().lower()
        if "rock module is loaded" in lowered:
            info.kfd_loaded = True
        elif "rock module is not loaded" in lowered or "unable to open /dev/kfd" in lowered:
            info.kfd_loaded = False
    starts = [i for i, line in enumerate(lines) if re.match(r"^Agent\s+\d+\s*$", line.strip())]
    for position, start in enumerate(starts):
        end = starts[position + 1] if position + 1 < len(starts) else len(lines)
        fields, pool = _agent_fields(lines[start:end])
        if fields.get("Device Type", "").upper() != "GPU" or len(info.gpus) >= MAX_GPUS:
            continue
        info.gpus.append(
            RocmAgent(
                node=_int(fields.get("Node")),
                name=_text(fields.get("Name"), 40),
                marketing_name=_text(fields.get("Marketing Name"), 100),
                uuid=_text(fields.get("Uuid"), 100),
                compute_units=_int(fields.get("Compute Unit")),
                memory_kib=pool,
            )
        )
    for line in lines[:40]:
        if line.strip().startswith("Runtime Version:") and info.runtime_version is None:
            info.runtime_version = line.split(":", 1)[1].strip()[:32] or None
    if info.kfd_loaded is None and not info.gpus and (text or "").strip():
        info.warnings.append("rocminfo output of a layout not known: no KFD line and no agent")
    return info


# --------------------------------------------------------------------------- merging


def _merge_gpu(into: AmdGpu, other: AmdGpu) -> None:
    for name in AmdGpu.__dataclass_fields__:
        if getattr(into, name) is None and getattr(other, name) is not None:
            setattr(into, name, getattr(other, name))


def merge_reports(*reports: AmdReport | None) -> AmdReport:
    """One report of several reads (static, metric, list, topology): cards joined by index, the
    first known value of each field kept; links named by PCI address or index turned into card
    indices (a link to a card no read describes is dropped); each card's class worked out."""
    merged = AmdReport()
    by_index: dict[int, AmdGpu] = {}
    links: list[AmdLink] = []
    for report in reports:
        if report is None:
            continue
        merged.tool = merged.tool or report.tool
        merged.driver_version = merged.driver_version or report.driver_version
        merged.warnings += report.warnings
        links += report.links
        for gpu in report.gpus:
            if gpu.index in by_index:
                _merge_gpu(by_index[gpu.index], gpu)
            elif len(by_index) < MAX_GPUS:
                by_index[gpu.index] = AmdGpu(**{k: getattr(gpu, k) for k in AmdGpu.__dataclass_fields__})
    merged.gpus = [by_index[i] for i in sorted(by_index)]
    by_bdf = {g.bdf: g.index for g in merged.gpus if g.bdf}
    seen: set[tuple[str, str]] = set()
    for link in links:
        a = by_bdf.get(link.a) if _BDF_RE.match(link.a) else (int(link.a) if link.a.isdigit() else None)
        b = by_bdf.get(link.b) if _BDF_RE.match(link.b) else (int(link.b) if link.b.isdigit() else None)
        if a is None or b is None or a == b or a not in by_index or b not in by_index:
            continue
        pair = (str(min(a, b)), str(max(a, b)))
        if pair not in seen:
            seen.add(pair)
            merged.links.append(AmdLink(pair[0], pair[1], link.kind, link.hops, link.weight))
    return _classify(merged)
