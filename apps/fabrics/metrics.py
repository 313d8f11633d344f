"""Prometheus figures for the InfiniBand and RoCE ports and the fabrics, read at scrape time.

A port the node's last sample (if fresh) does not list is absent; so is a figure it did not read.
"""

from __future__ import annotations

from collections import Counter

from apps.cluster.metrics import NUMBERS, scrape_nodes
from llmgw.metrics import Exposition, escape_label, label_text, number_text

__all__ = ["FabricCollector"]

# The families, each (metric, help).
PORT_ACTIVE = (
    "llmgw_ib_port_active",
    "1 when the port is ACTIVE with its link up; state and phys_state tell an unplugged cable "
    "(Disabled/Polling) from a missing subnet manager (INIT with LinkUp)",
)
PORT_RATE = "llmgw_ib_port_rate_gbps", "The rate the port's link trained at"
PORT_COUNTERS = "llmgw_ib_port_counter", "The port's error and data counters (data in bytes)"
PORT_FLAPS = "llmgw_ib_port_flaps", "Times the port went down or up since its agent started"
NVLINK_JOINED = (
    "llmgw_gpu_nvlink_joined",
    "1 when the card is joined to its node's multi-node NVLink domain (fabric Completed/Success, "
    "healthy, that domain's ClusterUUID and CliqueId); absent on a node in no such domain",
)
IMEX_UP = (
    "llmgw_imex_up",
    "1 when the node's IMEX daemon is READY, its domain UP and a channel present; absent on a node "
    "that is in no NVLink domain",
)
FABRIC_MASTER = "llmgw_fabric_master_sm", "1 for each master subnet manager a fabric's ports report"
FABRIC_MANAGERS = "llmgw_fabric_subnet_managers", "Subnet managers listed on the fabric (master and standbys)"
FABRIC_PROBLEMS = "llmgw_fabric_problems", "Fabric problems found, by kind"


class FabricCollector:
    """Ports, NVLink domains and fabrics, written as text (llmgw.metrics.Exposition) from the
    nodes the scrape read once (apps.cluster.metrics.scrape_nodes)."""

    def text(self) -> str:
        """The exposition: each node's NVLink cards and IMEX state, its ports, then the fabrics."""
        from apps.fabrics import nvlink

        out = Exposition()
        active, rate, counters, flaps = PORT_ACTIVE, PORT_RATE, PORT_COUNTERS, PORT_FLAPS
        # Declared in this order whether or not each has series (an empty one is not written); the
        # ports' lines, some 50,000 on 2,000 nodes, are written straight into their families.
        active_lines = out.family(*active)
        rate_lines = out.family(*rate)
        counter_lines = out.family(*counters, kind="counter")
        flap_lines = out.family(*flaps, kind="counter")
        out.family(*NVLINK_JOINED)
        out.family(*IMEX_UP)
        for node in scrape_nodes():
            sample = node.sample
            if sample is None:
                continue
            # Only a node in a domain has these series: most are not, and need not be read card by card.
            in_domain = node.nvlink_domain is not None or nvlink.may_name_domain(sample)
            state = nvlink.read_node(sample, {"nvlink_domain": node.nvlink_domain}) if in_domain else None
            if state is not None and state.domain is not None:
                for card in state.cards:
                    labels = {
                        "node": node.name,
                        "gpu": str(card.index),
                        "domain": card.domain or state.domain or "-",
                        "state": card.state or "-",
                    }
                    out.add(*NVLINK_JOINED, label_text(labels), 1.0 if card.joined else 0.0)
                up = state.imex_up
                if up is not None:
                    summary = nvlink.imex_summary(state.imex) or {}
                    labels = {
                        "node": node.name,
                        "state": str(summary.get("state") or "-"),
                        "domain_state": str(summary.get("domain_state") or "-"),
                    }
                    out.add(*IMEX_UP, label_text(labels), 1.0 if up else 0.0)
            n = f'node="{escape_label(node.name)}"'
            for port in sample.get("ib_ports") or []:
                if not isinstance(port, dict):
                    continue
                # Labels in label_text's order: counter, device, link_layer, node, phys_state, port, state.
                device = f'device="{escape_label(str(port.get("device")))}"'
                number = f'port="{escape_label(str(port.get("port")))}"'
                where = f"{device},{n},{number}"
                if port.get("up").__class__ is bool:
                    link = escape_label(str(port.get("link_layer") or "-"))
                    port_state = escape_label(str(port.get("state_name") or port.get("state") or "-"))
                    phys = escape_label(str(port.get("phys_state_name") or port.get("phys_state") or "-"))
                    link_labels = f'{device},link_layer="{link}",{n},phys_state="{phys}",{number},state="{port_state}"'
                    active_lines.append(f"{active[0]}{{{link_labels}}} {'1.0' if port['up'] else '0.0'}\n")
                gbps = port.get("rate_gbps")
                if gbps is not None and gbps.__class__ in NUMBERS:
                    rate_lines.append(f"{rate[0]}{{{where}}} {number_text(gbps)}\n")
                errors = port.get("errors")
                figures = [(name, port.get(name)) for name in ("xmit_bytes", "rcv_bytes")]
                figures += errors.items() if isinstance(errors, dict) else ()
                for name, value in figures:
                    if value.__class__ is int:
                        counter_lines.append(
                            f'{counters[0]}_total{{counter="{escape_label(str(name))}",{where}}} {number_text(value)}\n'
                        )
                flapped = port.get("flaps")
                if flapped is not None and flapped.__class__ is int:
                    flap_lines.append(f"{flaps[0]}_total{{{where}}} {number_text(flapped)}\n")

        _fabric_lines(out)
        return out.text()


def _fabric_lines(out: Exposition) -> None:
    """Each InfiniBand fabric's subnet managers (the master marked) and the fabric problems by kind."""
    from apps.fabrics.services import fabrics_overview

    overview = fabrics_overview()
    out.family(*FABRIC_MASTER)
    out.family(*FABRIC_MANAGERS)
    for fabric in overview["fabrics"]:
        if fabric["kind"] != "ib":
            continue
        out.add(*FABRIC_MANAGERS, label_text({"fabric": fabric["id"]}), float(len(fabric["subnet_managers"])))
        for sm in fabric["subnet_managers"]:
            if sm.get("master"):
                out.add(*FABRIC_MASTER, label_text({"fabric": fabric["id"], "guid": sm["guid"]}), 1.0)
    for code, count in sorted(Counter(p["code"] for p in overview["problems"]).items()):
        out.add(*FABRIC_PROBLEMS, label_text({"code": code}), float(count))
