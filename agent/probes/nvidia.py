"""Parsers for ``nvidia-smi -q`` (text), ``nvidia-smi -q -x`` (XML) and ``nvidia-smi nvlink -e``.

Both ``-q`` formats are first turned into the same small tree of :class:`_Node`
(key, value, children) and the fields are then picked from it; the text tree
is built from indentation, the XML tree from elements.  Field names changed
across driver branches (``Clocks Throttle Reasons`` became ``Clocks Event
Reasons``; ``Power Readings`` became ``GPU Power Readings``; ``Power Draw``
split into ``Average``/``Instantaneous Power Draw``; ECC counters went from
``Single/Double Bit`` to ``SRAM/DRAM``), so every lookup lists the
alternatives it accepts.

Unknown is not zero: any value the tool did not report (``N/A``, ``[N/A]``,
``Not Supported``, ``Requested functionality has been deprecated``, a missing
line, an unparsable number) becomes ``None``.
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

__all__ = [
    "FabricInfo",
    "GpuInfo",
    "GpuProcess",
    "GpuReport",
    "MigDevice",
    "gpu_class",
    "nvidia_class_memory_gb",
    "parse_nvidia_smi_text",
    "parse_nvidia_smi_xml",
    "parse_nvlink_errors",
]


# --------------------------------------------------------------------------- dataclasses


@dataclass
class GpuProcess:
    """A process holding a context on a GPU."""

    pid: int | None
    name: str | None
    used_memory_mib: int | None
    #: "C" (compute), "G" (graphics) or "C+G"; None where not reported.
    process_type: str | None = None
    #: On a card in MIG mode, the GPU and compute instance the process runs in (its MIG device).
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class MigDevice:
    """One MIG device of a card in MIG mode, as ``-q`` (text or XML) describes it.

    ``-q`` gives its index on the card, its GPU and compute instance ids and its memory; the
    profile name (``1g.10gb``) and the ``MIG-…`` UUID engines are started with come from
    ``nvidia-smi -L`` (agent.probes.mig.merge_mig_list fills them in).
    """

    index: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    multiprocessor_count: int | None = None
    ecc_uncorrected_volatile: int | None = None
    profile: str | None = None
    uuid: str | None = None


@dataclass
class FabricInfo:
    """The NVLink fabric (NVSwitch / multi-node NVLink) registration of a GPU."""

    state: str | None
    status: str | None
    clique_id: int | None
    cluster_uuid: str | None
    #: ``Fabric > Health > Summary`` on drivers that print it (590+).
    health_summary: str | None = None
    #: ``Fabric > Health > Bandwidth``: "Full", or a degraded reading; None where not printed or N/A.
    bandwidth: str | None = None
    #: The Health rows that report a fault (Route Unhealthy: True, Incorrect Configuration: <what>...);
    #: None where the block has no such rows, [] where it has them and none is set.
    health_faults: list[str] | None = None


@dataclass
class GpuInfo:
    """One physical GPU as reported by ``nvidia-smi -q`` or ``-q -x``."""

    index: int
    uuid: str | None = None
    name: str | None = None
    #: "Product Architecture" (Volta, Turing, Ampere, Ada Lovelace, Hopper, Blackwell); drivers
    #: before about 470 do not print it.
    architecture: str | None = None
    gpu_class: str | None = None
    pci_bus_id: str | None = None
    memory_total_mib: int | None = None
    memory_used_mib: int | None = None
    utilization_gpu_pct: int | None = None
    #: Memory *bandwidth* utilisation (share of time the memory controller was busy).
    utilization_memory_pct: int | None = None
    sm_clock_mhz: int | None = None
    temperature_gpu_c: int | None = None
    #: HBM / memory temperature; only data-centre parts report it.
    temperature_memory_c: int | None = None
    power_draw_w: float | None = None
    #: The enforced power limit.
    power_limit_w: float | None = None
    #: Active clock event/throttle reasons as canonical snake_case names
    #: (``gpu_idle``, ``sw_power_cap``, ``hw_slowdown``, ``hw_power_brake_slowdown``,
    #: ``hw_thermal_slowdown``, ``sw_thermal_slowdown``, ``sync_boost``,
    #: ``applications_clocks_setting``, ``display_clocks_setting``); ``[]`` when the
    #: tool reported reasons and none is active, None when it reported none.
    throttle_reasons: list[str] | None = None
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    remapped_rows_uncorrectable: int | None = None
    pcie_replay_count: int | None = None
    #: Current MIG mode: "Enabled" / "Disabled"; None where MIG does not apply.
    mig_mode: str | None = None
    #: The mode after the next GPU reset; differs from ``mig_mode`` while a change waits for one.
    mig_pending: str | None = None
    #: The card's MIG devices (``-q``'s ``MIG Device`` blocks); None where it printed none.
    mig_devices: list[MigDevice] | None = None
    #: None when the output has no Processes section (truncated or ``-d`` output).
    processes: list[GpuProcess] | None = None
    #: None when the driver prints no Fabric section (pre-535 drivers).
    fabric: FabricInfo | None = None


@dataclass
class GpuReport:
    """What one ``nvidia-smi -q`` run said about the host."""

    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[GpuInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: The ``Attached GPUs`` header (may exceed ``len(gpus)`` when the output is cut).
    attached_gpus: int | None = None


# --------------------------------------------------------------------------- value helpers

# Values nvidia-smi prints for "I do not know / this does not apply".
_UNKNOWN_VALUES = frozenset(
    v.lower()
    for v in (
        "N/A",
        "NA",
        "Not Supported",
        "Unknown",
        "Unknown Error",
        "Insufficient Permissions",
        "Requested functionality has been deprecated",
        "Not available in WDDM driver model",
        "GPU requires reset",
        "GPU is lost",
        "Not Found",
        "ERR!",
        "",
    )
)

# ASCII digits only (``\d`` would take "１２"), and no more of them than any real reading has, so a
# runaway digit string cannot become an infinite float.
_NUMBER_RE = re.compile(r"^([+-]?\d{1,20}(?:\.\d{1,20})?)\s*([A-Za-z%/()]*)$", re.ASCII)
_VERSION_RE = re.compile(r"\d+(?:\.\d+)+", re.ASCII)


def _clean(value: str | None) -> str | None:
    """Collapse whitespace; map every "not reported" spelling to None."""
    if value is None:
        return None
    value = " ".join(value.split())
    if value.lower() in _UNKNOWN_VALUES:
        return None
    # nvidia-smi wraps values it failed to read in brackets: [N/A], [Not Supported], [Unknown Error]
    if value.startswith("[") and value.endswith("]"):
        return None
    return value


def _number(value: str | None, units: tuple[str, ...] = ()) -> float | None:
    """``"67.74 W"`` -> 67.74.  None when absent, unknown, or the unit is not one of ``units``."""
    value = _clean(value)
    if value is None:
        return None
    m = _NUMBER_RE.match(value)
    if not m:
        return None
    unit = m.group(2)
    if units and unit.lower() not in {u.lower() for u in units}:
        return None
    return float(m.group(1))


def _int(value: str | None, units: tuple[str, ...] = ()) -> int | None:
    number = _number(value, units)
    if number is None:
        return None
    return int(round(number))


def _mib(value: str | None) -> int | None:
    """A memory amount in MiB; accepts the MiB nvidia-smi prints and converts GiB/KiB if ever seen."""
    value = _clean(value)
    if value is None:
        return None
    m = _NUMBER_RE.match(value)
    if not m:
        return None
    number = float(m.group(1))
    unit = m.group(2).lower()
    factor = {"mib": 1.0, "mb": 1.0, "": 1.0, "gib": 1024.0, "gb": 1024.0, "kib": 1 / 1024, "kb": 1 / 1024}.get(unit)
    if factor is None:
        return None
    return int(round(number * factor))


def _bool(value: str | None) -> bool | None:
    value = _clean(value)
    if value is None:
        return None
    lowered = value.lower()
    if lowered in ("yes", "true", "enabled", "active"):
        return True
    if lowered in ("no", "false", "disabled", "not active"):
        return False
    return None


def _version(value: str | None) -> str | None:
    """``"610.62 [Deprecated; ...]"`` -> ``"610.62"``."""
    value = _clean(value)
    if value is None:
        return None
    m = _VERSION_RE.search(value)
    return m.group(0) if m else None


def _first_float(*values: float | None) -> float | None:
    for value in values:
        if value is not None:
            return value
    return None


def _first_str(*values: str | None) -> str | None:
    for value in values:
        if value is not None:
            return value
    return None


def _snake(label: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", label.lower()).strip("_")


# --------------------------------------------------------------------------- gpu_class

# Words in product names that say nothing about which GPU it is (brand, form factor, memory type).
_NOISE_WORDS = frozenset(
    w.lower()
    for w in (
        "NVIDIA",
        "Tesla",
        "GeForce",
        "Quadro",
        "GPU",
        "Generation",
        "SXM",
        "SXM2",
        "SXM3",
        "SXM4",
        "SXM5",
        "SXM6",
        "PCIe",
        "PCIE",
        "HBM2",
        "HBM2e",
        "HBM3",
        "HBM3e",
    )
)
_MEMORY_WORD_RE = re.compile(r"^(\d+)(?:GB|G|GiB)$", re.IGNORECASE | re.ASCII)

# Marketed memory sizes (GB) of NVIDIA cards.  A card reports a little less framebuffer than its
# marketed size (ECC, memory the driver and firmware keep), so a reported total is snapped to the
# marketed size nearest to it by ratio, among those from 2 % below it to 12 % above it.  Totals as
# nvidia-smi reports them, and the size each snaps to:
#   T4 15360 MiB -> 16, A10 23028 -> 24, RTX 4090 24564 -> 24, A100 40 GB 40960 -> 40,
#   L40S 46068 -> 48, H100 80GB 81559 -> 80, A100 80 GB 81920 -> 80, H100 NVL 95830 -> 94,
#   GH200 97871 -> 96, RTX PRO 6000 Blackwell 97887 -> 96, H200 143771 -> 141, B200 183359 -> 180.
# Taking the first size in the window instead classed GH200 and RTX PRO 6000 as 94 GB: 94 and 96
# lie only 2 % apart, so both are in the window of a 95.6 GiB total.  Nearest by ratio tells the
# H100 NVL (93.6 GiB) from them; a total about equally near two sizes is settled by the name.
# fmt: off
_MARKETED_GB = (
    1, 2, 3, 4, 5, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 72, 80, 84, 94, 96,
    141, 144, 180, 186, 192, 288,
)
# fmt: on
_SNAP_BELOW = 0.98  # a marketed size at most 2 % below the reported total ...
_SNAP_ABOVE = 1.12  # ... or at most 12 % above it
# Two candidates whose distances from the total (as |log ratio|) differ by less than this are a
# tie the total cannot settle.
_TIE = 0.01
# Name words that settle a tie, with the size they mean: "NVL" with ~94 GB is the H100 NVL.
_NAME_SIZE_HINTS = (("nvl", 94),)


def _tie_break(sizes: list[int], name: str | None) -> int:
    """Pick one of ``sizes`` (about equally near the total) by the card's name, else the larger:
    cards report less than their marketed size, rarely more."""
    words = [w.lower() for w in re.split(r"[\s\-_]+", name or "") if w]
    for word in words:
        m = _MEMORY_WORD_RE.match(word)
        if m and int(m.group(1)) in sizes:  # the name states its size ("A100-SXM4-40GB")
            return int(m.group(1))
    for word, size in _NAME_SIZE_HINTS:
        if word in words and size in sizes:
            return size
    return max(sizes)


def nvidia_class_memory_gb(
    memory_total_mib: int | None, name: str | None = None, sizes: tuple[int, ...] = _MARKETED_GB
) -> int | None:
    """The marketed memory size in GB for a reported framebuffer total in MiB.

    ``name`` (the product name) only settles a total that lies about equally near two marketed
    sizes.  A total near no marketed size is rounded to whole GiB. ``sizes`` are the marketed
    sizes to snap to (NVIDIA's by default; agent.probes.amd passes AMD's).
    """
    if memory_total_mib is None or memory_total_mib <= 0 or not math.isfinite(memory_total_mib):
        return None
    gib = memory_total_mib / 1024
    candidates = sorted(
        (abs(math.log(size / gib)), size) for size in sizes if gib * _SNAP_BELOW <= size <= gib * _SNAP_ABOVE
    )
    if not candidates:
        return max(1, int(round(gib)))
    nearest = candidates[0][0]
    tied = [size for distance, size in candidates if distance - nearest < _TIE]
    return tied[0] if len(tied) == 1 else _tie_break(tied, name)


def gpu_class(name: str | None, memory_total_mib: int | None) -> str | None:
    """A short, stable class for scheduling and inventory: ``"H100-80GB"``, ``"RTX4090-24GB"``.

    Vendor and form-factor words (NVIDIA, Tesla, GeForce, Quadro, SXM*, PCIe, HBM*) and any
    memory size already in the name are dropped; the rest is joined without spaces and the
    marketed memory size is appended.  Without a memory total only the name part is returned.
    """
    if not name:
        return None
    tokens = [t for t in re.split(r"[\s\-_]+", name.strip()) if t]
    kept = [t for t in tokens if t.lower() not in _NOISE_WORDS and not _MEMORY_WORD_RE.match(t)]
    base = "".join(kept) or "".join(tokens)
    if not base:
        return None
    memory_gb = nvidia_class_memory_gb(memory_total_mib, name)
    if memory_gb is None:
        return base
    return f"{base}-{memory_gb}GB"


# --------------------------------------------------------------------------- tree


@dataclass
class _Node:
    key: str
    value: str | None = None
    children: list[_Node] = field(default_factory=list)
    indent: int = -1

    def _match(self, name: str | tuple[str, ...]) -> _Node | None:
        names = (name,) if isinstance(name, str) else name
        for wanted in names:
            wanted_key = " ".join(wanted.split()).lower()
            for child in self.children:
                if child.key.lower() == wanted_key:
                    return child
        return None

    def child(self, *path: str | tuple[str, ...]) -> _Node | None:
        """Walk ``path``; each step is a key or a tuple of alternative keys (first match wins)."""
        node: _Node | None = self
        for step in path:
            if node is None:
                return None
            node = node._match(step)
        return node

    def val(self, *path: str | tuple[str, ...]) -> str | None:
        node = self.child(*path)
        return _clean(node.value) if node is not None else None

    def descendants(self) -> list[_Node]:
        out: list[_Node] = []
        for child in self.children:
            out.append(child)
            out.extend(child.descendants())
        return out


# "Key<padding> : value": the separator is the first colon with whitespace on both sides, so
# values may hold colons ("C:\\Windows\\...", "11:22:39", "00000000:19:00.0").
_TEXT_SEPARATOR_RE = re.compile(r"\s:(?=\s|$)")
_GPU_HEADER_RE = re.compile(r"^GPU\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f])$")


def _text_tree(text: str) -> _Node:
    """Build the section tree of ``nvidia-smi -q`` text from indentation."""
    root = _Node("")
    stack: list[_Node] = [root]
    for raw in text.lstrip("\ufeff").splitlines():
        line = raw.expandtabs(8).rstrip()
        body = line.lstrip(" ")
        if not body:
            continue
        indent = len(line) - len(body)
        separator = _TEXT_SEPARATOR_RE.search(body)
        if separator:
            key, value = body[: separator.start()].rstrip(), body[separator.end() :].strip()
        else:
            key, value = body, None
        node = _Node(" ".join(key.split()), value, indent=indent)
        while len(stack) > 1 and stack[-1].indent >= indent:
            stack.pop()
        stack[-1].children.append(node)
        stack.append(node)
    return root


#: nvidia-smi nests five levels; an element deeper than this below the one read is left out.
_XML_DEPTH = 32


def _xml_node(element: ET.Element) -> _Node:
    text = element.text
    return _Node(str(element.tag), " ".join(text.split()) if text is not None else None)


def _xml_tree(element: ET.Element, warnings: list[str] | None = None) -> _Node:
    """The element and what it holds as _Node, walked with a stack (so a document nested
    thousands of levels deep cannot exhaust the interpreter's recursion), down to _XML_DEPTH
    levels; deeper elements are left out and said in ``warnings``."""
    root = _xml_node(element)
    stack = [(element, root, 0)]
    cut = False
    while stack:
        current, node, depth = stack.pop()
        if depth >= _XML_DEPTH:
            cut = cut or len(current) > 0
            continue
        for child in current:
            child_node = _xml_node(child)
            node.children.append(child_node)
            stack.append((child, child_node, depth + 1))
    if cut and warnings is not None:
        warnings.append(f"XML nested deeper than {_XML_DEPTH} levels; the deeper elements were left out")
    return root


# --------------------------------------------------------------------------- field extraction

_THROTTLE_LABELS = {
    "idle": "gpu_idle",
    "gpu idle": "gpu_idle",
    "applications clocks setting": "applications_clocks_setting",
    "sw power cap": "sw_power_cap",
    "hw slowdown": "hw_slowdown",
    "hw thermal slowdown": "hw_thermal_slowdown",
    "hw power brake slowdown": "hw_power_brake_slowdown",
    "sync boost": "sync_boost",
    "sw thermal slowdown": "sw_thermal_slowdown",
    "display clock setting": "display_clocks_setting",
    "display clocks setting": "display_clocks_setting",
}


def _throttle_name(key: str) -> str:
    lowered = key.lower()
    for prefix in ("clocks_event_reason_", "clocks_throttle_reason_"):
        if lowered.startswith(prefix):
            return lowered[len(prefix) :]
    return _THROTTLE_LABELS.get(" ".join(lowered.split()), _snake(key))


def _throttle_reasons(section: _Node | None) -> list[str] | None:
    if section is None:
        return None
    reported = False
    active: list[str] = []
    for node in section.descendants():
        state = _bool(node.value)
        if state is None:
            continue
        reported = True
        name = _throttle_name(node.key)
        if state and name not in active:
            active.append(name)
    return active if reported else None


def _sum_known(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _ecc_uncorrected(section: _Node | None) -> int | None:
    """Sum of uncorrectable ECC counters in a Volatile/Aggregate section (both layouts)."""
    if section is None:
        return None
    values: list[int | None] = [
        _int(section.val(key))
        for key in (
            ("DRAM Uncorrectable", "dram_uncorrectable"),
            ("SRAM Uncorrectable", "sram_uncorrectable"),
            ("SRAM Uncorrectable Parity", "sram_uncorrectable_parity"),
            ("SRAM Uncorrectable SEC-DED", "sram_uncorrectable_secded"),
        )
    ]
    double_bit = section.child(("Double Bit", "double_bit"))
    if double_bit is not None:
        total = _int(double_bit.val(("Total", "total")))
        if total is None:
            total = _sum_known([_int(c.value) for c in double_bit.children if c.key.lower() != "total"])
        values.append(total)
    return _sum_known(values)


# Health rows that are not a fault flag: the summary and the bandwidth are read on their own.
_HEALTH_OWN = {"summary", "bandwidth"}
_UNSET = {"false", "no", "none", "not supported", "n/a", "0"}


def _health_faults(health: _Node | None) -> list[str] | None:
    if health is None:
        return None
    rows = [c for c in health.children if c.key.strip().lower() not in _HEALTH_OWN]
    if not rows:
        return None
    faults = []
    for row in rows:
        value = (_clean(row.value) or "").strip()
        if not value or value.lower() in _UNSET:
            continue
        key = row.key.strip().replace("_", " ")
        faults.append(key if value.lower() in ("true", "yes") else f"{key}: {value}"[:200])
    return faults[:16]


def _fabric(section: _Node | None) -> FabricInfo | None:
    if section is None:
        return None
    return FabricInfo(
        state=section.val(("State", "state")),
        status=section.val(("Status", "status")),
        clique_id=_int(section.val(("CliqueId", "cliqueId", "Clique Id"))),
        cluster_uuid=section.val(("ClusterUUID", "clusterUuid", "Cluster UUID")),
        health_summary=section.val(("Health", "health"), ("Summary", "summary")),
        bandwidth=section.val(("Health", "health"), ("Bandwidth", "bandwidth")),
        health_faults=_health_faults(section.child(("Health", "health"))),
    )


def _text_processes(section: _Node | None) -> list[GpuProcess] | None:
    if section is None:
        return None
    processes: list[GpuProcess] = []
    # In MIG mode each process is preceded by the GPU and compute instance it runs in.
    instance: tuple[int | None, int | None] = (None, None)
    for node in section.children:
        key = node.key.lower()
        if key == "gpu instance id":
            instance = (_int(node.value), None)
            continue
        if key == "compute instance id":
            instance = (instance[0], _int(node.value))
            continue
        if key != "process id":
            continue
        processes.append(
            GpuProcess(
                pid=_int(node.value),
                name=node.val("Name"),
                used_memory_mib=_mib(node.val("Used GPU Memory")),
                process_type=node.val("Type"),
                gpu_instance_id=instance[0],
                compute_instance_id=instance[1],
            )
        )
        instance = (None, None)
    return processes


def _xml_processes(section: _Node | None) -> list[GpuProcess] | None:
    if section is None:
        return None
    return [
        GpuProcess(
            pid=_int(node.val("pid")),
            name=node.val("process_name"),
            used_memory_mib=_mib(node.val("used_memory")),
            process_type=node.val("type"),
            gpu_instance_id=_int(node.val("gpu_instance_id")),
            compute_instance_id=_int(node.val("compute_instance_id")),
        )
        for node in section.children
        if node.key == "process_info"
    ]


#: More MIG devices than any card has (seven GPU instances of up to seven compute instances).
MAX_MIG_DEVICES = 64


def _text_mig_devices(node: _Node) -> list[MigDevice] | None:
    """``MIG Device`` blocks, directly under the GPU (driver 590) or under a ``MIG Devices``
    heading (older drivers); None where the card printed none."""
    parent = node.child("MIG Devices") or node
    blocks = [c for c in parent.children if c.key.lower() == "mig device"]
    if not blocks:
        return None
    devices = []
    for position, block in enumerate(blocks[:MAX_MIG_DEVICES]):
        index = _int(block.val("Index"))
        devices.append(
            MigDevice(
                index=index if index is not None and 0 <= index < MAX_MIG_DEVICES else position,
                gpu_instance_id=_int(block.val("GPU Instance ID")),
                compute_instance_id=_int(block.val("Compute Instance ID")),
                memory_total_mib=_mib(block.val(("Shared FB Memory Usage", "FB Memory Usage"), "Total")),
                memory_used_mib=_mib(block.val(("Shared FB Memory Usage", "FB Memory Usage"), "Used")),
                multiprocessor_count=_int(block.val("Device Attributes", "Shared", "Multiprocessor count")),
                ecc_uncorrected_volatile=_ecc_uncorrected(block.child("ECC Errors", "Volatile")),
            )
        )
    return devices


def _xml_mig_devices(node: _Node) -> list[MigDevice] | None:
    parent = node.child("mig_devices")
    if parent is None:
        return None
    blocks = [c for c in parent.children if c.key == "mig_device"]
    devices = []
    for position, block in enumerate(blocks[:MAX_MIG_DEVICES]):
        index = _int(block.val("index"))
        devices.append(
            MigDevice(
                index=index if index is not None and 0 <= index < MAX_MIG_DEVICES else position,
                gpu_instance_id=_int(block.val("gpu_instance_id")),
                compute_instance_id=_int(block.val("compute_instance_id")),
                memory_total_mib=_mib(block.val("fb_memory_usage", "total")),
                memory_used_mib=_mib(block.val("fb_memory_usage", "used")),
                multiprocessor_count=_int(block.val("device_attributes", "shared", "multiprocessor_count")),
                ecc_uncorrected_volatile=_ecc_uncorrected(block.child("ecc_error_count", "volatile_count")),
            )
        )
    return devices


def _finish(gpu: GpuInfo) -> GpuInfo:
    gpu.gpu_class = gpu_class(gpu.name, gpu.memory_total_mib)
    return gpu


def _gpu_from_text(index: int, node: _Node, bus_id: str | None) -> GpuInfo:
    power = node.child(("GPU Power Readings", "Power Readings"))
    power_draw: float | None = None
    power_limit: float | None = None
    if power is not None:
        power_draw = _first_float(
            *(_number(power.val(k), ("W",)) for k in ("Power Draw", "Average Power Draw", "Instantaneous Power Draw"))
        )
        power_limit = _first_float(
            *(_number(power.val(k), ("W",)) for k in ("Enforced Power Limit", "Current Power Limit", "Power Limit")),
            # driver 610 moved the limits into a "GPU Ceiling Power Limit" sub-section
            _number(power.val("GPU Ceiling Power Limit", "Current Power Limit"), ("W",)),
        )
    remapped = node.child("Remapped Rows")
    retired = node.child("Retired Pages")
    gpu = GpuInfo(
        index=index,
        uuid=node.val("GPU UUID"),
        name=node.val("Product Name"),
        architecture=node.val("Product Architecture"),
        pci_bus_id=_first_str(bus_id, node.val("PCI", "Bus Id")),
        memory_total_mib=_mib(node.val("FB Memory Usage", "Total")),
        memory_used_mib=_mib(node.val("FB Memory Usage", "Used")),
        utilization_gpu_pct=_int(node.val("Utilization", "Gpu"), ("%",)),
        utilization_memory_pct=_int(node.val("Utilization", "Memory"), ("%",)),
        sm_clock_mhz=_int(node.val("Clocks", "SM"), ("MHz",)),
        temperature_gpu_c=_int(node.val("Temperature", "GPU Current Temp"), ("C",)),
        temperature_memory_c=_int(node.val("Temperature", "Memory Current Temp"), ("C",)),
        power_draw_w=power_draw,
        power_limit_w=power_limit,
        throttle_reasons=_throttle_reasons(node.child(("Clocks Event Reasons", "Clocks Throttle Reasons"))),
        ecc_uncorrected_volatile=_ecc_uncorrected(node.child("ECC Errors", "Volatile")),
        ecc_uncorrected_aggregate=_ecc_uncorrected(node.child("ECC Errors", "Aggregate")),
        retired_pages_pending=(
            _bool(_first_str(retired.val("Pending Page Retirement"), retired.val("Pending Page Blacklist")))
            if retired is not None
            else None
        ),
        remapped_rows_pending=_bool(remapped.val("Pending")) if remapped is not None else None,
        remapped_rows_failure=_bool(remapped.val("Remapping Failure Occurred")) if remapped is not None else None,
        remapped_rows_uncorrectable=_int(remapped.val("Uncorrectable Error")) if remapped is not None else None,
        pcie_replay_count=_int(node.val("PCI", "Replays Since Reset")),
        mig_mode=node.val("MIG Mode", "Current"),
        mig_pending=node.val("MIG Mode", "Pending"),
        mig_devices=_text_mig_devices(node),
        processes=_text_processes(node.child("Processes")),
        fabric=_fabric(node.child("Fabric")),
    )
    return _finish(gpu)


def _gpu_from_xml(index: int, node: _Node, bus_id: str | None) -> GpuInfo:
    power = node.child(("gpu_power_readings", "power_readings"))
    power_draw: float | None = None
    power_limit: float | None = None
    if power is not None:
        power_draw = _first_float(
            *(_number(power.val(k), ("W",)) for k in ("power_draw", "average_power_draw", "instant_power_draw"))
        )
        power_limit = _first_float(
            *(_number(power.val(k), ("W",)) for k in ("enforced_power_limit", "current_power_limit", "power_limit"))
        )
    remapped = node.child("remapped_rows")
    retired = node.child("retired_pages")
    pending_retirement: bool | None = None
    if retired is not None:
        flags = [_bool(retired.val("pending_retirement")), _bool(retired.val("pending_blacklist"))]
        if True in flags:
            pending_retirement = True
        elif False in flags:
            pending_retirement = False
    gpu = GpuInfo(
        index=index,
        uuid=node.val("uuid"),
        name=node.val("product_name"),
        architecture=node.val("product_architecture"),
        pci_bus_id=_first_str(bus_id, node.val("pci", "pci_bus_id")),
        memory_total_mib=_mib(node.val("fb_memory_usage", "total")),
        memory_used_mib=_mib(node.val("fb_memory_usage", "used")),
        utilization_gpu_pct=_int(node.val("utilization", "gpu_util"), ("%",)),
        utilization_memory_pct=_int(node.val("utilization", "memory_util"), ("%",)),
        sm_clock_mhz=_int(node.val("clocks", "sm_clock"), ("MHz",)),
        temperature_gpu_c=_int(node.val("temperature", "gpu_temp"), ("C",)),
        temperature_memory_c=_int(node.val("temperature", "memory_temp"), ("C",)),
        power_draw_w=power_draw,
        power_limit_w=power_limit,
        throttle_reasons=_throttle_reasons(node.child(("clocks_event_reasons", "clocks_throttle_reasons"))),
        ecc_uncorrected_volatile=_ecc_uncorrected(node.child("ecc_errors", "volatile")),
        ecc_uncorrected_aggregate=_ecc_uncorrected(node.child("ecc_errors", "aggregate")),
        retired_pages_pending=pending_retirement,
        remapped_rows_pending=_bool(remapped.val("remapped_row_pending")) if remapped is not None else None,
        remapped_rows_failure=_bool(remapped.val("remapped_row_failure")) if remapped is not None else None,
        remapped_rows_uncorrectable=_int(remapped.val("remapped_row_unc")) if remapped is not None else None,
        pcie_replay_count=_int(node.val("pci", "replay_counter")),
        mig_mode=node.val("mig_mode", "current_mig"),
        mig_pending=node.val("mig_mode", "pending_mig"),
        mig_devices=_xml_mig_devices(node),
        processes=_xml_processes(node.child("processes")),
        fabric=_fabric(node.child("fabric")),
    )
    return _finish(gpu)


def _check_count(report: GpuReport) -> None:
    if report.attached_gpus is not None and report.attached_gpus != len(report.gpus):
        report.warnings.append(
            f"nvidia-smi reports {report.attached_gpus} attached GPU(s) but the output describes "
            f"{len(report.gpus)}: the output is truncated or was trimmed"
        )


# --------------------------------------------------------------------------- public parsers


def parse_nvidia_smi_text(text: str) -> GpuReport:
    """Parse ``nvidia-smi -q`` text output (drivers 470 to 610, Linux and Windows)."""
    report = GpuReport()
    if not text or not text.strip():
        report.warnings.append("nvidia-smi -q output is empty")
        return report
    root = _text_tree(text)
    report.driver_version = _version(_first_str(root.val("KMD Version"), root.val("Driver Version")))
    report.cuda_version = _version(_first_str(root.val("CUDA UMD Version"), root.val("CUDA Version")))
    report.attached_gpus = _int(root.val("Attached GPUs"))
    for node in root.children:
        m = _GPU_HEADER_RE.match(node.key)
        if not m:
            continue
        gpu = _gpu_from_text(len(report.gpus), node, m.group("bus"))
        report.gpus.append(gpu)
        if node.child("Product Name") is not None and node.child("Processes") is None:
            report.warnings.append(
                f"GPU {gpu.pci_bus_id}: output ends before the Processes section (truncated?); "
                "fields after the cut are unknown"
            )
    if not report.gpus and report.driver_version is None and report.attached_gpus is None:
        report.warnings.append("unknown layout: no 'Driver Version', 'Attached GPUs' or 'GPU <bus id>' lines found")
    _check_count(report)
    return report


def _xml_root(text: str, warnings: list[str]) -> ET.Element | None:
    # The XML parser takes UTF-8: a lone surrogate (text decoded with surrogateescape) becomes "?".
    text = text.lstrip("\ufeff").encode("utf-8", "replace").decode("utf-8")
    start = text.find("<")
    if start < 0:
        warnings.append("no XML found in nvidia-smi -q -x output")
        return None
    if text[:start].strip():
        warnings.append("ignored text before the XML document: " + " ".join(text[:start].split())[:200])
    parser: ET.XMLPullParser[ET.Element] = ET.XMLPullParser(events=("start",))
    root: ET.Element | None = None
    error: str | None = None
    try:
        parser.feed(text[start:])
        parser.close()
    except ET.ParseError as exc:
        error = str(exc)
    try:
        for event in parser.read_events():
            element = event[1] if isinstance(event, tuple) and len(event) == 2 else None
            if root is None and isinstance(element, ET.Element):
                root = element
    except ET.ParseError as exc:
        error = error or str(exc)
    if error is not None:
        warnings.append(f"malformed or truncated XML ({error}); kept what was parsed before the error")
    return root


def parse_nvidia_smi_xml(text: str) -> GpuReport:
    """Parse ``nvidia-smi -q -x`` output (DTD v10 to v13).

    Malformed or truncated XML gives a warning and whatever was parsed before the error.
    """
    report = GpuReport()
    if not text or not text.strip():
        report.warnings.append("nvidia-smi -q -x output is empty")
        return report
    element = _xml_root(text, report.warnings)
    if element is None:
        return report
    root = _xml_tree(element, report.warnings)
    if root.key != "nvidia_smi_log":
        report.warnings.append(f"unknown layout: root element is <{root.key}>, expected <nvidia_smi_log>")
    report.driver_version = _version(root.val("driver_version"))
    report.cuda_version = _version(root.val("cuda_version"))
    report.attached_gpus = _int(root.val("attached_gpus"))
    gpu_elements = [child for child in element if child.tag == "gpu"]
    for gpu_element in gpu_elements:
        bus = _clean(gpu_element.get("id"))
        report.gpus.append(_gpu_from_xml(len(report.gpus), _xml_tree(gpu_element), bus))
    _check_count(report)
    return report


_NVLINK_GPU_RE = re.compile(r"^GPU\s+(?P<index>\d{1,9})\s*:", re.ASCII)
_NVLINK_COUNTER_RE = re.compile(r"^Link\s+(?P<link>\d+)\s*:\s*(?P<name>[^:]+?)\s*:\s*(?P<value>\S+)\s*$")


def _counter_name(label: str) -> str:
    name = _snake(label)
    for suffix in ("_errors", "_error", "_counts", "_count"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return name


def parse_nvlink_errors(text: str) -> dict[int, dict[str, int]]:
    """Parse ``nvidia-smi nvlink -e``: per GPU index, counters summed over links.

    ``Link 0: Replay Errors: 0`` becomes ``{"replay": 0}``; ``CRC FLIT Error`` -> ``crc_flit``.
    Non-integer values (``N/A``, rates) are skipped.  ``nvlink -s`` output and the "not
    supported" messages have no counter lines and give ``{}`` (or GPUs with no counters are
    left out), never an exception.
    """
    result: dict[int, dict[str, int]] = {}
    current: int | None = None
    for raw in (text or "").lstrip("\ufeff").splitlines():
        line = raw.strip()
        if not line:
            continue
        gpu = _NVLINK_GPU_RE.match(line)
        if gpu:
            current = int(gpu.group("index"))
            continue
        counter = _NVLINK_COUNTER_RE.match(line)
        if counter is None or current is None:
            continue
        value = counter.group("value")
        if not re.fullmatch(r"[0-9]{1,20}", value):  # ASCII digits, at most a 64-bit counter
            continue
        name = _counter_name(counter.group("name"))
        counters = result.setdefault(current, {})
        counters[name] = counters.get(name, 0) + int(value)
    return result
