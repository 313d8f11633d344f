"""CPU package and board inlet temperatures from hwmon sysfs, ``sensors -j`` or ``sensors -u``.

All three inputs are reduced to readings ``(chip family, chip id, label, °C)`` and classified
the same way:

* CPU package: coretemp ``Package id N`` (``Physical id N`` on old kernels); k10temp/zenpower
  ``Tdie``, else ``Tctl``, one per chip.
* Board inlet: a label containing ``inlet``, ``ambient``, ``SYSTIN`` or ``System``.  Super-I/O
  chips report unconnected inputs as -1, 0 or 100+ °C (one fixture shows SYSTIN = 120 °C), so an
  inlet reading outside 0-85 °C is discarded with a warning rather than reported.

An unmeasured sensor is absent: no reading means None / no dict entry, never 0.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.probes.jsontext import read_json
from agent.probes.sysfs import SysfsReader, tree_from_grep_r

__all__ = ["Temps", "parse_sensors_json", "parse_sensors_u", "read_hwmon", "tree_from_grep_r"]

_PACKAGE_LABEL_RE = re.compile(r"^(?:package|physical) id \d+$", re.IGNORECASE)
_AMD_CHIPS = ("k10temp", "zenpower")
_INLET_WORDS = ("inlet", "ambient", "systin", "system")
_INLET_RANGE = (0.0, 85.0)  # exclusive bounds of a believable inlet/board temperature
_CPU_RANGE = (0.0, 125.0)


@dataclass
class Temps:
    #: The hottest CPU package; None without a package sensor.
    cpu_package_c: float | None = None
    #: Every package sensor, keyed ``"<chip>/<label>"`` (``"coretemp-isa-0000/Package id 0"``).
    cpu_packages: dict[str, float] = field(default_factory=dict)
    inlet_c: float | None = None
    warnings: list[str] = field(default_factory=list)
    #: Every temperature reading seen, keyed like ``cpu_packages``.
    readings: dict[str, float] = field(default_factory=dict)


@dataclass
class _Reading:
    family: str
    chip: str
    label: str
    celsius: float


def _chip_family(chip: str) -> str:
    return chip.split("-", 1)[0].lower()


def _inlet_rank(label: str) -> int | None:
    lowered = label.lower()
    for rank, word in enumerate(_INLET_WORDS):
        if word in lowered:
            return rank
    return None


def _classify(readings: list[_Reading], temps: Temps) -> Temps:
    amd: dict[str, dict[str, float]] = {}
    inlet: tuple[int, float] | None = None
    for r in readings:
        key = f"{r.chip}/{r.label}"
        temps.readings[key] = r.celsius
        if r.family == "coretemp" and _PACKAGE_LABEL_RE.match(r.label):
            if _CPU_RANGE[0] < r.celsius <= _CPU_RANGE[1]:
                temps.cpu_packages[key] = r.celsius
            else:
                temps.warnings.append(f"ignored implausible CPU package reading {r.celsius:g} °C from {key}")
            continue
        if r.family in _AMD_CHIPS and r.label.lower() in ("tdie", "tctl"):
            amd.setdefault(r.chip, {})[r.label] = r.celsius
            continue
        if r.family in ("coretemp", "nvme", "amdgpu", "nouveau", "drivetemp") or r.family in _AMD_CHIPS:
            continue
        rank = _inlet_rank(r.label)
        if rank is None:
            continue
        if not (_INLET_RANGE[0] < r.celsius < _INLET_RANGE[1]):
            temps.warnings.append(
                f"ignored implausible inlet/board reading {r.celsius:g} °C from {key} (unconnected sensor input?)"
            )
            continue
        if inlet is None or rank < inlet[0]:
            inlet = (rank, r.celsius)
    for chip, labels in amd.items():
        label = next((name for name in labels if name.lower() == "tdie"), None) or next(iter(labels))
        value = labels[label]
        key = f"{chip}/{label}"
        if _CPU_RANGE[0] < value <= _CPU_RANGE[1]:
            temps.cpu_packages[key] = value
        else:
            temps.warnings.append(f"ignored implausible CPU package reading {value:g} °C from {key}")
    if temps.cpu_packages:
        temps.cpu_package_c = max(temps.cpu_packages.values())
    if inlet is not None:
        temps.inlet_c = inlet[1]
    if not readings:
        temps.warnings.append("no temperature sensors found")
    return temps


_TEMP_INPUT_RE = re.compile(r"^temp(?P<n>\d+)_input$")


def read_hwmon(root: str | Mapping[str, str]) -> Temps:
    """Read ``<root>/sys/class/hwmon/hwmon*/{name,temp*_label,temp*_input}`` (millidegrees).

    ``root`` is a directory (``"/"`` on a live host) or a ``{path: contents}`` dict such as
    :func:`tree_from_grep_r` returns; in the dict form every ``hwmonN`` directory is used,
    wherever it sits in the captured tree.
    """
    reader = SysfsReader(root)
    readings: list[_Reading] = []
    temps = Temps()
    for directory in reader.find_dirs("sys/class/hwmon", lambda n: re.fullmatch(r"hwmon\d+", n) is not None):
        name = (reader.read(posixpath.join(directory, "name")) or "").strip() or "unknown"
        chip = f"{name}-{posixpath.basename(directory)}"
        for entry in reader.listdir(directory):
            m = _TEMP_INPUT_RE.match(entry)
            if not m:
                continue
            raw = reader.read(posixpath.join(directory, entry))
            value = _float(raw)
            if value is None:
                if raw is not None:
                    temps.warnings.append(f"unparsable {chip}/{entry}: {raw.strip()[:40]!r}")
                continue
            label = (reader.read(posixpath.join(directory, f"temp{m.group('n')}_label")) or "").strip()
            readings.append(_Reading(name.lower(), chip, label or f"temp{m.group('n')}", value / 1000.0))
    return _classify(readings, temps)


# A reading as sysfs (millidegrees) or ``sensors -u`` (degrees) prints it: ASCII digits, an
# optional sign and fraction.  float() alone would also take "１２", "1_0", "nan" and "inf".
_READING_RE = re.compile(r"[+-]?[0-9]{1,20}(?:\.[0-9]{1,20})?")


def _float(raw: str | None) -> float | None:
    if raw is None:
        return None
    raw = raw.strip()
    return float(raw) if _READING_RE.fullmatch(raw) else None


def parse_sensors_json(text: str) -> Temps:
    """Parse ``sensors -j`` output."""
    temps = Temps()
    data, notes = read_json(text)
    temps.warnings += [f"sensors -j output: {note}" for note in notes]
    if data is None and notes:  # not read (a document of "null" is read, and is no object)
        return temps
    if not isinstance(data, dict):
        temps.warnings.append("sensors -j output is not a JSON object")
        return temps
    readings: list[_Reading] = []
    for chip, features in data.items():
        if not isinstance(features, dict):
            continue
        for label, values in features.items():
            if not isinstance(values, dict):
                continue  # "Adapter": "ISA adapter"
            for sub, value in values.items():
                if _TEMP_INPUT_RE.match(sub) and isinstance(value, int | float) and not isinstance(value, bool):
                    readings.append(_Reading(_chip_family(chip), chip, label, float(value)))
    return _classify(readings, temps)


_SENSORS_U_VALUE_RE = re.compile(r"^\s+(?P<sub>[A-Za-z]+\d*_[A-Za-z_]+):\s*(?P<value>\S+)\s*$")


def parse_sensors_u(text: str) -> Temps:
    """Parse raw ``sensors -u`` (``-A`` or not) output: a chip line, then ``Label:`` lines each
    followed by indented ``tempN_input: value`` lines."""
    temps = Temps()
    readings: list[_Reading] = []
    chip: str | None = None
    label: str | None = None
    expect_chip = True
    for raw in (text or "").lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r").rstrip()
        if not line.strip():
            expect_chip = True
            label = None
            continue
        value_match = _SENSORS_U_VALUE_RE.match(line)
        if value_match and chip is not None and label is not None:
            if _TEMP_INPUT_RE.match(value_match.group("sub")):
                value = _float(value_match.group("value"))
                if value is not None:
                    readings.append(_Reading(_chip_family(chip), chip, label, value))
            continue
        if expect_chip and not line.endswith(":") and ":" not in line:
            chip = line.strip()
            label = None
            expect_chip = False
            continue
        if line.startswith("Adapter:"):
            continue
        if line.endswith(":"):
            label = line[:-1].strip()
            expect_chip = False
    if chip is None:
        temps.warnings.append("no chip lines found: unknown sensors -u layout")
    return _classify(readings, temps)
