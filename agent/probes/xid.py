"""Parser for NVIDIA Xid events in kernel logs (``dmesg``, ``dmesg -T``, ``journalctl -k``).

The driver logs one line per event::

    NVRM: Xid (PCI:0000:19:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error ...
    NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s of waiting ...
    NVRM: Xid (0000:01:00): 79, GPU has fallen off the bus.

whatever prefix the log tool puts before ``NVRM:`` (``[Sun Feb 23 16:24:18 2025]``, an ISO
timestamp, ``host kernel:``).  Every other line (RPC history tables, stack traces, other
drivers' noise) is ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["XidEvent", "bus_id_to_xid_pci", "count_xids", "parse_xid_lines"]


@dataclass
class XidEvent:
    """One ``NVRM: Xid`` line."""

    code: int
    #: PCI address as the driver printed it, lower-cased (``"0000:19:00"``); None if absent.
    pci: str | None
    #: Process the driver blamed; None for ``pid='<unknown>'`` or when not printed.
    pid: int | None
    #: The message after the code, without the ``pid=``/``name=`` prefix.
    text: str
    process_name: str | None = None
    #: Whatever preceded ``NVRM:`` on the line (the log tool's timestamp), stripped; None if nothing.
    prefix: str | None = None


_XID_RE = re.compile(
    r"NVRM:\s*Xid\s*\((?:PCI:)?(?P<pci>[0-9A-Fa-f]{2,8}(?::[0-9A-Fa-f]{1,2}){1,2}(?:\.[0-9A-Fa-f])?)?\)\s*:?\s*"
    r"(?P<code>\d+)\s*(?:,\s*(?P<rest>.*))?$"
)
_PID_RE = re.compile(r"^pid=(?P<pid>[^,]*?)\s*(?:,\s*|$)")
_NAME_RE = re.compile(r"^name=(?P<name>[^,]*?)\s*(?:,\s*|$)")


def _pid(raw: str) -> int | None:
    raw = raw.strip().strip("'\"")
    # '<unknown>', or 0 (no user process); ASCII digits only, as "²" passes isdigit() and fails int()
    if not re.fullmatch(r"[0-9]{1,20}", raw) or int(raw) == 0:
        return None
    return int(raw)


def _name(raw: str) -> str | None:
    raw = raw.strip().strip("'\"")
    if not raw or raw.lower() in ("<unknown>", "unknown"):
        return None
    return raw


def parse_xid_lines(text: str) -> list[XidEvent]:
    """All Xid events in ``text``, in log order.  Lines that are not Xid lines are skipped."""
    events: list[XidEvent] = []
    for raw in (text or "").lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r").rstrip()
        if "Xid" not in line:
            continue
        m = _XID_RE.search(line)
        if not m:
            continue
        rest = (m.group("rest") or "").strip()
        pid: int | None = None
        name: str | None = None
        pm = _PID_RE.match(rest)
        if pm:
            pid = _pid(pm.group("pid"))
            rest = rest[pm.end() :]
        nm = _NAME_RE.match(rest)
        if nm:
            name = _name(nm.group("name"))
            rest = rest[nm.end() :]
        prefix = line[: line.find("NVRM:")].strip() or None
        pci = m.group("pci")
        events.append(
            XidEvent(
                code=int(m.group("code")),
                pci=pci.lower() if pci else None,
                pid=pid,
                text=rest.strip(),
                process_name=name,
                prefix=prefix,
            )
        )
    return events


def count_xids(events: Iterable[XidEvent]) -> dict[str, dict[int, int]]:
    """Count events by PCI address, then by Xid code.  Events without an address count under ``"unknown"``."""
    counts: dict[str, dict[int, int]] = {}
    for event in events:
        per_code = counts.setdefault(event.pci or "unknown", {})
        per_code[event.code] = per_code.get(event.code, 0) + 1
    return counts


def bus_id_to_xid_pci(bus_id: str | None) -> str | None:
    """Map an nvidia-smi bus id (``"00000000:19:00.0"``) to the form Xid lines use (``"0000:19:00"``)."""
    if not bus_id:
        return None
    m = re.fullmatch(
        r"(?P<domain>[0-9A-Fa-f]{4,8}):(?P<bus>[0-9A-Fa-f]{2}):(?P<dev>[0-9A-Fa-f]{2})(?:\.[0-9A-Fa-f])?", bus_id
    )
    if not m:
        return None
    return f"{m.group('domain')[-4:]}:{m.group('bus')}:{m.group('dev')}".lower()
