"""NVLink topology from ``nvidia-smi topo -m``, and the IMEX daemon's view of a multi-node NVLink domain.

Sources of the formats (see ``shared/reference/fabrics-facility.md`` §5 and pitfalls 9-12):

* ``nvidia-smi topo -m``: a header row of column names (``GPU0`` …, ``NIC0`` … or ``mlx5_0`` …,
  then the multi-word ``CPU Affinity``, ``NUMA Affinity`` and, on newer drivers, ``GPU NUMA ID``),
  one row per GPU and per NIC, a ``Legend:`` and (with NICs) a ``NIC Legend:`` mapping ``NIC0`` to
  ``mlx5_0``.  A cell is ``X`` (self), ``NV#`` (a bonded set of # NVLinks) or a PCIe path
  ``PIX`` < ``PXB`` < ``PHB`` < ``NODE`` < ``SYS``.  Real captures separate columns by TABs
  (empty affinity cells stay as empty TAB cells, and a row may carry one more empty cell than
  its header) or, where a document re-typed them, by runs of spaces; a pty capture wraps the
  header in ANSI underline codes (``ESC[4m`` … ``ESC[0m``).
* ``nvidia-smi topo -p2p r`` prints a matrix of the same shape whose cells are P2P statuses
  (``OK``, ``CNS``, ``GNS``, ``TNS``, ``NS``, ``U``).  It says nothing about link types, so
  :func:`parse_topo_matrix` returns an **empty** :class:`Topology` with a warning for it (never
  GPUs without links, which would read as "no NVLink").
* ``nvidia-imex-ctl -q``: one word (``READY`` …); ``-s`` (subscribe) glues the word to debug text
  (``READY stopAtReady: 0``) and prints it again at the end.
* ``nvidia-imex-ctl -N``: a connectivity legend (``C - Connected …``; the upstream text has the
  typo "triggreed" and newer drivers add ``!V!`` / ``!M!`` rows), a timestamp, ``Node #k - <ip> -
  <state>[ - Version: 570.172]`` lines, a ``Nodes From\\To`` matrix of one mark per pair and
  ``Domain State: UP|DOWN|DEGRADED``; ``Failed to read node configuration file`` when the daemon
  has no node list.  ``-N -j`` is JSON with a top-level ``"status"`` and ``"nodes"`` keyed by
  node index (``status``, ``host``, ``version``, ``connections``).

Nothing here raises: what cannot be read is None (unknown is not zero) and, where it should have
been there, a sentence in ``warnings`` says why.  Only :func:`imex_channels` touches the file
system, under the root directory it is given.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from agent.probes.jsontext import read_json

__all__ = [
    "IMEX_STATES",
    "PCIE_PATHS",
    "ImexDomain",
    "ImexNode",
    "TopoGpu",
    "Topology",
    "imex_channels",
    "nvlink_groups",
    "parse_imex_nodes",
    "parse_imex_state",
    "parse_topo_matrix",
    "zero_cluster_uuid",
]

#: ``nvidia-imex-ctl -q`` answers (DCGM ``DcgmImexManager.cpp``), in the daemon's order.
IMEX_STATES = (
    "INITIALIZING",
    "STARTING_AUTH_SERVER",
    "WAITING_FOR_PEERS",
    "WAITING_FOR_RECOVERY",
    "INIT_GPU",
    "READY",
    "SHUTTING_DOWN",
    "UNAVAILABLE",
)
#: PCIe path tokens of ``topo -m``, nearest first.
PCIE_PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")
_PATH_RANK = {token: rank for rank, token in enumerate(PCIE_PATHS)}
#: ``topo -p2p`` cell values: they describe P2P support, not the path.
_P2P_TOKENS = frozenset({"OK", "CNS", "GNS", "TNS", "NS", "U"})

# CSI escape sequences (``ESC[4m``), then any other control character but TAB.
_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]?")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
_HEADER_TOKEN_RE = re.compile(r"CPU\s+Affinity|NUMA\s+Affinity|GPU\s+NUMA\s+ID|\S+", re.IGNORECASE)
_GPU_RE = re.compile(r"GPU([0-9]{1,4})", re.ASCII)
_NV_RE = re.compile(r"NV([0-9]{1,3})", re.ASCII)
_CELL_RE = re.compile(r"[A-Z][A-Z0-9#]{0,7}", re.ASCII)
_NIC_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,63}", re.ASCII)
_NIC_LEGEND_RE = re.compile(r"^\s*(NIC[0-9]{1,4})\s*:\s*(\S{1,64})\s*$", re.ASCII)
_CPU_LIST_RE = re.compile(r"[0-9]{1,6}(?:-[0-9]{1,6})?(?:,[0-9]{1,6}(?:-[0-9]{1,6})?){0,255}", re.ASCII)
_NUMA_RE = re.compile(r"[0-9]{1,4}", re.ASCII)
_UNKNOWN_CELLS = frozenset({"", "N/A", "NA"})
_AFFINITY = {"cpu affinity": "cpu", "numa affinity": "numa", "gpu numa id": "gpu_numa"}
_MAX_WARNINGS = 50


def _clean_line(line: str) -> str:
    """The line without ANSI escapes and control characters (TABs kept)."""
    return _CONTROL_RE.sub("", _ANSI_RE.sub("", line))


def _short(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class _Warnings(list[str]):
    """A warnings list that stops growing (with one last sentence) on hopeless input."""

    def add(self, sentence: str) -> None:
        if len(self) < _MAX_WARNINGS:
            self.append(sentence)
        elif len(self) == _MAX_WARNINGS:
            self.append("further warnings left out")


# --------------------------------------------------------------------------- topo -m


@dataclass
class TopoGpu:
    """One GPU row of ``nvidia-smi topo -m``."""

    index: int
    #: Peer GPU index -> the matrix token (``"NV12"``, ``"SYS"``, ``"PIX"``); self (``X``) left out.
    paths: dict[int, str] = field(default_factory=dict)
    #: Peer GPU index -> bonded NVLink count, only for ``NV#`` cells (``NV12`` -> 12).
    links: dict[int, int] = field(default_factory=dict)
    #: NIC name -> token; the name from the ``NIC Legend`` (``NIC0: mlx5_0`` -> ``mlx5_0``), else
    #: the column header.
    nics: dict[str, str] = field(default_factory=dict)
    #: The NICs with the closest path (PIX < PXB < PHB < NODE < SYS), in column order; [] when the
    #: GPU has no NIC cells or the best is SYS (across the CPU interconnect: no NIC is "near").
    nearest_nics: list[str] = field(default_factory=list)
    #: That best token; None when ``nearest_nics`` is [].
    nearest_path: str | None = None
    #: ``NUMA Affinity``; None for ``N/A`` or an empty cell.
    numa_node: int | None = None
    #: ``CPU Affinity`` as printed (``"48-63,176-191"``); None for ``N/A`` or an empty cell.
    cpu_affinity: str | None = None


@dataclass
class Topology:
    """What one ``nvidia-smi topo -m`` said: GPU rows in output order and NIC names in column order."""

    gpus: list[TopoGpu] = field(default_factory=list)
    nics: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


@dataclass
class _Column:
    kind: str  # "gpu", "nic", "cpu", "numa", "gpu_numa"
    name: str  # the header text; for NICs the legend's name
    gpu: int | None = None


def _nic_legend(lines: list[str]) -> dict[str, str]:
    legend: dict[str, str] = {}
    for line in lines:
        m = _NIC_LEGEND_RE.match(line)
        if m:
            legend.setdefault(m.group(1), m.group(2))
    return legend


def _is_cell_token(token: str) -> bool:
    return token == "X" or token in _PATH_RANK or token in _P2P_TOKENS or _NV_RE.fullmatch(token) is not None


def _header_columns(line: str, legend: dict[str, str]) -> list[_Column] | None:
    """The columns of a header line, or None when the line is not a header (a row has cells)."""
    tokens = _HEADER_TOKEN_RE.findall(line)
    if not any(_GPU_RE.fullmatch(t) for t in tokens):
        return None
    if any(_is_cell_token(t) for t in tokens):
        return None
    columns: list[_Column] = []
    for token in tokens:
        gpu = _GPU_RE.fullmatch(token)
        affinity = _AFFINITY.get(" ".join(token.lower().split()))
        if gpu:
            columns.append(_Column("gpu", token, int(gpu.group(1))))
        elif affinity:
            columns.append(_Column(affinity, token))
        elif _NIC_NAME_RE.fullmatch(token):
            columns.append(_Column("nic", legend.get(token, token)))
        else:
            return None  # not a header after all
    return columns


def _row_cells(line: str) -> tuple[str, list[str], bool]:
    """(row label, the cells after it, whether TABs separated them: then empty cells are kept)."""
    if "\t" in line:
        cells = [cell.strip() for cell in line.split("\t")]
        while cells and not cells[0]:
            cells.pop(0)
        if cells:
            label, *values = cells
            # A label cell can still hold the first cell when spaces, not a TAB, followed the label.
            head = label.split()
            if len(head) > 1:
                return head[0], [*head[1:], *values], True
            return label, values, True
        return "", [], True
    tokens = line.split()
    return (tokens[0], tokens[1:], False) if tokens else ("", [], False)


def _affinity(gpu: TopoGpu, columns: list[_Column], values: list[str], warnings: _Warnings, where: str) -> None:
    for column, raw in zip(columns, values, strict=False):
        value = raw.strip()
        if value.upper() in _UNKNOWN_CELLS:
            continue
        if column.kind == "cpu":
            if _CPU_LIST_RE.fullmatch(value):
                gpu.cpu_affinity = value
            else:
                warnings.add(f"{where}: CPU Affinity {_short(value)} is not a CPU list")
        elif column.kind == "numa":
            if _NUMA_RE.fullmatch(value):
                gpu.numa_node = int(value)
            else:
                warnings.add(f"{where}: NUMA Affinity {_short(value)} is not a node number")


def _nearest(gpu: TopoGpu) -> None:
    ranked = [(name, _PATH_RANK[token]) for name, token in gpu.nics.items() if token in _PATH_RANK]
    if not ranked:
        return
    best = min(rank for _, rank in ranked)
    if PCIE_PATHS[best] == "SYS":
        return
    gpu.nearest_path = PCIE_PATHS[best]
    gpu.nearest_nics = [name for name, rank in ranked if rank == best]


def parse_topo_matrix(text: str) -> Topology:
    """Parse ``nvidia-smi topo -m``: per GPU its path to every other GPU and NIC, NVLink counts,
    the nearest NICs and the CPU / NUMA affinity.

    Columns are found by their header, not by position on the line, so TAB-separated, re-aligned
    and ANSI-wrapped headers read the same.  Device cells (``X``, ``NV#``, PCIe paths) are never
    empty; the affinity cells after them are taken in header order (TAB-separated output keeps
    empty cells; space-separated output cannot show one).  ``topo -p2p`` output gives an empty
    :class:`Topology` and a warning.
    """
    topology = Topology()
    warnings = _Warnings()
    lines = [_clean_line(line) for line in (text or "").lstrip("\ufeff").splitlines()]
    legend = _nic_legend(lines)
    columns, start = _find_header(lines, legend)
    if columns is None:
        topology.warnings = [*warnings, "no `nvidia-smi topo -m` header line (GPU0 GPU1 ... CPU Affinity) found"]
        return topology

    devices = [c for c in columns if c.kind in ("gpu", "nic")]
    trailing = [c for c in columns if c.kind not in ("gpu", "nic")]
    nic_labels = {c.name for c in devices if c.kind == "nic"}
    nic_labels |= {label for label, name in legend.items() if name in nic_labels}
    topology.nics = [c.name for c in devices if c.kind == "nic"]
    seen: set[int] = set()
    cell_tokens: set[str] = set()

    for line in lines[start:]:
        stripped = line.strip()
        if not stripped:
            continue
        lowered = stripped.lower()
        if lowered.endswith("legend:") or lowered.startswith("legend"):
            break
        label, values, tabbed = _row_cells(line)
        gpu_match = _GPU_RE.fullmatch(label)
        if gpu_match is None:
            if label not in nic_labels and not re.fullmatch(r"NIC[0-9]{1,4}", label):
                warnings.add(f"line {_short(stripped)} is not a GPU or NIC row")
            continue
        index = int(gpu_match.group(1))
        if index in seen:
            warnings.add(f"row {label} appears more than once; the first is kept")
            continue
        gpu = _gpu_row(index, f"row {label}", values, tabbed, devices, trailing, warnings, cell_tokens)
        seen.add(index)
        topology.gpus.append(gpu)

    if _is_p2p_matrix(lines, cell_tokens):
        topology.gpus = []
        topology.nics = []
        topology.warnings = [
            "this is `nvidia-smi topo -p2p` output (P2P status such as OK/CNS), not `topo -m`: "
            "it names no link types, so no topology was read"
        ]
        return topology
    unknown = sorted(t for t in cell_tokens if t not in _PATH_RANK and t != "X" and not _NV_RE.fullmatch(t))
    if unknown:
        warnings.add(f"unknown path tokens {', '.join(unknown[:10])}")
    if not topology.gpus:
        warnings.add("no GPU rows under the header")
    topology.warnings = list(warnings)
    return topology


def _find_header(lines: list[str], legend: dict[str, str]) -> tuple[list[_Column] | None, int]:
    """The header's columns and the number of the line after it; None where no header comes
    before the legend."""
    for number, line in enumerate(lines):
        if line.strip().lower().startswith("legend"):
            break
        columns = _header_columns(line, legend)
        if columns is not None:
            return columns, number + 1
    return None, 0


def _gpu_row(
    index: int,
    where: str,
    values: list[str],
    tabbed: bool,
    devices: list[_Column],
    trailing: list[_Column],
    warnings: _Warnings,
    cell_tokens: set[str],
) -> TopoGpu:
    """One GPU row from the cells after its label: the device cells, then the affinity cells.
    Adds every device token it read to ``cell_tokens``."""
    device_values = values[: len(devices)]
    if tabbed and any(not v for v in device_values):
        # An empty device cell shifts a TAB row: fall back to its words.
        warnings.add(f"{where} has an empty device cell; read by words instead")
        device_values = " ".join(values).split()[: len(devices)]
        values = " ".join(values).split()
    if len(device_values) < len(devices):
        warnings.add(f"{where} has {len(device_values)} of {len(devices)} device cells")
    gpu = TopoGpu(index=index)
    for column, raw in zip(devices, device_values, strict=False):
        token = raw.strip()
        if column.kind == "gpu" and column.gpu == index:
            if token != "X":
                warnings.add(f"{where}: its own column holds {_short(token)}, not X")
            continue
        if (column.gpu in gpu.paths) if column.kind == "gpu" else (column.name in gpu.nics):
            warnings.add(f"{where}: column {column.name} appears twice in the header; the first is kept")
            continue
        if token == "X":
            warnings.add(f"{where}, column {column.name}: X (self) outside its own column")
            continue
        if not _CELL_RE.fullmatch(token) or (token.startswith("NV") and not _NV_RE.fullmatch(token)):
            warnings.add(f"{where}, column {column.name}: unreadable cell {_short(token)}")
            continue
        cell_tokens.add(token)
        if column.kind == "gpu" and column.gpu is not None:
            gpu.paths[column.gpu] = token
            nv = _NV_RE.fullmatch(token)
            if nv:
                gpu.links[column.gpu] = int(nv.group(1))
        else:
            gpu.nics[column.name] = token
    _affinity(gpu, trailing, values[len(devices) :], warnings, where)
    _nearest(gpu)
    return gpu


def _is_p2p_matrix(lines: list[str], cell_tokens: set[str]) -> bool:
    """Whether the matrix is ``topo -p2p`` output: its legend, or P2P statuses and no link type."""
    p2p_legend = any(re.match(r"^\s*OK\s*=\s*Status Ok", line, re.IGNORECASE) for line in lines)
    known = {t for t in cell_tokens if t in _PATH_RANK or _NV_RE.fullmatch(t)}
    return p2p_legend or bool(not known and cell_tokens & _P2P_TOKENS)


def zero_cluster_uuid(uuid: str | None) -> bool:
    """A ClusterUUID of zeros (or none): a single machine's NVSwitch, no multi-node NVLink domain."""
    text = (uuid or "").strip()
    return text.upper() == "N/A" or not text.replace("-", "").strip("0")


def nvlink_groups(topology: Topology) -> dict[int, str]:
    """GPU index -> NVLink group id: connected components over NVLink edges (``links`` > 0, either
    side reporting it), named ``nvl<lowest GPU index in it>``; a GPU without an NVLink peer is its
    own group.  Only GPUs of ``topology.gpus`` are grouped: a link to a GPU without a row is
    ignored.  {} when there are no GPUs."""
    present = {gpu.index for gpu in topology.gpus}
    parent = {index: index for index in present}

    def find(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for gpu in topology.gpus:
        for peer, count in gpu.links.items():
            if count > 0 and peer in present and peer != gpu.index:
                a, b = find(gpu.index), find(peer)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return {index: f"nvl{find(index)}" for index in sorted(present)}


# --------------------------------------------------------------------------- IMEX


def parse_imex_state(text: str) -> str | None:
    """The daemon state from ``nvidia-imex-ctl -q`` (or ``-s``): the known state word that starts
    the last line starting with one (a line that is the word alone may be in any case; the
    canonical upper-case word is returned);
    failing that, the last line that is a single upper-case word, as printed; else None."""
    known: str | None = None
    other: str | None = None
    for raw in (text or "").lstrip("\ufeff").splitlines():
        words = _clean_line(raw).split()
        if not words:
            continue
        # Case is ignored only for a line that is the word alone ("ready"); "READY stopAtReady: 0"
        # (the subscribe output) must be upper case, so a sentence is not read as a state.
        first = words[0].upper() if len(words) == 1 else words[0]
        if first in IMEX_STATES:
            known = first
        elif len(words) == 1 and re.fullmatch(r"[A-Z][A-Z_]{1,40}", words[0]):
            other = words[0]
    return known or other


@dataclass
class ImexNode:
    """One ``Node #k - <address> - <state>`` line of ``nvidia-imex-ctl -N``."""

    index: int
    address: str
    #: ``READY`` or whatever the line says.
    state: str
    #: ``- Version: 570.172`` on newer drivers; None where not printed.
    version: str | None = None


@dataclass
class ImexDomain:
    """``nvidia-imex-ctl -N`` (text or ``-j`` JSON)."""

    nodes: list[ImexNode] = field(default_factory=list)
    #: ``UP``, ``DOWN``, ``DEGRADED``, another word as printed, or None when not printed.
    domain_state: str | None = None
    #: From-node -> to-node -> mark (``C``, ``N``, ``R``, ``D``, ``A``, ``I``, ``!V!``, ``!M!``).
    connectivity: dict[int, dict[int, str]] = field(default_factory=dict)
    #: False when the daemon says ``Failed to read node configuration file``.
    configured: bool = True
    warnings: list[str] = field(default_factory=list)


_NODE_RE = re.compile(r"^\s*Node\s*#\s*([0-9]{1,6})\s*-\s*(.*?)\s*$", re.IGNORECASE | re.ASCII)
_NODE_PARTS_RE = re.compile(r"\s+-\s+")
_VERSION_PART_RE = re.compile(r"^Version\s*:\s*(\S{1,40})", re.IGNORECASE)
_MATRIX_HEADER_RE = re.compile(r"^\s*Nodes\s+From\s*\\\s*To\b(.*)$", re.IGNORECASE)
_MATRIX_ROW_RE = re.compile(r"^\s*([0-9]{1,6})\s+(\S.*?)\s*$", re.ASCII)
_MARK_RE = re.compile(r"[A-Z?!]{1,4}", re.ASCII)
_DOMAIN_RE = re.compile(r"^\s*Domain\s+State\s*:\s*(\S{1,40})", re.IGNORECASE)
_LEGEND_RE = re.compile(r"^\s*!?[A-Z]!?\s+-\s+")
_NOT_CONFIGURED = "failed to read node configuration file"
#: ``connections`` statuses of ``-N -j`` -> the marks of the text matrix.
_CONNECTION_MARKS = {
    "CONNECTED": "C",
    "NEVER_CONNECTED": "N",
    "NEVERCONNECTED": "N",
    "RECOVERING": "R",
    "DISCONNECTED": "D",
    "AUTHENTICATING": "A",
    "INVALID": "I",
    "VERSION_MISMATCH": "!V!",
    "NODE_MAP_MISMATCH": "!M!",
}


def _index(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,6}", value.strip()):
        return int(value.strip())
    return None


def _text(value: Any) -> str | None:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        shown = " ".join(str(value).split())
        return shown[:200] or None
    return None


def _json_node(key: Any, entry: Any, position: int, domain: ImexDomain) -> None:
    if not isinstance(entry, dict):
        domain.warnings.append(f"JSON node {_short(str(key))} is not an object")
        return
    index = _index(key)
    if index is None:
        index = next((i for i in (_index(entry.get(k)) for k in ("index", "id", "node")) if i is not None), position)
    address = next(
        (a for a in (_text(entry.get(k)) for k in ("host", "ip", "address", "hostName", "hostname")) if a), "unknown"
    )
    state = next((s for s in (_text(entry.get(k)) for k in ("status", "state")) if s), "UNKNOWN")
    domain.nodes.append(ImexNode(index, address, state, _text(entry.get("version"))))
    connections = entry.get("connections")
    if isinstance(connections, dict):
        row = domain.connectivity.setdefault(index, {})
        for peer_key, link in connections.items():
            peer = _index(peer_key)
            status = _text(link.get("status")) if isinstance(link, dict) else _text(link)
            if peer is None or status is None:
                continue
            word = status.upper().replace(" ", "_")
            row[peer] = _CONNECTION_MARKS.get(word, status)


def _parse_imex_json(data: Any, domain: ImexDomain) -> None:
    if not isinstance(data, dict):
        domain.warnings.append(f"nvidia-imex-ctl -N -j gave a JSON {type(data).__name__}, not an object")
        return
    status = _text(data.get("status"))
    domain.domain_state = status.upper() if status else None
    if status is None:
        domain.warnings.append('no top-level "status" in the JSON')
    nodes = data.get("nodes")
    if isinstance(nodes, dict):
        for position, (key, entry) in enumerate(nodes.items()):
            _json_node(key, entry, position, domain)
    elif isinstance(nodes, list):
        for position, entry in enumerate(nodes):
            _json_node(None, entry, position, domain)
    elif nodes is not None:
        domain.warnings.append('"nodes" in the JSON is neither an object nor a list')
    domain.nodes.sort(key=lambda node: node.index)


def _node_line(index: int, rest: str) -> ImexNode | None:
    parts = [p for p in _NODE_PARTS_RE.split(rest) if p]
    if len(parts) < 2:
        # "10.0.0.1-READY" without spaces: the state is the last dash-separated word.
        m = re.fullmatch(r"(\S+?)\s*-\s*([A-Za-z_]+)", rest)
        if not m:
            return None
        parts = [m.group(1), m.group(2)]
    address, state = parts[0].strip(), parts[1].strip()
    if not address or not state:
        return None
    version = None
    for part in parts[2:]:
        v = _VERSION_PART_RE.match(part.strip())
        if v:
            version = v.group(1)
    return ImexNode(index, address, state, version)


def _parse_imex_text(lines: list[str], domain: ImexDomain) -> None:
    columns: list[int] | None = None
    seen: set[int] = set()
    for raw in lines:
        line = _clean_line(raw)
        if not line.strip():
            continue
        domain_state = _DOMAIN_RE.match(line)
        if domain_state:
            domain.domain_state = domain_state.group(1).upper()
            columns = None
            continue
        node = _NODE_RE.match(line)
        if node:
            parsed = _node_line(int(node.group(1)), node.group(2))
            if parsed is None:
                domain.warnings.append(f"unreadable node line {_short(line.strip())}")
            elif parsed.index in seen:
                domain.warnings.append(f"node #{parsed.index} is listed more than once; the first is kept")
            else:
                seen.add(parsed.index)
                domain.nodes.append(parsed)
            continue
        if _LEGEND_RE.match(line):
            continue  # "C - Connected - Ready for operation", "!V! - Version mismatch ..."
        header = _MATRIX_HEADER_RE.match(line)
        if header:
            found = [_index(t) for t in header.group(1).split()]
            columns = [i for i in found if i is not None]
            if len(columns) != len(found):
                domain.warnings.append(f"unreadable matrix header {_short(line.strip())}")
            continue
        row = _MATRIX_ROW_RE.match(line) if columns is not None else None
        if row and columns is not None:
            marks = row.group(2).split()
            if not all(_MARK_RE.fullmatch(m) for m in marks):
                domain.warnings.append(f"unreadable matrix row {_short(line.strip())}")
                continue
            if len(marks) != len(columns):
                domain.warnings.append(f"matrix row {row.group(1)} has {len(marks)} marks for {len(columns)} nodes")
            source = int(row.group(1))
            if source in domain.connectivity:
                domain.warnings.append(f"matrix row {source} appears more than once; the first is kept")
                continue
            domain.connectivity[source] = dict(zip(columns, marks, strict=False))
            continue
        columns = None  # anything else ends the matrix


def parse_imex_nodes(text: str) -> ImexDomain:
    """Parse ``nvidia-imex-ctl -N`` (text) or ``-N -j`` (JSON): the nodes and their states, the
    connectivity matrix, the domain state and whether the daemon has a node list at all."""
    domain = ImexDomain()
    body = (text or "").lstrip("\ufeff")
    if _NOT_CONFIGURED in body.lower():
        domain.configured = False
    stripped = body.strip()
    if stripped.startswith("{"):
        data, _notes = read_json(stripped)
        if data is None:
            end = stripped.rfind("}")
            data = read_json(stripped[: end + 1])[0] if end > 0 else None
        if data is not None:
            _parse_imex_json(data, domain)
            return domain
        domain.warnings.append("output starts like JSON but is not valid JSON; read as text")
    _parse_imex_text(body.splitlines(), domain)
    if domain.configured and not domain.nodes and domain.domain_state is None:
        domain.warnings.append("no IMEX nodes and no Domain State in the output")
    return domain


def imex_channels(root: str) -> list[int] | None:
    """The IMEX channel numbers under ``<root>/dev/nvidia-caps-imex-channels`` (entries named
    ``channel<N>``), sorted; None when the directory does not exist or cannot be listed, [] when
    it holds no channel."""
    directory = os.path.join(root or "/", "dev", "nvidia-caps-imex-channels")
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    found = {int(m.group(1)) for m in (re.fullmatch(r"channel([0-9]{1,9})", name) for name in names) if m}
    return sorted(found)
