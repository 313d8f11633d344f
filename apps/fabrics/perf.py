"""`ctl fabric-test A B`: measure two nodes' shared fabric rail by rail, through their agents.

Doctor checks a node alone; every check can pass while two nodes still cannot reach each
other. A test pairs A's adapters on the fabric they share with B's as NCCL does on a
rail-optimised fabric (the Nth with the Nth, NCCL_CROSS_NIC=0), and for one rail at a time
asks B's agent for an ib_write_bw server and A's for the client (no SSH between nodes: each
request goes over its agent's own connection). Each rail is graded against the rate its
link trained at (the slower of its two ports). A test is an operator's action: starting one is
audited as fabric.test (who, the two nodes, the fabric, from which address).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts import audit
from apps.accounts.models import User
from apps.cluster import agent_requests
from apps.cluster.models import AgentRequest, Node
from apps.fabrics.models import FabricTest, NodeFabrics
from apps.fabrics.placement import FabricAttachment
from apps.fabrics.services import _load, _natural, attachments_for
from llmgw.errors import ServiceError

__all__ = ["GRADES", "TestRefused", "grade", "run_test", "start_test"]

log = logging.getLogger(__name__)

# Share of the link's rate ib_write_bw reaches: a healthy HDR or NDR rail gives 90-97 %.
GRADES = ((0.85, "good"), (0.6, "degraded"))
TCP_PORT = 18515


class TestRefused(ServiceError, ValueError):
    """A fabric test that cannot start now (no shared fabric, an agent that cannot run it): a conflict."""

    status = 409
    code = "fabric_test_refused"


def grade(measured: float | None, link: float | None) -> str:
    if measured is None:
        return "failed"
    if not link:
        return "unknown"
    share = measured / link
    for floor, name in GRADES:
        if share >= floor:
            return name
    return "poor"


def _ports(node: Node) -> tuple[dict[str, dict[str, Any]], list[FabricAttachment]]:
    row = NodeFabrics.objects.filter(node=node).first()
    if row is None:
        return {}, []
    _rows, sm_sets, _managers = _load([node.pk])
    return {str(p["device"]): p for p in row.ports or []}, attachments_for(row, sm_sets, {})


def plan(client: Node, server: Node) -> tuple[str, list[dict[str, Any]]]:
    """The fabric the two nodes share and the rails to test on it; TestRefused says why not."""
    for node in (client, server):
        for kind in ("perftest.server", "perftest.client"):
            try:
                agent_requests.check(node, kind)
            except agent_requests.RequestRefused as exc:
                raise TestRefused(str(exc)) from None
    client_ports, client_on = _ports(client)
    server_ports, server_on = _ports(server)
    client_fabrics = {a["identity"]: a for a in client_on if a["identity"] and not a["problem"]}
    server_fabrics = {a["identity"]: a for a in server_on if a["identity"] and not a["problem"]}
    shared = sorted(set(client_fabrics) & set(server_fabrics))
    if not shared:
        raise TestRefused(
            _("%(a)s and %(b)s share no fabric: %(a)s is on %(on_a)s, %(b)s on %(on_b)s.")
            % {
                "a": client.name,
                "b": server.name,
                "on_a": ", ".join(sorted(client_fabrics)) or "-",
                "on_b": ", ".join(sorted(server_fabrics)) or "-",
            }
        )
    fabric = shared[0]
    a_hcas = sorted(client_fabrics[fabric]["hcas"], key=_natural)
    b_hcas = sorted(server_fabrics[fabric]["hcas"], key=_natural)
    rails = []
    for index, (a_dev, b_dev) in enumerate(zip(a_hcas, b_hcas, strict=False)):
        a_port, b_port = client_ports.get(a_dev, {}), server_ports.get(b_dev, {})
        rates = [
            r
            for r in (a_port.get("rate_gbps"), b_port.get("rate_gbps"))
            if isinstance(r, int | float) and not isinstance(r, bool) and r > 0
        ]
        rails.append(
            {
                "rail": index,
                "client": a_dev,
                "client_port": int(a_port.get("port") or 1),
                "server": b_dev,
                "server_port": int(b_port.get("port") or 1),
                "link_gbps": min(rates) if rates else None,
                "state": "waiting",
            }
        )
    unpaired = a_hcas[len(rails) :] + b_hcas[len(rails) :]
    for device in unpaired:
        rails.append({"rail": None, "client": device, "state": "unpaired", "grade": "unpaired"})
    return fabric, rails


@transaction.atomic
def start_test(
    client: Node, server: Node, *, duration_s: int = 5, actor: User | None, address: str | None = None
) -> FabricTest:
    """A test row, run by the worker rail after rail (run_test), and its audit event; TestRefused
    says why it cannot start (and nothing is written)."""
    fabric, rails = plan(client, server)
    if not server.address:
        raise TestRefused(_("Node %(node)s has no address the other node could reach.") % {"node": server.name})
    test = FabricTest.objects.create(client=client, server=server, fabric=fabric, rails=rails, duration_s=duration_s)
    audit.record(
        actor,
        "fabric.test",
        test,
        address=address,
        client=client.name,
        server=server.name,
        fabric=fabric,
        duration_s=duration_s,
    )
    from apps.fabrics.tasks import run_fabric_test

    transaction.on_commit(lambda: run_fabric_test.delay(test.pk))
    return test


def _wait(rows: list[AgentRequest], timeout: float) -> list[AgentRequest]:
    deadline = time.monotonic() + timeout
    done = (AgentRequest.State.ANSWERED, AgentRequest.State.FAILED, AgentRequest.State.TIMED_OUT)
    while True:
        fresh = [AgentRequest.objects.get(pk=r.pk) for r in rows]
        if all(r.state in done for r in fresh) or time.monotonic() > deadline:
            return fresh
        time.sleep(0.5)


def run_test(test_id: int) -> FabricTest:
    """Each rail in turn: B's server, then A's client, both answers awaited, graded."""
    test = FabricTest.objects.select_related("client", "server").get(pk=test_id)
    rails = list(test.rails)
    wait = test.duration_s + 90
    try:
        for rail in rails:
            if rail.get("rail") is None:
                continue
            rail["state"] = "running"
            FabricTest.objects.filter(pk=test.pk).update(rails=rails)
            common = {"duration": test.duration_s, "qps": 4, "tcp_port": TCP_PORT + int(rail["rail"]), "wait": 60}
            group = f"fabric-test:{test.pk}:{rail['rail']}"
            # Read afresh for each rail: whether a node is connected is judged on its last heartbeat.
            server_node, client_node = Node.objects.get(pk=test.server_id), Node.objects.get(pk=test.client_id)
            server = agent_requests.create(
                server_node,
                "perftest.server",
                {**common, "device": rail["server"], "port": rail["server_port"]},
                timeout_s=wait,
                group=group,
            )
            client = agent_requests.create(
                client_node,
                "perftest.client",
                {**common, "device": rail["client"], "port": rail["client_port"], "server": test.server.address},
                timeout_s=wait,
                group=group,
            )
            server, client = _wait([server, client], wait + 15)
            _record_rail(rail, server, client)
            FabricTest.objects.filter(pk=test.pk).update(rails=rails)
        state = FabricTest.State.DONE
        error = ""
    except agent_requests.RequestRefused as exc:
        state, error = FabricTest.State.FAILED, str(exc)
    except Exception as exc:  # the test ends with its reason, never silently in the worker's log
        log.exception("fabric test %s failed", test.pk)
        state, error = FabricTest.State.FAILED, str(exc)
    FabricTest.objects.filter(pk=test.pk).update(rails=rails, state=state, error=error, finished_at=timezone.now())
    test.refresh_from_db()
    return test


def _record_rail(rail: dict[str, Any], server: AgentRequest, client: AgentRequest) -> None:
    """The rail's figures from its two answers: the bandwidth the client measured (null when it
    did not answer or its figure was refused as it arrived, agent_requests), the share of the link
    and the grade; each unanswered request and refused figure is named in the rail's error."""
    answer = client.result if client.state == AgentRequest.State.ANSWERED else None
    measured = answer.get("bw_average_gbps") if isinstance(answer, dict) else None
    if isinstance(measured, bool) or not isinstance(measured, int | float):
        measured = None  # an answer kept before figures were checked as they arrived
    link = rail.get("link_gbps")
    rail["measured_gbps"] = measured
    rail["share"] = round(measured / link, 3) if measured is not None and link else None
    rail["grade"] = grade(measured, link)
    rail["state"] = "done" if measured is not None else "failed"
    errors = []
    for row in (server, client):
        if row.state != AgentRequest.State.ANSWERED:
            errors.append(f"{row.node.name}: {row.error or row.state}")
        elif isinstance(row.result, dict):
            errors += [f"{row.node.name}: {why}" for why in row.result.get("refused") or []]
    if errors:
        rail["error"] = "; ".join(errors)
    rail["requests"] = [server.pk, client.pk]


def as_dict(test: FabricTest) -> dict[str, Any]:
    return {
        "id": test.pk,
        "client": test.client.name,
        "server": test.server.name,
        "fabric": test.fabric,
        "state": test.state,
        "duration_s": test.duration_s,
        "rails": test.rails,
        "error": test.error,
        "created_at": test.created_at.isoformat(),
        "finished_at": test.finished_at.isoformat() if test.finished_at else None,
    }
