"""What other apps add to the cluster app, in one place.

The cluster app sits below the feature apps (fabrics, facility, mirror) and the gateway: it never
imports them (an import-linter contract in pyproject.toml holds it to that). What it needs from
them they register here from their AppConfig.ready(), and the cluster app asks the registry:

- placement's snapshot and a shard's environment: the fabrics, NVLink domain and location of each
  node (`add_snapshot_part`), what NCCL needs on a node (`add_shard_env`);
- the gateway's queue depths (`queue_depths`) and the NVLink domain a node's cards name at
  registration (`nvlink_domain`);
- where a node is, as the facility app names the levels (`locations`), and the nodes that a domain
  held with drain empties (`drain_holds`);
- what the nodes fetch from the mirror (`mirror_fetches`), sent in their desired state;
- parts of the node page, of the cluster page and of a model's page, each under the name its
  template reads (`add_node_panel`, `add_cluster_panel`, `add_model_panel`: the mirror's LoRA
  adapters);
- what a node reports for another app, at registration under the report's name or later as a
  message of that type (`add_node_report`: the fabrics' ports);
- what to do with an agent's answer to a request of a kind (`add_request_handler`: the fabrics app
  reads an ibnetdiscover map).

A slot nobody filled answers as "unknown" (None, an empty mapping or list, a part left out of a
page), never as zero, so the cluster app runs on its own in tests that leave an app out.

    from apps.cluster.extensions import EXTENSIONS

    EXTENSIONS.add_snapshot_part(services.contribute_snapshots)      # in FabricsConfig.ready()
    EXTENSIONS.queue_depths = gateway_queue_depths                   # in GatewayConfig.ready()

Registering is idempotent: ready() may run more than once in a test process. Register module-level
functions, not lambdas, so that a second ready() finds the same function already there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from apps.catalog.models import Model
    from apps.cluster.models import AgentRequest, Node
    from apps.cluster.placement import NodeSnapshot

__all__ = [
    "EXTENSIONS",
    "ClusterPanel",
    "DrainHolds",
    "Extensions",
    "Locations",
    "MirrorFetches",
    "ModelPanel",
    "NodePanel",
    "NodeReport",
    "NvlinkDomain",
    "QueueDepths",
    "RequestHandler",
    "ShardEnv",
    "SnapshotPart",
]

# Fills `extra` of placement's node snapshots (the fabrics, domain and location of each node),
# given the snapshots and the Node rows they were built from. Each part writes through the
# placement.SnapshotField its app declares with the part's TypedDict (apps.fabrics.placement FABRICS
# and NVLINK, apps.facility.placement FACILITY), so that mypy holds it to the shape the app's
# placement rules read.
SnapshotPart = Callable[[dict[int, "NodeSnapshot"], dict[int, "Node"]], None]
# What an app adds to a shard's environment on its node, given the group its replica was formed in.
ShardEnv = Callable[[int, tuple[str, ...] | None], dict[str, str]]
# Requests waiting in the gateway for each model name; None where not known.
QueueDepths = Callable[[set[str]], dict[str, int | None]]
# The multi-node NVLink domain a node's cards name at registration, None when they name none.
NvlinkDomain = Callable[[Iterable[dict[str, Any]]], str | None]
# The nodes in a domain held with drain (a rack, a PDU...): their replicas move out as from a
# drained node, never forced.
DrainHolds = Callable[[], list["Node"]]
# What the nodes should fetch from the mirror: the "mirror" part of their desired state.
MirrorFetches = Callable[[], list[dict[str, Any]]]
# A part of a node's page: what its template reads under the part's name (falsy: nothing to show).
NodePanel = Callable[["Node"], Any]
# A part of the cluster page, the same way.
ClusterPanel = Callable[[], Any]
# A part of a model's page, the same way, given the model and whether the person may change it.
ModelPanel = Callable[["Model", bool], Any]
# Records what a node reports for an app (the node's id and the report's body).
NodeReport = Callable[[int, dict[str, Any]], object]
# What to do with an agent's answer of a kind (the row and its result): what the row keeps of it;
# an exception marks the row failed.
RequestHandler = Callable[["AgentRequest", Any], Any]


@dataclass(frozen=True)
class Locations:
    """Where nodes are, as the facility app names it: its levels from the widest to the narrowest
    (site ... pdu), the node label that keeps each level, and a node's value at each (None: not
    said)."""

    levels: tuple[str, ...]
    label_of: Callable[[str], str]
    of_node: Callable[[Node], dict[str, str | None]]


@dataclass
class Extensions:
    snapshot_parts: list[SnapshotPart] = field(default_factory=list)
    shard_env_parts: list[ShardEnv] = field(default_factory=list)
    queue_depths: QueueDepths | None = None
    nvlink_domain: NvlinkDomain | None = None
    locations: Locations | None = None
    drain_holds: DrainHolds | None = None
    mirror_fetches: MirrorFetches | None = None
    node_panels: dict[str, NodePanel] = field(default_factory=dict)
    cluster_panels: dict[str, ClusterPanel] = field(default_factory=dict)
    model_panels: dict[str, ModelPanel] = field(default_factory=dict)
    node_reports: dict[str, NodeReport] = field(default_factory=dict)
    request_handlers: dict[str, RequestHandler] = field(default_factory=dict)

    # Registering --------------------------------------------------------------------------------

    def add_snapshot_part(self, part: SnapshotPart) -> None:
        if part not in self.snapshot_parts:
            self.snapshot_parts.append(part)

    def add_shard_env(self, part: ShardEnv) -> None:
        if part not in self.shard_env_parts:
            self.shard_env_parts.append(part)

    def add_node_panel(self, name: str, panel: NodePanel) -> None:
        self.node_panels[name] = panel

    def add_cluster_panel(self, name: str, panel: ClusterPanel) -> None:
        self.cluster_panels[name] = panel

    def add_model_panel(self, name: str, panel: ModelPanel) -> None:
        self.model_panels[name] = panel

    def add_node_report(self, kind: str, record: NodeReport) -> None:
        self.node_reports[kind] = record

    def add_request_handler(self, kind: str, handler: RequestHandler) -> None:
        self.request_handlers[kind] = handler

    # Asking -------------------------------------------------------------------------------------

    def snapshot(self, snapshots: dict[int, NodeSnapshot], rows: dict[int, Node]) -> None:
        """Every registered part fills its share of the snapshots' `extra`."""
        for part in self.snapshot_parts:
            part(snapshots, rows)

    def shard_env(self, node_id: int, group: tuple[str, ...] | None) -> dict[str, str]:
        env: dict[str, str] = {}
        for part in self.shard_env_parts:
            env.update(part(node_id, group))
        return env

    def waiting(self, names: set[str]) -> dict[str, int | None]:
        """Requests waiting for each model; None for every name when no gateway registered."""
        if self.queue_depths is None:
            return dict.fromkeys(names)
        return self.queue_depths(names)

    def registered_domain(self, gpus: Iterable[dict[str, Any]]) -> str | None:
        return self.nvlink_domain(gpus) if self.nvlink_domain is not None else None

    def node_location(self, node: Node) -> dict[str, str | None]:
        """Each level -> the node's value there (None: not said); {} when no app names the levels."""
        return self.locations.of_node(node) if self.locations is not None else {}

    def location_labels(self) -> list[tuple[str, str]]:
        """Each level of a location with the node label that keeps it; [] when no app names them."""
        if self.locations is None:
            return []
        return [(level, self.locations.label_of(level)) for level in self.locations.levels]

    def held_draining(self) -> list[Node]:
        """The nodes a domain held with drain empties; [] when no app holds domains."""
        return self.drain_holds() if self.drain_holds is not None else []

    def node_fetches(self) -> list[dict[str, Any]] | None:
        """What the nodes should fetch from the mirror; None when no app keeps one (the desired state
        then leaves "mirror" out and the agent goes on with the list it had)."""
        return self.mirror_fetches() if self.mirror_fetches is not None else None

    def node_page(self, node: Node) -> dict[str, Any]:
        """The other apps' parts of a node's page, by the names its template reads."""
        return {name: panel(node) for name, panel in self.node_panels.items()}

    def cluster_page(self) -> dict[str, Any]:
        """The other apps' parts of the cluster page, by the names its template reads."""
        return {name: panel() for name, panel in self.cluster_panels.items()}

    def model_page(self, model: Model, can_change: bool) -> dict[str, Any]:
        """The other apps' parts of a model's page, by the names its template reads."""
        return {name: panel(model, can_change) for name, panel in self.model_panels.items()}

    def record_report(self, kind: str, node_id: int, body: dict[str, Any]) -> bool:
        """Hand what a node reported to the app that reads it; False when no app does."""
        record = self.node_reports.get(kind)
        if record is None:
            return False
        record(node_id, body)
        return True

    def request_handler(self, kind: str) -> RequestHandler | None:
        return self.request_handlers.get(kind)


EXTENSIONS = Extensions()
