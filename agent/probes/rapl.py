"""CPU package power from Intel RAPL powercap counters (``/sys/class/powercap/intel-rapl:*``).

RAPL exposes cumulative energy (``energy_uj``) that wraps at ``max_energy_range_uj``; power is
the energy difference between two samples divided by the time between them.  Only zones named
``package-N`` are package power (``core``, ``uncore``, ``dram``, ``psys`` are sub-domains or other
scopes).  Since 2020 kernels make ``energy_uj`` readable by root only: unreadable counters are
absent (None) with a warning, never 0.
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.probes.sysfs import SysfsReader, tree_from_grep_r

__all__ = ["RaplSample", "RaplZone", "energy_delta_uj", "package_power_w", "read_rapl", "tree_from_grep_r"]

_ZONE_DIR_RE = re.compile(r"^intel-rapl:\d+(?::\d+)*$")
_PACKAGE_RE = re.compile(r"^package-\d+$")


@dataclass
class RaplZone:
    #: The zone's ``name`` file: ``package-0``, ``core``, ``uncore``, ``dram``, ``psys``.
    name: str | None
    energy_uj: int | None
    max_energy_range_uj: int | None


@dataclass
class RaplSample:
    #: ``time.monotonic()`` when the counters were read.
    timestamp: float
    #: Keyed by zone directory (``intel-rapl:0``, ``intel-rapl:0:0``).
    zones: dict[str, RaplZone] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _int(raw: str | None) -> int | None:
    if raw is None:
        return None
    raw = raw.strip()
    # ASCII digits only, at most a 64-bit counter: str.isdigit() also passes "²", which int() refuses
    return int(raw) if re.fullmatch(r"[0-9]{1,20}", raw) else None


def read_rapl(root: str | Mapping[str, str], timestamp: float | None = None) -> RaplSample:
    """Read every ``intel-rapl:*`` zone under ``<root>/sys/class/powercap`` (or, for a
    ``{path: contents}`` dict from :func:`tree_from_grep_r`, wherever the zones sit in it)."""
    reader = SysfsReader(root)
    sample = RaplSample(timestamp=time.monotonic() if timestamp is None else timestamp)
    for directory in reader.find_dirs("sys/class/powercap", lambda n: _ZONE_DIR_RE.match(n) is not None):
        zone_id = posixpath.basename(directory)
        name_raw = reader.read(posixpath.join(directory, "name"))
        energy_raw = reader.read(posixpath.join(directory, "energy_uj"))
        zone = RaplZone(
            name=name_raw.strip() if name_raw else None,
            energy_uj=_int(energy_raw),
            max_energy_range_uj=_int(reader.read(posixpath.join(directory, "max_energy_range_uj"))),
        )
        if zone.energy_uj is None:
            why = "unreadable (root only since Linux 5.10)" if energy_raw is None else f"unparsable ({energy_raw!r})"
            sample.warnings.append(f"{zone_id} ({zone.name or 'unnamed'}): energy_uj {why}")
        sample.zones[zone_id] = zone
    if not sample.zones:
        sample.warnings.append("no intel-rapl powercap zones found")
    return sample


def energy_delta_uj(prev: int | None, cur: int | None, max_range: int | None) -> int | None:
    """Energy used between two readings, allowing for one wrap of the counter
    (``cur < prev`` -> ``cur + max_range - prev``).  None if a reading is missing or a wrap cannot
    be accounted for (no range, or a delta larger than the range)."""
    if prev is None or cur is None or prev < 0 or cur < 0:
        return None
    if cur >= prev:
        return cur - prev
    if not max_range or max_range <= 0 or prev > max_range:
        return None
    return cur + max_range - prev


def package_power_w(prev_sample: RaplSample, cur_sample: RaplSample) -> dict[str, float]:
    """Average power of each ``package-N`` zone between two samples, keyed by zone name.

    Zones missing from either sample, or with unreadable counters, are left out; so is everything
    when no time passed between the samples.
    """
    elapsed = cur_sample.timestamp - prev_sample.timestamp
    if elapsed <= 0:
        return {}
    power: dict[str, float] = {}
    for zone_id, cur in cur_sample.zones.items():
        prev = prev_sample.zones.get(zone_id)
        if prev is None or cur.name is None or not _PACKAGE_RE.match(cur.name) or prev.name != cur.name:
            continue
        delta = energy_delta_uj(prev.energy_uj, cur.energy_uj, cur.max_energy_range_uj or prev.max_energy_range_uj)
        if delta is None:
            continue
        power[cur.name] = delta / 1e6 / elapsed
    return power
