"""MIG: the slices an operator cut NVIDIA cards into, read from ``nvidia-smi``.

llmgw never creates or destroys MIG instances; it reads the layout the operator set up and
offers each MIG device as a device of its own:

- ``nvidia-smi -q`` / ``-q -x`` (agent.probes.nvidia) give each card's MIG mode (current and
  pending) and its ``MIG Device`` blocks: index, GPU and compute instance ids, memory;
- ``nvidia-smi -L`` (:func:`parse_mig_list`) gives each MIG device's profile (``1g.10gb``,
  ``1c.3g.71gb``) and its ``MIG-…`` UUID, which is what an engine is started with;
- ``nvidia-smi mig -lgip`` (:func:`parse_mig_profiles`) the GPU instance profiles a card offers,
  ``-lgipp`` (:func:`parse_mig_placements`) where each may start, ``-lgi``
  (:func:`parse_gpu_instances`) the GPU instances there are.

:func:`merge_mig_list` joins ``-L`` to ``-q`` by card and device index and says, per card, what
makes its slices untrustworthy: MIG enabled with no MIG device, the two tools disagreeing, a mode
change waiting for a reset. A slice of such a card is shown with the reason and never placed on.

Parsers never raise; unknown is None. No Django import; Python 3.11+.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from agent.probes.nvidia import GpuInfo, GpuReport, MigDevice

__all__ = [
    "GpuInstance",
    "ListedGpu",
    "ListedMig",
    "MigList",
    "MigPlacement",
    "MigProfile",
    "SLICE_BASE",
    "SLICE_STRIDE",
    "device_processes",
    "merge_mig_list",
    "mig_problem",
    "mig_share",
    "parse_gpu_instances",
    "parse_mig_list",
    "parse_mig_placements",
    "parse_mig_profiles",
    "profile_memory_gb",
    "profile_slices",
    "slice_index",
    "slice_parent",
]

#: A slice's device index: SLICE_BASE + card index * SLICE_STRIDE + its number on the card. Cards
#: are numbered below SLICE_BASE (the protocol takes at most 256), so a slice's index never
#: collides with a card's, and a claim names its card even after the slice is gone.
SLICE_BASE = 1000
SLICE_STRIDE = 100
#: More slices than any card is cut into (MIG: 7 GPU instances; an MI300X in CPX mode: 8).
MAX_SLICES = 64
#: More cards than the protocol takes on one node.
MAX_CARDS = 256
_MAX_LINES = 100_000


def slice_index(card: int, number: int) -> int | None:
    """The device index of slice `number` of card `card`; None where either is out of range."""
    if not (0 <= card < MAX_CARDS and 0 <= number < MAX_SLICES):
        return None
    return SLICE_BASE + card * SLICE_STRIDE + number


def slice_parent(index: int) -> int | None:
    """The card a slice's device index belongs to; None for a card's own index."""
    if index < SLICE_BASE:
        return None
    return (index - SLICE_BASE) // SLICE_STRIDE


@dataclass
class ListedMig:
    """One ``MIG <profile> Device <n>: (UUID: MIG-…)`` line of ``nvidia-smi -L``."""

    index: int
    profile: str
    uuid: str


@dataclass
class ListedGpu:
    """One ``GPU <n>: <name> (UUID: GPU-…)`` line of ``nvidia-smi -L`` and its MIG lines."""

    index: int
    name: str | None
    uuid: str | None
    migs: list[ListedMig] = field(default_factory=list)


@dataclass
class MigList:
    gpus: list[ListedGpu] = field(default_factory=list)
    #: MIG lines before any GPU line (a cut or garbled listing): their card is unknown.
    orphans: list[ListedMig] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


_GPU_LINE_RE = re.compile(r"^GPU\s+(?P<index>\d{1,4})\s*:\s*(?P<name>.*?)\s*(?:\(UUID:\s*(?P<uuid>[^)\s]+)\s*\))?\s*$")
_MIG_LINE_RE = re.compile(
    r"^\s+MIG\s+(?P<profile>\S{1,40})\s+Device\s+(?P<index>\d{1,4})\s*:\s*\(UUID:\s*(?P<uuid>[^)\s]{1,200})\s*\)\s*$"
)
_PROFILE_RE = re.compile(r"^(?:(?P<ci>\d{1,2})c\.)?(?P<g>\d{1,2})g\.(?P<gb>\d{1,4})gb(?:\+[a-z0-9]{1,8})*$", re.ASCII)


def _lines(text: str) -> list[str]:
    return (text or "").lstrip("\ufeff").replace("\x00", "").splitlines()[:_MAX_LINES]


def parse_mig_list(text: str) -> MigList:
    """``nvidia-smi -L``: every card with its MIG devices (profile, device number, UUID)."""
    listing = MigList()
    current: ListedGpu | None = None
    for raw in _lines(text):
        line = raw.rstrip()
        if not line.strip():
            continue
        gpu = _GPU_LINE_RE.match(line)
        if gpu:
            current = ListedGpu(int(gpu.group("index")), gpu.group("name") or None, gpu.group("uuid"))
            listing.gpus.append(current)
            continue
        mig = _MIG_LINE_RE.match(line)
        if mig is None:
            if line.lstrip().startswith("MIG"):
                listing.warnings.append(f"nvidia-smi -L: a MIG line not understood: {line.strip()[:120]!r}")
            continue
        item = ListedMig(int(mig.group("index")), mig.group("profile"), mig.group("uuid"))
        if current is None:
            listing.orphans.append(item)
        elif len(current.migs) < MAX_SLICES:
            current.migs.append(item)
    if listing.orphans:
        listing.warnings.append(f"nvidia-smi -L: {len(listing.orphans)} MIG device(s) listed under no GPU line")
    return listing


def profile_memory_gb(profile: str | None) -> int | None:
    """``1g.10gb`` -> 10, ``1c.3g.71gb`` -> 71; None for a name of another shape."""
    match = _PROFILE_RE.match(profile or "")
    return int(match.group("gb")) if match else None


def profile_slices(profile: str | None) -> int | None:
    """The GPU instance's compute slices a profile names: ``3g.40gb`` -> 3; None for another shape."""
    match = _PROFILE_RE.match(profile or "")
    return int(match.group("g")) if match else None


def mig_share(profile: str | None, slots: int | None) -> float | None:
    """The part of the card's compute a MIG device has: its compute slices over the card's
    (``1g`` of 7 = 1/7; ``2c.3g`` = 2/7: two of the GPU instance's three slices). None where the
    profile or the card's number of slices is unknown."""
    match = _PROFILE_RE.match(profile or "")
    if match is None or not slots or slots <= 0:
        return None
    compute = int(match.group("ci") or match.group("g"))
    if compute <= 0 or compute > slots:
        return None
    return compute / slots


# --------------------------------------------------------------------------- mig -lgip / -lgipp / -lgi


@dataclass
class MigProfile:
    """One GPU instance profile a card offers (``nvidia-smi mig -lgip``)."""

    gpu: int
    name: str  # "1g.10gb", "1g.12gb+me"
    profile_id: int
    free: int | None
    total: int | None
    memory_gib: float | None
    multiprocessors: int | None


@dataclass
class MigPlacement:
    """Where instances of one profile may start (``nvidia-smi mig -lgipp``)."""

    gpu: int
    profile_id: int
    starts: list[int]
    size: int


@dataclass
class GpuInstance:
    """One GPU instance there is (``nvidia-smi mig -lgi``)."""

    gpu: int
    name: str
    profile_id: int | None
    instance_id: int | None
    start: int | None
    size: int | None


_LGIP_RE = re.compile(
    r"^\|\s*(?P<gpu>\d{1,4})\s+MIG\s+(?P<name>\S{1,40})\s+(?P<id>\d{1,4})\s+(?P<free>\d{1,3})/(?P<total>\d{1,3})\s+"
    r"(?P<mem>\d{1,6}(?:\.\d{1,4})?)\s+(?P<p2p>\S+)\s+(?P<sm>\d{1,5})\b"
)
_LGIPP_RE = re.compile(
    r"^GPU\s+(?P<gpu>\d{1,4})\s+Profile\s+ID\s+(?P<id>\d{1,4})\s+Placements?\s*:\s*\{(?P<starts>[\d,\s]{0,200})\}"
    r"\s*:\s*(?P<size>\d{1,3})\s*$"
)
_LGI_RE = re.compile(
    r"^\|\s*(?P<gpu>\d{1,4})\s+MIG\s+(?P<name>\S{1,40})\s+(?P<id>\d{1,4})\s+(?P<instance>\d{1,4})\s+"
    r"(?P<start>\d{1,3}):(?P<size>\d{1,3})\s*\|"
)


def parse_mig_profiles(text: str) -> list[MigProfile]:
    """``nvidia-smi mig -lgip``: each profile's row (the second row of an entry, CE/JPEG/OFA, is
    not needed)."""
    found = []
    for line in _lines(text):
        match = _LGIP_RE.match(line.strip())
        if match is None:
            continue
        found.append(
            MigProfile(
                gpu=int(match.group("gpu")),
                name=match.group("name"),
                profile_id=int(match.group("id")),
                free=int(match.group("free")),
                total=int(match.group("total")),
                memory_gib=float(match.group("mem")),
                multiprocessors=int(match.group("sm")),
            )
        )
    return found


def parse_mig_placements(text: str) -> list[MigPlacement]:
    """``nvidia-smi mig -lgipp``: ``GPU 0 Profile ID 19 Placements: {0,1,2}:1``."""
    found = []
    for line in _lines(text):
        match = _LGIPP_RE.match(line.strip())
        if match is None:
            continue
        starts = [int(part) for part in match.group("starts").replace(" ", "").split(",") if part.isdigit()]
        found.append(
            MigPlacement(int(match.group("gpu")), int(match.group("id")), starts[:64], int(match.group("size")))
        )
    return found


def parse_gpu_instances(text: str) -> list[GpuInstance]:
    """``nvidia-smi mig -lgi``: ``|   0  MIG 1g.6gb   14   3   0:1   |``."""
    found = []
    for line in _lines(text):
        match = _LGI_RE.match(line.strip())
        if match is None:
            continue
        found.append(
            GpuInstance(
                gpu=int(match.group("gpu")),
                name=match.group("name"),
                profile_id=int(match.group("id")),
                instance_id=int(match.group("instance")),
                start=int(match.group("start")),
                size=int(match.group("size")),
            )
        )
    return found


# --------------------------------------------------------------------------- -L joined to -q


def _enabled(mode: str | None) -> bool | None:
    if mode is None:
        return None
    lowered = mode.strip().lower()
    if lowered == "enabled":
        return True
    if lowered == "disabled":
        return False
    return None


def mig_problem(gpu: GpuInfo) -> str | None:
    """What ``-q`` alone says is wrong with a card's MIG layout, or None."""
    current, pending = _enabled(gpu.mig_mode), _enabled(gpu.mig_pending)
    if current is not None and pending is not None and current != pending:
        return (
            f"MIG mode is {gpu.mig_mode} and changes to {gpu.mig_pending} at the next GPU reset "
            "(nvidia-smi -r): llmgw places nothing new on this card until then"
        )
    if current and not gpu.mig_devices:
        return "MIG is enabled and no MIG device is set up (nvidia-smi mig -cgi ... -C), so nothing can run on it"
    if current is False and gpu.mig_devices:
        return f"MIG is {gpu.mig_mode} yet nvidia-smi -q describes {len(gpu.mig_devices)} MIG device(s)"
    return None


def _disagreement(gpu: GpuInfo, listed: ListedGpu | None) -> str | None:
    devices = gpu.mig_devices or []
    if listed is None:
        return f"nvidia-smi -L does not list GPU {gpu.index}: its MIG devices' UUIDs are unknown"
    if listed.uuid and gpu.uuid and listed.uuid != gpu.uuid:
        return f"nvidia-smi -L names GPU {gpu.index} {listed.uuid}, -q names it {gpu.uuid}"
    if len(listed.migs) != len(devices) or {m.index for m in listed.migs} != {d.index for d in devices}:
        return (
            f"nvidia-smi -L lists {len(listed.migs)} MIG device(s) on GPU {gpu.index}, -q describes {len(devices)}: "
            "the layout changed between the two reads, or one of them is cut short"
        )
    if len({m.uuid for m in listed.migs}) != len(listed.migs):
        return f"nvidia-smi -L lists one MIG UUID twice on GPU {gpu.index}"
    by_index = {m.index: m for m in listed.migs}
    for device in devices:
        item = by_index[device.index]
        gb = profile_memory_gb(item.profile)
        if gb is not None and device.memory_total_mib is not None:
            ratio = device.memory_total_mib / 1024 / gb if gb else 0.0
            if not 0.75 <= ratio <= 1.25:
                return (
                    f"MIG device {device.index} of GPU {gpu.index} is {item.profile} by nvidia-smi -L "
                    f"but has {device.memory_total_mib} MiB by -q"
                )
    return None


def merge_mig_list(report: GpuReport, listing: MigList | None) -> dict[int, str]:
    """Give each MIG device of ``report`` its profile and UUID from ``listing`` (``-L``), and say
    per card index why its slices cannot be trusted (cards without a problem are left out).

    ``listing`` None means ``-L`` could not be read: every card in MIG mode then has a problem,
    since its slices' UUIDs, which engines are started with, are unknown."""
    problems: dict[int, str] = {}
    listed = {g.index: g for g in listing.gpus} if listing is not None else {}
    for gpu in report.gpus:
        problem = mig_problem(gpu)
        if problem is None and _enabled(gpu.mig_mode) and gpu.mig_devices:
            problem = (
                "nvidia-smi -L could not be read: the MIG devices' UUIDs are unknown"
                if listing is None
                else _disagreement(gpu, listed.get(gpu.index))
            )
        if problem is not None:
            problems[gpu.index] = problem
        if listing is None or not gpu.mig_devices:
            continue
        item = listed.get(gpu.index)
        by_index = {m.index: m for m in item.migs} if item is not None else {}
        for device in gpu.mig_devices:
            found = by_index.get(device.index)
            if found is not None:
                device.profile, device.uuid = found.profile, found.uuid
    if listing is not None:
        known = {g.index for g in report.gpus}
        for item in listing.gpus:
            if item.migs and item.index not in known:
                problems.setdefault(
                    item.index,
                    f"nvidia-smi -L lists {len(item.migs)} MIG device(s) on GPU {item.index}, "
                    "which nvidia-smi -q does not describe: they are not offered",
                )
    return problems


def device_processes(gpu: GpuInfo, device: MigDevice) -> int | None:
    """How many of the card's processes run in this MIG device (by GPU and compute instance)."""
    if gpu.processes is None or device.gpu_instance_id is None:
        return None
    return sum(
        1
        for p in gpu.processes
        if p.gpu_instance_id == device.gpu_instance_id
        and (p.compute_instance_id is None or p.compute_instance_id == device.compute_instance_id)
    )
