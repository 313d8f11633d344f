"""InfiniBand / RoCE ports from sysfs, and the text of ``sminfo``, ``saquery SMIR`` and perftest.

Sources of the formats (see ``shared/reference/fabrics-facility.md`` §2-§4):

* ``/sys/class/infiniband/<dev>/ports/<n>/`` (kernel ``drivers/infiniband/core/sysfs.c``):
  ``state`` and ``phys_state`` are ``"%d: %s"``; ``rate`` is ``"%d%s Gb/sec (%dX%s)"``
  (``"2.5 Gb/sec (1X SDR)"``; old kernels print an HDR link as ``"10 Gb/sec (4X)"``); ``lid``
  and ``sm_lid`` are **hex** (``0x%x``) while ``lid_mask_count`` is decimal; ``gids/<i>`` is
  eight 4-digit groups; ``gid_attrs/types/<i>`` is ``IB/RoCE v1`` or ``RoCE v2`` and fails to
  read for an empty slot; ``counters/*`` are decimal or ``N/A (no PMA)``.
* ``sminfo`` (rdma-core ``infiniband-diags/sminfo.c``): one line
  ``sminfo: sm lid %d sm guid 0x%PRIx64, activity count %u priority %d state %d %s``, or
  ``sminfo: iberror: failed: query`` when no SM answers. A terminal may wrap the line (anywhere)
  and a capture may mask the GUID: each field is read on its own, and what is missing is said.
* ``saquery SMIR`` (rdma-core ``saquery.c`` ``dump_sm_info_record``): ``SMInfoRecord dump:``
  blocks of dotted ``Key.....value`` lines; SMState is a number.
* perftest (``ib_write_bw`` and friends): a banner, then a result table whose columns are found
  by their heading.

Nothing here raises: a value that cannot be read or parsed is None and, where it should have
been there, a sentence in ``warnings`` says why.  Unknown is not zero.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from agent.probes.jsontext import read_json
from agent.probes.sysfs import SysfsReader

__all__ = [
    "PHYS_STATES",
    "PORT_STATES",
    "SMINFO_STATES",
    "IbPort",
    "PerftestResult",
    "PortsReport",
    "RoceGid",
    "SmInfo",
    "SmRecord",
    "counter_saturated",
    "describe_state",
    "expected_rate_mismatch",
    "fabric_identity",
    "master_sm",
    "normalise_guid",
    "parse_ip_addr_json",
    "parse_perftest",
    "parse_saquery_smir",
    "parse_sminfo",
    "port_is_up",
    "read_ports",
    "roce_network",
    "roce_port_network",
    "select_roce_gid",
]

# --------------------------------------------------------------------------- constants

#: ``enum ib_port_state`` as the kernel's ``state`` file names them.
PORT_STATES: dict[int, str] = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
#: ``phys_state_to_str`` in the kernel's sysfs.c.
PHYS_STATES: dict[int, str] = {
    1: "Sleep",
    2: "Polling",
    3: "Disabled",
    4: "PortConfigurationTraining",
    5: "LinkUp",
    6: "LinkErrorRecovery",
    7: "Phy Test",
}
STATE_ACTIVE = 4
PHYS_LINK_UP = 5

#: Widths (bits) of the PortCounters attributes the kernel prints (``PORT_PMA_ATTR`` in sysfs.c).
_PMA_WIDTHS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
}
#: Counters the kernel takes from the 32-bit PortCounters set or, where the device supports it,
#: from the 64-bit PortCountersExtended set, under the same file name (``PORT_PMA_ATTR_EXT``).
_PMA_32_OR_64 = frozenset(
    {
        "port_xmit_data",
        "port_rcv_data",
        "port_xmit_packets",
        "port_rcv_packets",
        "unicast_xmit_packets",
        "unicast_rcv_packets",
        "multicast_xmit_packets",
        "multicast_rcv_packets",
    }
)

SMINFO_STATES: dict[int, str] = {0: "SMINFO_NOTACT", 1: "SMINFO_DISCOVER", 2: "SMINFO_STANDBY", 3: "SMINFO_MASTER"}

_DIGITS_RE = re.compile(r"[0-9]{1,20}")
_STATE_RE = re.compile(r"^\s*(?P<num>[0-9]{1,3})\s*(?::\s*(?P<name>.*?))?\s*$")
_RATE_RE = re.compile(
    r"^\s*(?P<gbps>[0-9]{1,6}(?:\.[0-9]{1,3})?)\s*Gb/sec"
    r"(?:\s*\(\s*(?P<width>[0-9]{1,2})X\s*(?P<speed>[A-Za-z0-9]*)\s*\))?",
    re.IGNORECASE,
)
_HEX_RE = re.compile(r"\s*0x(?P<hex>[0-9A-Fa-f]{1,16})\s*")
_GUID_COLON_RE = re.compile(r"[0-9A-Fa-f]{1,4}(?::[0-9A-Fa-f]{1,4}){3}")


def _natural_key(text: str) -> str:
    """Sort ``mlx5_10`` after ``mlx5_9``."""
    return re.sub(r"\d+", lambda m: m.group(0).zfill(12), text)


def normalise_guid(text: str | None) -> str | None:
    """``"0x"`` + 16 lower-case hex digits from ``b859:9f03:00a1:b2c2`` (sysfs), ``0xb8599f0300a1b2c2``
    (ibstat), ``0x2c903000a1b2`` (sminfo, not zero padded) or bare hex; None if not a 64-bit GUID."""
    if text is None:
        return None
    raw = text.strip()
    if _GUID_COLON_RE.fullmatch(raw):
        value = int("".join(group.zfill(4) for group in raw.split(":")), 16)
    else:
        if raw[:2].lower() == "0x":
            raw = raw[2:]
        if not re.fullmatch(r"[0-9A-Fa-f]{1,16}", raw):
            return None
        value = int(raw, 16)
    return f"0x{value:016x}"


# --------------------------------------------------------------------------- sysfs ports


@dataclass
class RoceGid:
    """One populated entry of a RoCE port's GID table."""

    index: int
    #: Eight 4-digit groups, lower case, as sysfs prints it.
    gid: str
    #: ``gid_attrs/types/<i>`` as printed (``"RoCE v2"``, ``"IB/RoCE v1"``); None if unreadable.
    type: str | None
    #: 2 for ``RoCE v2``, 1 for ``IB/RoCE v1``, None otherwise.
    version: int | None
    netdev: str | None
    #: The IP address the GID carries (IPv4 from an IPv4-mapped GID, else global IPv6); None for
    #: link-local ``fe80::`` GIDs.
    ip: str | None
    #: 4, 6 or None (no IP).
    family: int | None


@dataclass
class IbPort:
    """One ``ports/<n>`` directory of an RDMA device."""

    device: str
    port: int
    #: ``InfiniBand``, ``Ethernet`` (RoCE) or whatever else the file says; None if unreadable.
    link_layer: str | None = None
    state: int | None = None
    state_name: str | None = None
    phys_state: int | None = None
    phys_state_name: str | None = None
    #: Nominal signalling rate from ``rate`` (200.0 for ``200 Gb/sec (4X HDR)``).
    rate_gbps: float | None = None
    rate_text: str | None = None
    #: Lane count and speed token from ``rate`` (4, ``"HDR"``); the token is None on old kernels
    #: that print ``10 Gb/sec (4X)`` for links they do not know.  RoCE ports print IB tokens too.
    width: int | None = None
    speed: str | None = None
    #: Decoded from the hex sysfs files (``0x1f`` -> 31).
    lid: int | None = None
    sm_lid: int | None = None
    lmc: int | None = None
    node_guid: str | None = None
    #: InfiniBand only: the low 64 bits of ``gids/0``; None if absent or zero.
    port_guid: str | None = None
    fw_ver: str | None = None
    node_desc: str | None = None
    #: ``counters/*`` by file name and ``hw_counters/*`` as ``hw_<name>``; values as printed.
    counters: dict[str, int] = field(default_factory=dict)
    #: Counter files that exist but hold no number (``N/A (no PMA)``).
    unreadable_counters: list[str] = field(default_factory=list)
    #: Counters pinned at their maximum (see :func:`counter_saturated`).
    saturated: list[str] = field(default_factory=list)
    #: ``port_xmit_data`` / ``port_rcv_data`` x 4 (they count 4-octet words).
    xmit_bytes: int | None = None
    rcv_bytes: int | None = None
    #: Every populated, non-zero RoCE GID (Ethernet link layer only), by index.
    roce_gids: list[RoceGid] = field(default_factory=list)
    #: The GID NCCL would pick by default (RoCE v2, IPv4); None if the port has none.
    roce_gid_index: int | None = None
    roce_gid: str | None = None
    roce_ip: str | None = None
    #: RoCE: the selected GID's netdev (else the PCI function's netdev for this port);
    #: InfiniBand: the IPoIB netdev of the PCI function for this port, if any.
    netdev: str | None = None
    netdev_operstate: str | None = None


@dataclass
class PortsReport:
    ports: list[IbPort] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def counter_saturated(name: str, value: int) -> bool:
    """Whether a sysfs counter sits at the maximum of the PMA field it was read from.

    The rule, from the kernel's ``PORT_PMA_ATTR`` table: the fixed-width PortCounters
    (``symbol_error`` 16 bit, ``link_downed`` 8 bit, ``local_link_integrity_errors`` 4 bit, ...)
    are saturated at ``2**width - 1``.  The data/packet counters come from the 32-bit set or the
    64-bit extended set under the same name, so ``2**32 - 1`` or ``2**64 - 1`` counts as
    saturated; a 64-bit counter passing exactly through ``2**32 - 1`` is a false positive we
    accept.  Vendor ``hw_counters`` and unknown names are never flagged (their width is unknown).
    """
    width = _PMA_WIDTHS.get(name)
    if width is not None:
        return bool(value == 2**width - 1)
    if name in _PMA_32_OR_64:
        return value in (2**32 - 1, 2**64 - 1)
    return False


def _parse_state(raw: str, names: Mapping[int, str]) -> tuple[int, str] | None:
    m = _STATE_RE.match(raw)
    if m:
        number = int(m.group("num"))
        return number, (m.group("name") or "").strip() or names.get(number, str(number))
    wanted = raw.strip().lower()
    for number, name in names.items():
        if name.lower() == wanted:
            return number, name
    return None


def _parse_hex(raw: str) -> int | None:
    m = _HEX_RE.fullmatch(raw)
    return int(m.group("hex"), 16) if m else None


def _parse_int(raw: str) -> int | None:
    raw = raw.strip()
    return int(raw) if _DIGITS_RE.fullmatch(raw) else None


def _parse_gid(raw: str) -> ipaddress.IPv6Address | None:
    text = raw.strip()
    if not re.fullmatch(r"[0-9A-Fa-f:]{2,39}", text):
        return None
    try:
        return ipaddress.IPv6Address(text)
    except ValueError:
        return None


def _gid_text(addr: ipaddress.IPv6Address) -> str:
    packed = addr.packed
    return ":".join(f"{packed[i]:02x}{packed[i + 1]:02x}" for i in range(0, 16, 2))


def _gid_ip(addr: ipaddress.IPv6Address) -> tuple[str | None, int | None]:
    mapped = addr.ipv4_mapped
    if mapped is not None:
        return str(mapped), 4
    if addr.is_link_local or addr.is_unspecified:
        return None, None
    return str(addr), 6


def _device_dirs(reader: SysfsReader, base: str) -> list[tuple[str, str]]:
    """``(device name, device directory)`` pairs.  A real root lists ``base``; a captured tree
    is searched for ``<dev>/ports/`` anywhere (``/sys/class/infiniband/mlx5_0``,
    ``/sys/bus/pci/devices/<bdf>/infiniband/mlx5_0``, or ``mlx5_0`` relative to where grep ran),
    one directory per device name, preferring the one under ``base``."""
    if not reader.is_tree:
        names = sorted(reader.listdir(base), key=_natural_key)
        return [(name, posixpath.join(base, name)) for name in names]
    base_norm = posixpath.normpath(base.lstrip("/"))
    chosen: dict[str, str] = {}
    for ports_dir in reader.find_dirs(base, lambda n: n == "ports"):
        device_dir = posixpath.dirname(ports_dir)
        name = posixpath.basename(device_dir) or "unknown"
        if posixpath.basename(posixpath.dirname(device_dir)) == "ports":
            continue  # a "ports" directory nested inside a port: not a device
        previous = chosen.get(name)
        if previous is None or (
            posixpath.dirname(device_dir) == base_norm and posixpath.dirname(previous) != base_norm
        ):
            chosen[name] = device_dir
    return sorted(chosen.items(), key=lambda item: _natural_key(item[0]))


def _pci_net_dir(reader: SysfsReader, device_dir: str) -> str | None:
    """The ``net`` directory of the PCI function behind an RDMA device, if the tree has it."""
    candidate = posixpath.join(device_dir, "device", "net")
    if reader.listdir(candidate):
        return candidate
    parent = posixpath.dirname(device_dir)
    grand = posixpath.dirname(parent)
    # A capture of /sys/bus/pci/devices/<bdf>/{infiniband/<dev>,net/<if>}; never /sys/class/net.
    if posixpath.basename(parent) == "infiniband" and posixpath.basename(grand) not in ("class", ""):
        candidate = posixpath.join(grand, "net")
        if reader.listdir(candidate):
            return candidate
    return None


def _pci_netdev_for_port(reader: SysfsReader, net_dir: str, port: int) -> str | None:
    """The netdev whose ``dev_port`` (0-based) is this port, or the only netdev there is."""
    names = reader.listdir(net_dir)
    for name in names:
        dev_port = _parse_int(reader.read(posixpath.join(net_dir, name, "dev_port")) or "")
        if dev_port is not None and dev_port == port - 1:
            return name
    return names[0] if len(names) == 1 else None


def select_roce_gid(gids: Iterable[RoceGid], *, version: int = 2, family: int | None = 4) -> RoceGid | None:
    """The first GID (by index) of RoCE ``version`` carrying an IP of ``family`` (4, 6, or None
    for either).  The defaults are NCCL's (``NCCL_IB_ROCE_VERSION_NUM=2``,
    ``NCCL_IB_ADDR_FAMILY=AF_INET``); a port without an IPv4 RoCE v2 GID selects nothing."""
    for gid in sorted(gids, key=lambda g: g.index):
        if gid.version != version or gid.ip is None:
            continue
        if family is None or gid.family == family:
            return gid
    return None


@dataclass
class _Device:
    name: str
    path: str
    node_guid: str | None = None
    fw_ver: str | None = None
    node_desc: str | None = None


class _PortReader:
    def __init__(self, reader: SysfsReader, warnings: list[str]) -> None:
        self.reader = reader
        self.warnings = warnings

    def field(self, path: str, what: str, *, required: bool = True) -> str | None:
        raw = self.reader.read(path)
        if raw is None:
            if required:
                self.warnings.append(f"{what}: missing or unreadable")
            return None
        return raw.strip()

    def read_port(self, device: _Device, port_dir: str, number: int) -> IbPort:
        where = f"{device.name} port {number}"
        port = IbPort(
            device=device.name,
            port=number,
            node_guid=device.node_guid,
            fw_ver=device.fw_ver,
            node_desc=device.node_desc,
        )
        join = posixpath.join

        raw = self.field(join(port_dir, "link_layer"), f"{where} link_layer")
        port.link_layer = raw or None

        for attr, names in (("state", PORT_STATES), ("phys_state", PHYS_STATES)):
            raw = self.field(join(port_dir, attr), f"{where} {attr}")
            if raw is None:
                continue
            parsed = _parse_state(raw, names)
            if parsed is None:
                self.warnings.append(f"{where} {attr}: unparsable {raw[:40]!r}")
                continue
            setattr(port, attr, parsed[0])
            setattr(port, f"{attr}_name", parsed[1])

        raw = self.field(join(port_dir, "rate"), f"{where} rate")
        if raw is not None:
            port.rate_text = raw
            m = _RATE_RE.match(raw)
            if m:
                port.rate_gbps = float(m.group("gbps"))
                port.width = int(m.group("width")) if m.group("width") else None
                port.speed = (m.group("speed") or "").upper() or None
            else:
                self.warnings.append(f"{where} rate: unparsable {raw[:40]!r}")

        for attr in ("lid", "sm_lid"):
            raw = self.field(join(port_dir, attr), f"{where} {attr}")
            if raw is None:
                continue
            value = _parse_hex(raw)
            if value is None:  # the kernel prints 0x%x; a bare "31" is not sysfs output
                self.warnings.append(f"{where} {attr}: not a 0x-prefixed hex number: {raw[:40]!r}")
            setattr(port, attr, value)

        raw = self.field(join(port_dir, "lid_mask_count"), f"{where} lid_mask_count")
        if raw is not None:
            port.lmc = _parse_int(raw)
            if port.lmc is None:
                self.warnings.append(f"{where} lid_mask_count: unparsable {raw[:40]!r}")

        self.read_counters(port, port_dir, where)
        self.read_gids(port, port_dir, where)
        self.read_netdev(port, device.path)
        return port

    def read_counters(self, port: IbPort, port_dir: str, where: str) -> None:
        for folder, prefix in (("counters", ""), ("hw_counters", "hw_")):
            directory = posixpath.join(port_dir, folder)
            for name in self.reader.listdir(directory):
                raw = self.reader.read(posixpath.join(directory, name))
                value = _parse_int(raw) if raw is not None else None
                key = prefix + name
                if value is None:
                    port.unreadable_counters.append(key)
                    if raw is not None and not raw.strip().upper().startswith("N/A"):
                        self.warnings.append(f"{where} {folder}/{name}: unparsable {raw.strip()[:40]!r}")
                    continue
                port.counters[key] = value
                if not prefix and counter_saturated(name, value):
                    port.saturated.append(key)
        if "port_xmit_data" in port.counters:
            port.xmit_bytes = port.counters["port_xmit_data"] * 4
        if "port_rcv_data" in port.counters:
            port.rcv_bytes = port.counters["port_rcv_data"] * 4

    def read_gids(self, port: IbPort, port_dir: str, where: str) -> None:
        join = posixpath.join
        if port.link_layer == "InfiniBand":
            raw = self.reader.read(join(port_dir, "gids", "0"))
            if raw is not None:
                addr = _parse_gid(raw)
                if addr is None:
                    self.warnings.append(f"{where} gids/0: unparsable {raw.strip()[:48]!r}")
                elif int(addr) & (2**64 - 1):
                    port.port_guid = f"0x{int(addr) & (2**64 - 1):016x}"
            return
        if port.link_layer != "Ethernet":
            return
        indexes = {
            int(name)
            for folder in (join(port_dir, "gids"), join(port_dir, "gid_attrs", "types"))
            for name in self.reader.listdir(folder)
            if _DIGITS_RE.fullmatch(name)
        }
        for index in sorted(indexes):
            raw = self.reader.read(join(port_dir, "gids", str(index)))
            if raw is None:
                continue
            addr = _parse_gid(raw)
            if addr is None:
                self.warnings.append(f"{where} gids/{index}: unparsable {raw.strip()[:48]!r}")
                continue
            if addr.is_unspecified:
                continue  # an empty slot; its gid_attrs reads fail (EINVAL), which is normal
            gid_type = (self.reader.read(join(port_dir, "gid_attrs", "types", str(index))) or "").strip() or None
            netdev = (self.reader.read(join(port_dir, "gid_attrs", "ndevs", str(index))) or "").strip() or None
            if gid_type is None:
                self.warnings.append(f"{where} gid {index}: gid_attrs/types unreadable for a non-empty GID")
            version = None
            if gid_type is not None:
                lowered = gid_type.lower()
                version = 2 if "v2" in lowered else 1 if "v1" in lowered else None
            ip, family = _gid_ip(addr)
            port.roce_gids.append(RoceGid(index, _gid_text(addr), gid_type, version, netdev, ip, family))
        chosen = select_roce_gid(port.roce_gids)
        if chosen is not None:
            port.roce_gid_index = chosen.index
            port.roce_gid = chosen.gid
            port.roce_ip = chosen.ip
            port.netdev = chosen.netdev

    def read_netdev(self, port: IbPort, device_dir: str) -> None:
        net_dir = _pci_net_dir(self.reader, device_dir)
        if port.netdev is None and net_dir is not None and port.link_layer in ("InfiniBand", "Ethernet"):
            port.netdev = _pci_netdev_for_port(self.reader, net_dir, port.port)
        if port.netdev is None:
            return
        candidates = [posixpath.join(net_dir, port.netdev, "operstate")] if net_dir else []
        # /sys/class/net/<if> next to /sys/class/infiniband, e.g. a VLAN netdev of a RoCE GID
        candidates.append(
            posixpath.join(posixpath.dirname(posixpath.dirname(device_dir)), "net", port.netdev, "operstate")
        )
        for path in candidates:
            raw = self.reader.read(path)
            if raw is not None and raw.strip():
                port.netdev_operstate = raw.strip()
                return


def read_ports(reader: SysfsReader | str | Mapping[str, str], base: str = "sys/class/infiniband") -> PortsReport:
    """Every ``<dev>/ports/<n>`` under ``base`` (a real root such as ``"/"``, or a captured
    ``{path: contents}`` tree, in which ports are found wherever the capture put them).

    1. List the RDMA devices and read the device-level ``node_guid``, ``fw_ver``, ``node_desc``.
    2. For each numeric port directory read state, physical state, rate, LIDs (hex), LMC.
    3. Read ``counters/*`` and ``hw_counters/*``; flag saturated PMA counters.
    4. InfiniBand: port GUID from ``gids/0``.  Ethernet: walk the GID table, keep non-zero
       entries, and select the first IPv4 RoCE v2 GID as NCCL does.
    5. Find the port's netdev and its operstate.
    """
    if not isinstance(reader, SysfsReader):
        reader = SysfsReader(reader)
    report = PortsReport()
    helper = _PortReader(reader, report.warnings)
    for name, device_dir in _device_dirs(reader, base):
        device = _Device(name, device_dir)
        raw = helper.field(posixpath.join(device_dir, "node_guid"), f"{name} node_guid")
        if raw is not None:
            device.node_guid = normalise_guid(raw)
            if device.node_guid is None:
                report.warnings.append(f"{name} node_guid: unparsable {raw[:40]!r}")
        raw = helper.field(posixpath.join(device_dir, "fw_ver"), "", required=False)
        if raw and re.search(r"[0-9]", raw):
            device.fw_ver = raw
        elif raw:
            report.warnings.append(f"{name} fw_ver: not a version: {raw[:40]!r}")
        device.node_desc = helper.field(posixpath.join(device_dir, "node_desc"), "", required=False) or None
        ports_dir = posixpath.join(device_dir, "ports")
        numbers = sorted(int(n) for n in reader.listdir(ports_dir) if _DIGITS_RE.fullmatch(n))
        if not numbers:
            report.warnings.append(f"{name}: no ports found")
        for number in numbers:
            report.ports.append(helper.read_port(device, posixpath.join(ports_dir, str(number)), number))
    return report


def port_is_up(port: IbPort) -> bool:
    """ACTIVE (4) and LinkUp (5): the SM has activated the port and the link is trained."""
    return port.state == STATE_ACTIVE and port.phys_state == PHYS_LINK_UP


def describe_state(port: IbPort) -> str:
    """One line for people: ``"mlx5_6/1: INIT (2), LinkUp (5), 200 Gb/sec (4X HDR): link is up but
    the port was not activated; is a subnet manager running?"``."""
    state = f"{port.state_name or '?'} ({port.state})" if port.state is not None else "state unknown"
    phys = f"{port.phys_state_name or '?'} ({port.phys_state})" if port.phys_state is not None else "phys unknown"
    text = f"{port.device}/{port.port}: {state}, {phys}"
    if port.rate_text:
        text += f", {port.rate_text}"
    hint: str | None = None
    if port_is_up(port):
        hint = "up"
    elif port.phys_state == 2:
        hint = "no link: no cable, peer down or wrong speed (Polling)"
    elif port.phys_state == 3:
        hint = "port disabled"
    elif port.phys_state == 1:
        hint = "port asleep"
    elif port.phys_state == 4:
        hint = "link training"
    elif port.phys_state == 6:
        hint = "link error recovery"
    elif port.phys_state == PHYS_LINK_UP and port.state == 2:
        if port.link_layer == "InfiniBand":
            hint = "link is up but the port was not activated; is a subnet manager running?"
        else:
            hint = "link is up but the port was not activated"
    elif port.phys_state == PHYS_LINK_UP and port.state == 3:
        hint = "armed: waiting for the subnet manager to activate it"
    elif port.state == 1:
        hint = "down"
    if hint:
        text += f": {hint}"
    return text


def expected_rate_mismatch(
    ports: Iterable[IbPort], expected_gbps: float | Mapping[str, float] | None = None
) -> list[tuple[IbPort, float, float]]:
    """ACTIVE ports whose rate is below what their peers run at: ``(port, rate, reference)``.

    Downshifted links stay ACTIVE (a ``100 Gb/sec (4X EDR)`` port on an HDR fleet), so state
    alone does not catch them.  Ports are compared per link layer; the reference is
    ``expected_gbps`` (one number, or a ``{link_layer: Gb/s}`` mapping) when given, otherwise
    the most common rate among the ACTIVE ports of that link layer (a tie goes to the higher
    rate).  Only slower ports are reported: a faster one is not a downshift.
    """
    groups: dict[str, list[IbPort]] = {}
    for port in ports:
        if port.state == STATE_ACTIVE and port.rate_gbps is not None:
            groups.setdefault(port.link_layer or "", []).append(port)
    flagged: list[tuple[IbPort, float, float]] = []
    for link_layer, members in groups.items():
        reference: float | None
        if isinstance(expected_gbps, Mapping):
            reference = expected_gbps.get(link_layer)
        else:
            reference = expected_gbps
        if reference is None:
            counts = Counter(p.rate_gbps for p in members if p.rate_gbps is not None)
            reference = max(counts, key=lambda rate: (counts[rate], rate))
        for port in members:
            if port.rate_gbps is not None and port.rate_gbps < reference:
                flagged.append((port, port.rate_gbps, reference))
    return flagged


# --------------------------------------------------------------------------- IP addresses


def roce_network(ip: str, prefixlen: int) -> str | None:
    """``roce_network("10.0.0.7", 24) == "10.0.0.0/24"``; None for an invalid address or prefix."""
    try:
        return str(ipaddress.ip_network(f"{ip.strip()}/{int(prefixlen)}", strict=False))
    except (ValueError, TypeError, AttributeError):
        return None


def parse_ip_addr_json(text: str) -> dict[str, list[tuple[str, int]]]:
    """``{ifname: [(address, prefixlen), ...]}`` from ``ip -j addr show``; IPv4 and IPv6, in the
    order printed.  Anything unreadable is skipped; bad JSON gives ``{}``."""
    data, _notes = read_json(text)
    result: dict[str, list[tuple[str, int]]] = {}
    if not isinstance(data, list):
        return result
    for link in data:
        if not isinstance(link, dict):
            continue
        name = link.get("ifname")
        if not isinstance(name, str) or not name:
            continue
        addrs = result.setdefault(name, [])
        infos = link.get("addr_info")
        if not isinstance(infos, list):
            continue
        for info in infos:
            if not isinstance(info, dict):
                continue
            local, prefix = info.get("local"), info.get("prefixlen")
            if isinstance(local, str) and isinstance(prefix, int) and not isinstance(prefix, bool):
                try:
                    ipaddress.ip_address(local)
                except ValueError:
                    continue
                addrs.append((local, prefix))
    return result


def roce_port_network(port: IbPort, addrs: Mapping[str, list[tuple[str, int]]]) -> str | None:
    """The subnet of a port's selected RoCE IP, from :func:`parse_ip_addr_json` output."""
    if port.roce_ip is None or port.netdev is None:
        return None
    for ip, prefix in addrs.get(port.netdev, []):
        if ip == port.roce_ip:
            return roce_network(ip, prefix)
    return None


# --------------------------------------------------------------------------- sminfo / saquery


@dataclass
class SmInfo:
    """``sminfo`` output: the SM the local port's ``sm_lid`` points at, or why it failed."""

    lid: int | None = None
    guid: str | None = None
    activity_count: int | None = None
    priority: int | None = None
    state: int | None = None
    state_name: str | None = None
    #: The ``iberror`` message (``"query"``) when sminfo failed; None on success.
    error: str | None = None
    #: What the line did not say, or said unreadably (a masked or shortened GUID), in words.
    warnings: list[str] = field(default_factory=list)


# Each field of the sminfo line on its own, so that a line wrapped by a terminal (anywhere, even
# inside a word) and joined again, or one with a field masked, still gives the rest.
_SMINFO_START_RE = re.compile(r"sminfo:\s*sm\s*lid\s*(?P<lid>\d{1,10})(?!\d)")
_SMINFO_GUID_RE = re.compile(r"sm\s*guid\s*(?P<guid>[^,]*?)\s*(?:,|activity|$)")
_SMINFO_FIELD_RES = {
    "activity count": re.compile(r"activity\s*count\s*(?P<v>\d{1,10})(?!\d)"),
    "priority": re.compile(r"priority\s*(?P<v>\d{1,10})(?!\d)"),
    "state": re.compile(r"state\s*(?P<v>\d{1,10})(?!\d)"),
}
_SMINFO_GUID_TEXT_RE = re.compile(r"0x[0-9A-Fa-f]{1,16}")
_TOOL_LINE_RE = re.compile(r"\s*(?:sminfo:|ibwarn|iberror|\S+\.c:\d+)")
_IBERROR_RE = re.compile(r"iberror:\s*(?:\[pid \d+\]\s*\S+:\s*)?failed:\s*(?P<msg>.*)$")


def _sminfo_line(text: str) -> str | None:
    """The sminfo line with the lines a terminal wrapped it onto joined back (no separator: a
    wrap can fall inside a number), or None when there is none."""
    lines = (text or "").lstrip("\ufeff").splitlines()
    for index, raw in enumerate(lines):
        m = _SMINFO_START_RE.search(raw)
        if m is None:
            continue
        parts = [raw[m.start() :].rstrip("\r")]
        for more in lines[index + 1 :]:
            if not more.strip() or _TOOL_LINE_RE.match(more):
                break
            parts.append(more.strip())
        return "".join(parts)
    return None


def parse_sminfo(text: str) -> SmInfo | None:
    """The ``sminfo`` line, also wrapped over several lines or with a field masked: what it says,
    and in ``warnings`` what it does not; an :class:`SmInfo` with only ``error`` set for
    ``sminfo: iberror: failed: query`` (no SM answering); None for anything else."""
    line = _sminfo_line(text)
    if line is None:
        for raw in (text or "").lstrip("\ufeff").splitlines():
            m = _IBERROR_RE.search(raw.strip())
            if m:
                return SmInfo(error=m.group("msg").strip() or "failed")
        return None
    start = _SMINFO_START_RE.match(line)
    info = SmInfo(lid=int(start.group("lid")) if start else None)
    _sminfo_guid(info, line)
    values: dict[str, int | None] = {}
    for name, pattern in _SMINFO_FIELD_RES.items():
        m = pattern.search(line)
        values[name] = int(m.group("v")) if m else None
        if m is None:
            info.warnings.append(f"sminfo did not give the subnet manager's {name}")
    info.activity_count, info.priority, info.state = values["activity count"], values["priority"], values["state"]
    if info.state is not None:
        info.state_name = SMINFO_STATES.get(info.state)  # sminfo prints "???" out of range
    return info


def _sminfo_guid(info: SmInfo, line: str) -> None:
    m = _SMINFO_GUID_RE.search(line)
    if m is None:
        info.warnings.append("sminfo did not give the subnet manager's GUID")
        return
    token = m.group("guid").strip()
    if _SMINFO_GUID_TEXT_RE.fullmatch(token):
        info.guid = normalise_guid(token)
    else:
        shown = token if len(token) <= 40 else token[:39] + "…"
        info.warnings.append(f"the subnet manager's GUID is masked or cut short ({shown!r}), so it is unknown")


@dataclass
class SmRecord:
    """One ``SMInfoRecord dump:`` block of ``saquery SMIR``."""

    guid: str
    lid: int | None = None
    sm_key: str | None = None
    act_count: int | None = None
    priority: int | None = None
    #: Numeric SMState (3 = master, 2 = standby, 1 = discovering, 0 = not active).
    state: int | None = None
    state_name: str | None = None


_SA_LINE_RE = re.compile(r"^\s*(?P<key>[A-Za-z_]+)\s*(?:\.{2,}|:)\s*(?P<value>\S.*?)\s*$")


def _sa_int(value: str) -> int | None:
    value = value.strip()
    if re.fullmatch(r"0x[0-9A-Fa-f]{1,16}", value, re.IGNORECASE):
        return int(value, 16)
    return int(value) if _DIGITS_RE.fullmatch(value) else None


def _sa_state(value: str) -> int | None:
    number = _sa_int(value)
    if number is not None:
        return number
    m = re.search(r"\((\d{1,2})\)", value)  # "MASTER (3)", an invented form that circulates
    if m:
        return int(m.group(1))
    word = value.strip().upper()
    for number, name in SMINFO_STATES.items():
        if word in (name, name.removeprefix("SMINFO_")):
            return number
    return None


def parse_saquery_smir(text: str) -> list[SmRecord]:
    """Every ``SMInfoRecord dump:`` block that carries a GUID, in output order.

    Tolerates any number of dots, spaces or tabs, CRLF, a truncated last block, ``SM_GUID``
    for ``GUID`` and ``MASTER (3)`` for ``3``.
    """
    records: list[SmRecord] = []
    block: dict[str, str] | None = None

    def close(current: dict[str, str] | None) -> None:
        if not current:
            return
        guid = normalise_guid(current.get("guid") or current.get("sm_guid"))
        if guid is None:
            return
        state = _sa_state(current["smstate"]) if "smstate" in current else None
        records.append(
            SmRecord(
                guid=guid,
                lid=_sa_int(current["lid"]) if "lid" in current else None,
                sm_key=normalise_guid(current.get("sm_key")),
                act_count=_sa_int(current["actcount"]) if "actcount" in current else None,
                priority=_sa_int(current["priority"]) if "priority" in current else None,
                state=state,
                state_name=SMINFO_STATES.get(state) if state is not None else None,
            )
        )

    for raw in (text or "").lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r")
        if "SMInfoRecord dump" in line:
            close(block)
            block = {}
            continue
        if block is None:
            continue
        m = _SA_LINE_RE.match(line)
        if m:
            key = m.group("key").lower()
            block.setdefault(key, m.group("value"))
    close(block)
    return records


def fabric_identity(records: Iterable[SmRecord]) -> str | None:
    """A stable name for the subnet: the lowest non-zero SM GUID among the records."""
    guids = [int(r.guid, 16) for r in records if r.guid and int(r.guid, 16)]
    return f"0x{min(guids):016x}" if guids else None


def master_sm(records: Iterable[SmRecord]) -> SmRecord | None:
    """The record in MASTER state (3), if one is listed."""
    return next((r for r in records if r.state == 3), None)


# --------------------------------------------------------------------------- perftest


@dataclass
class PerftestResult:
    """A perftest run (``ib_*_bw`` or ``ib_*_lat``) as printed by either side."""

    #: Banner title (``"RDMA_Write BW Test"``).
    test: str | None = None
    #: Banner ``key : value`` fields with normalised keys (``device``, ``link_type``, ``gid_index``).
    settings: dict[str, str] = field(default_factory=dict)
    device: str | None = None
    link_type: str | None = None
    qps: int | None = None
    bidirectional: bool = False
    #: Normalised column names in header order (``bytes``, ``iterations``, ``bw_peak``, ...).
    columns: list[str] = field(default_factory=list)
    #: Unit of each column that printed one (``{"bw_peak": "Gb/sec", "t_min": "usec"}``).
    units: dict[str, str] = field(default_factory=dict)
    #: The bandwidth unit as printed (``Gb/sec``, ``MiB/sec``, old ``MB/sec``); None for latency.
    unit: str | None = None
    #: One dict per table row, keyed by column name, values as printed; bandwidth rows also get
    #: ``bw_peak_gbps`` / ``bw_average_gbps``.  An unmeasured peak is left out (not 0).
    rows: list[dict[str, float]] = field(default_factory=list)
    #: The row with the largest message size (the last such row on a tie).
    largest: dict[str, float] | None = None
    bw_average_gbps: float | None = None
    bw_peak_gbps: float | None = None
    msg_rate_mpps: float | None = None
    #: False when perftest said ``BW peak won't be measured`` (``-D``, ``--run_infinitely``).
    peak_measured: bool = True
    #: perftest's own warnings (``perftest: ...``) and what could not be parsed.
    warnings: list[str] = field(default_factory=list)


#: Bytes per "MB" in perftest's report: ``format_factor = 0x100000`` for MBS in
#: ``perftest_resources.c``, so old ``MB/sec`` already meant MiB/s (the 2024 rename to
#: ``MiB/sec`` fixed the label, not the number).
_MIB = 2**20
_BW_UNIT_TO_GBPS: dict[str, float] = {
    "gb/sec": 1.0,
    "mib/sec": _MIB * 8 / 1e9,
    "mb/sec": _MIB * 8 / 1e9,
}
_COLUMN_ALIASES: dict[str, str] = {
    "bytes": "bytes",
    "iterations": "iterations",
    "bw_peak": "bw_peak",
    "bw_average": "bw_average",
    "msgrate": "msg_rate",
    "99_percentile": "p99",
    "99_9_percentile": "p99_9",
}
_HEADER_TOKEN_RE = re.compile(r"#\S+|[^\s\[\]#]+(?: [^\s\[\]#]+)*(?:\[[^\]]*\])?|\[[^\]]*\]")
_NUMBER_RE = re.compile(r"[+-]?[0-9]{1,30}(?:\.[0-9]{1,30})?(?:[eE][+-]?[0-9]{1,3})?")
_DASHES_RE = re.compile(r"^\s*-{20,}\s*$")
_BANNER_PAIR_RE = re.compile(r"(?P<key>[A-Za-z][A-Za-z0-9_.*/()+ -]*?)\s*:\s*(?P<value>\S+)")
_TOOL_WARNING_RE = re.compile(
    r"(WARNING\b.*|Conflicting CPU frequency.*|Using sampled CPU speed.*|CPU Frequency is not max.*)", re.IGNORECASE
)


def _column_name(token: str) -> tuple[str, str | None]:
    m = re.fullmatch(r"(?P<name>[^\[]*)(?:\[(?P<unit>[^\]]*)\])?", token.strip())
    name = (m.group("name") if m else token).strip().lstrip("#")
    unit = m.group("unit") if m and m.group("unit") is not None else None
    key = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "column"
    return _COLUMN_ALIASES.get(key, key), unit


def _parse_header(line: str) -> tuple[list[str], dict[str, str]]:
    text = line[line.find("#bytes") :] if "#bytes" in line else line
    columns: list[str] = []
    units: dict[str, str] = {}
    for token in _HEADER_TOKEN_RE.findall(text):
        name, unit = _column_name(token)
        while name in columns:
            name += "_"
        columns.append(name)
        if unit:
            units[name] = unit
    return columns, units


def _number(token: str) -> float | None:
    if not _NUMBER_RE.fullmatch(token):
        return None
    value = float(token)
    return value if math.isfinite(value) else None


def _tool_warning(line: str) -> str | None:
    m = _TOOL_WARNING_RE.search(line)
    return f"perftest: {m.group(1).strip()}" if m else None


def parse_perftest(text: str) -> PerftestResult:
    """Read a perftest result table by its heading.

    1. The banner (between the first two dashed lines) gives the test name and settings.
    2. A line containing ``#bytes`` is a table heading; its columns (``#bytes``,
       ``BW peak[Gb/sec]``, ``t_min[usec]``, ``99% percentile[usec]`` ...) are named from the
       heading text, so new or reordered columns are found by name.
    3. Rows follow until a dashed line: a line whose tokens are all numbers, as many as there are
       columns.  Other text there (CPU-frequency warnings) is kept as a warning.
    4. Bandwidths convert to Gb/s: ``Gb/sec`` as is, ``MiB/sec`` and old ``MB/sec`` (also 2**20
       bytes) x 2**20 x 8 / 1e9.  Bidirectional runs print the sum of both directions.
    5. A peak of 0.00 is "not measured" (``-D`` runs say so): it is left out, never reported as 0.
    """
    result = PerftestResult()
    lines = [raw.rstrip("\r") for raw in (text or "").lstrip("\ufeff").splitlines()]
    dash_count = 0
    in_table = False
    table_columns: list[str] = []
    seen_warnings: set[str] = set()

    def warn_tool(line: str) -> bool:
        message = _tool_warning(line)
        if message is None:
            return False
        if message not in seen_warnings:
            seen_warnings.add(message)
            result.warnings.append(message)
        if "peak won't be measured" in message.lower() or "peak will not be measured" in message.lower():
            result.peak_measured = False
        return True

    for line in lines:
        stripped = line.strip()
        if _DASHES_RE.match(line):
            dash_count += 1
            in_table = False
            continue
        if "#bytes" in stripped:
            columns, units = _parse_header(stripped)
            if not result.columns:
                result.columns, result.units = columns, units
            elif columns != result.columns:
                result.warnings.append(f"ignored a second result table with other columns: {stripped[:80]!r}")
                in_table = False
                continue
            table_columns = columns
            in_table = True
            continue
        if in_table:
            tokens = stripped.split()
            if not tokens:
                continue
            values = [_number(t) for t in tokens]
            if values[0] is not None and float(values[0]).is_integer():
                if len(tokens) == len(table_columns) and all(v is not None for v in values):
                    result.rows.append(
                        {c: float(v) for c, v in zip(table_columns, values, strict=True) if v is not None}
                    )
                else:
                    result.warnings.append(f"skipped an incomplete or malformed result row: {stripped[:80]!r}")
                continue
            if not warn_tool(stripped):
                result.warnings.append(f"perftest: {stripped[:160]}")
            continue
        if warn_tool(stripped):
            continue
        if dash_count == 1 and stripped and "address" not in stripped and not re.match(r"GID\s*:", stripped):
            if ":" not in stripped:
                if result.test is None:
                    result.test = stripped
            else:
                for m in _BANNER_PAIR_RE.finditer(stripped):
                    key = re.sub(r"[^a-z0-9]+", "_", m.group("key").lower()).strip("_")
                    if key:
                        result.settings.setdefault(key, m.group("value"))

    _finish_perftest(result)
    return result


def _finish_perftest(result: PerftestResult) -> None:
    settings = result.settings
    result.device = settings.get("device")
    result.link_type = settings.get("link_type")
    qps = settings.get("number_of_qps")
    result.qps = int(qps) if qps and _DIGITS_RE.fullmatch(qps) else None
    result.bidirectional = bool(result.test and "bidirectional" in result.test.lower())

    bw_unit = result.units.get("bw_average") or result.units.get("bw_peak")
    result.unit = bw_unit
    factor = _BW_UNIT_TO_GBPS.get(bw_unit.strip().lower()) if bw_unit else None
    if bw_unit and factor is None:
        result.warnings.append(f"unknown bandwidth unit {bw_unit!r}; no Gb/s values")
    for row in result.rows:
        average = row.get("bw_average")
        peak = row.get("bw_peak")
        if peak is not None and (not result.peak_measured or (peak == 0 and (average or 0) > 0)):
            del row["bw_peak"]
            peak = None
        if factor is not None:
            if average is not None:
                row["bw_average_gbps"] = average * factor
            if peak is not None:
                row["bw_peak_gbps"] = peak * factor
    if any("bw_peak" in result.columns and "bw_peak" not in row for row in result.rows):
        result.peak_measured = False
    sized = [row for row in result.rows if "bytes" in row]
    if sized:
        largest = sized[0]
        for row in sized:
            if row["bytes"] >= largest["bytes"]:
                largest = row
        result.largest = largest
        result.bw_average_gbps = largest.get("bw_average_gbps")
        result.bw_peak_gbps = largest.get("bw_peak_gbps")
        result.msg_rate_mpps = largest.get("msg_rate")
    elif not result.columns:
        result.warnings.append("no perftest result table (no #bytes heading)")
    else:
        result.warnings.append("the perftest result table has no rows")
