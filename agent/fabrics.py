"""The node's InfiniBand and RoCE ports as they are, every heartbeat, and the fabrics they carry.

Every heartbeat re-reads each port from sysfs (state, physical state, rate, counters). Once a
minute each active InfiniBand port is asked which master subnet manager it sees (`sminfo`),
one port per master lists every subnet manager of its fabric (`saquery SMIR`), and the RoCE
ports' IP networks are read (`ip -j addr`). What a node can carry traffic on — per declared
fabric name, the ports that are up and the fabric each is physically on — is sent to the
control plane in a "fabrics" message only when it changes, and at most once per
CHANGE_INTERVAL_S: a port flapping every heartbeat changes the node's fabrics once per
interval, and its flaps are counted and said.

agent.yaml declares the fabrics by name and the adapters (or netdevs) on each:

    fabrics:
      - {name: ib-a, hcas: [mlx5_0, mlx5_1]}
      - {name: roce, netdevs: [ens1f0np0]}

A declared fabric without `hcas` or `netdevs` takes every InfiniBand port. Ports on no declared
fabric are still reported (the cluster page says an adapter is up but undeclared).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.probes import infiniband
from agent.probes.sysfs import SysfsReader
from agent.runner import CommandRunner

__all__ = ["CHANGE_INTERVAL_S", "FabricWatcher"]

log = logging.getLogger("llmgw.agent")

CHANGE_INTERVAL_S = 30.0
SLOW_INTERVAL_S = 60.0
COUNTERS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_xmit_discards",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
)


def _port_key(port: infiniband.IbPort) -> str:
    return f"{port.device}/{port.port}"


class FabricWatcher:
    def __init__(
        self,
        root: str,
        fabrics: list[dict[str, Any]],
        runner: CommandRunner,
        clock: Callable[[], float] = time.monotonic,
        *,
        check_interval: float = SLOW_INTERVAL_S,
        change_interval: float = CHANGE_INTERVAL_S,
    ) -> None:
        self.check_interval = check_interval
        self.change_interval = change_interval
        self.reader = SysfsReader(root)
        self.fabrics = fabrics
        self.runner = runner
        self.clock = clock
        self._slow_at: float | None = None
        self._masters: dict[str, str | None] = {}  # port -> master SM GUID it sees; None: asked, no answer
        self._managers: list[dict[str, Any]] = []
        self._networks: dict[str, list[tuple[str, int]]] = {}
        self._up: dict[str, bool] = {}
        self.flaps: dict[str, int] = {}
        self._sent: Any = None
        self._sent_at: float | None = None
        self._last: tuple[Any, dict[str, Any]] | None = None
        self._changed = False
        self.sminfo_missing = False
        self._install_tried = False

    def present(self) -> bool:
        return bool(self.reader.listdir("sys/class/infiniband"))

    async def sample(self, warnings: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The ports and the subnet managers, for the heartbeat; also works out whether the
        fabrics changed (see `due`)."""
        if not self.present():
            return [], []
        report = infiniband.read_ports(self.reader)
        warnings += [f"infiniband: {w}" for w in report.warnings[:20]]
        now = self.clock()
        if self._slow_at is None or now - self._slow_at >= self.check_interval:
            self._slow_at = now
            await self._slow(report.ports, warnings)
        for port in report.ports:
            key = _port_key(port)
            up = infiniband.port_is_up(port)
            if key in self._up and self._up[key] != up:
                self.flaps[key] = self.flaps.get(key, 0) + 1
            self._up[key] = up
        ports = [self._port_dict(p) for p in report.ports]
        self._note(ports)
        return ports, list(self._managers)

    async def _slow(self, ports: list[infiniband.IbPort], warnings: list[str]) -> None:
        masters: dict[str, str | None] = {}
        for port in ports:
            if port.link_layer != "InfiniBand" or not infiniband.port_is_up(port) or self.sminfo_missing:
                continue
            result = await self.runner.run("sminfo", "-C", port.device, "-P", str(port.port), timeout=10)
            if result.returncode is None and ("No such file" in result.stderr or "not found" in result.stderr):
                if await self._install_diags(warnings):
                    result = await self.runner.run("sminfo", "-C", port.device, "-P", str(port.port), timeout=10)
                else:
                    self.sminfo_missing = True
                    break
            info = infiniband.parse_sminfo(result.stdout + "\n" + result.stderr)
            masters[_port_key(port)] = info.guid if info is not None and info.error is None else None
            if info is not None:
                warnings += [f"sminfo on {_port_key(port)}: {w}" for w in info.warnings[:5]]
        self._masters = masters
        managers = []
        asked: set[str] = set()
        for port in ports:
            master = masters.get(_port_key(port))
            if not master or master in asked:
                continue
            asked.add(master)
            result = await self.runner.run("saquery", "-C", port.device, "-P", str(port.port), "SMIR", timeout=10)
            records = infiniband.parse_saquery_smir(result.stdout) if result.ok else []
            managers.append(
                {
                    "via": _port_key(port),
                    "master": master,
                    "managers": [
                        {
                            "guid": r.guid,
                            "lid": r.lid,
                            "priority": r.priority,
                            "state": r.state,
                            "act_count": r.act_count,
                        }
                        for r in records
                    ],
                }
            )
        self._managers = managers
        # The node's interfaces and their addresses: the RoCE ports' networks, and the netdev NCCL is
        # to bootstrap over (the one holding the address the control plane knows the node by).
        result = await self.runner.run("ip", "-j", "addr", "show", timeout=10)
        self._networks = infiniband.parse_ip_addr_json(result.stdout) if result.ok else {}

    async def _install_diags(self, warnings: list[str]) -> bool:
        """infiniband-diags (sminfo, saquery, ibnetdiscover), installed once when missing."""
        if self._install_tried:
            return False
        self._install_tried = True
        log.info("sminfo is missing on a node with InfiniBand adapters: installing infiniband-diags")
        result = await self.runner.run(
            "apt-get", "install", "-y", "--no-install-recommends", "infiniband-diags", timeout=600
        )
        if result.ok:
            return True
        why = (result.stderr.strip() or result.stdout.strip() or "apt-get is not available")[-300:]
        warnings.append(
            f"sminfo is not installed and installing infiniband-diags failed ({why}): "
            "the fabric of each port cannot be checked"
        )
        return False

    def _port_dict(self, port: infiniband.IbPort) -> dict[str, Any]:
        key = _port_key(port)
        network = infiniband.roce_port_network(port, self._networks) if port.link_layer == "Ethernet" else None
        data: dict[str, Any] = {
            "device": port.device,
            "port": port.port,
            "fabric": self.declared(port),
            "link_layer": port.link_layer,
            "state": port.state,
            "state_name": port.state_name,
            "phys_state": port.phys_state,
            "phys_state_name": port.phys_state_name,
            "up": infiniband.port_is_up(port),
            "rate_gbps": port.rate_gbps,
            "lid": port.lid,
            "sm_lid": port.sm_lid,
            "node_guid": port.node_guid,
            "port_guid": port.port_guid,
            "sm_guid": self._masters.get(key),
            "netdev": port.netdev,
            "roce_ip": port.roce_ip,
            "roce_gid_index": port.roce_gid_index,
            "network": network,
            "xmit_bytes": port.xmit_bytes,
            "rcv_bytes": port.rcv_bytes,
            "errors": {name: port.counters[name] for name in COUNTERS if name in port.counters},
            "flaps": self.flaps.get(key, 0),
        }
        return {k: v for k, v in data.items() if v is not None}

    def declared(self, port: infiniband.IbPort) -> str:
        """The declared fabric the port is on, or "" when it is on none."""
        for fabric in self.fabrics:
            hcas = fabric.get("hcas")
            netdevs = fabric.get("netdevs")
            if hcas and port.device in hcas:
                return str(fabric["name"])
            if netdevs and port.netdev in netdevs:
                return str(fabric["name"])
            if not hcas and not netdevs and port.link_layer == "InfiniBand":
                return str(fabric["name"])
        return ""

    def _note(self, ports: list[dict[str, Any]]) -> None:
        """Compare what the ports carry with what was last said; keep a change for `due`."""
        carried = sorted(
            (p["fabric"], p["device"], p["port"], p.get("sm_guid") or "", p.get("network") or "")
            for p in ports
            if p["up"]
        )
        self._last = (
            carried,
            {
                "ports": [
                    {k: p[k] for k in ("device", "port", "fabric", "link_layer", "up", "state", "phys_state") if k in p}
                    | {k: p[k] for k in ("port_guid", "sm_guid", "network", "rate_gbps", "netdev") if k in p}
                    for p in ports
                ],
                "declared": [str(f["name"]) for f in self.fabrics],
                "flaps": dict(self.flaps),
                "interfaces": {
                    name: list(dict.fromkeys(ip for ip, _prefix in addresses))[:16]
                    for name, addresses in sorted(self._networks.items())
                },
            },
        )
        self._changed = carried != self._sent

    def due(self) -> dict[str, Any] | None:
        """The body of a "fabrics" message when what the node carries changed and the last one is
        at least CHANGE_INTERVAL_S old; None otherwise."""
        if not self._changed:
            return None
        now = self.clock()
        if self._sent_at is not None and now - self._sent_at < self.change_interval:
            return None
        return self.snapshot()

    def snapshot(self) -> dict[str, Any] | None:
        """What the node carries now (for its registration, and for `due`), marked as said."""
        if self._last is None:
            return None
        carried, body = self._last
        self._sent, self._sent_at, self._changed = carried, self.clock(), False
        return dict(body)
