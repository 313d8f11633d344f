"""The agent's view of its InfiniBand ports on a host laid out from a real sysfs capture: the
ports every heartbeat, the master each sees, and a change of fabrics said once per interval."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from agent.fabrics import FabricWatcher
from agent.runner import CommandRunner
from tests.fleet import HOSTS, build_host, fixtures_available, smir

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")

MASTER = "0x0002c90300a1b2c3"
STANDBY = "0x0002c90300a1b2d0"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def host(tmp_path: Path, spec: str = "h100-ib") -> tuple[Path, dict[str, str]]:
    root = tmp_path / "host"
    root.mkdir()
    return root, build_host(HOSTS[spec], root)


def watcher(
    root: Path, tools: dict[str, str], clock: Clock, fabrics: list[dict[str, Any]] | None = None
) -> FabricWatcher:
    return FabricWatcher(
        str(root),
        fabrics if fabrics is not None else [{"name": "ib-a"}],
        CommandRunner(tools),
        clock,
        check_interval=60,
        change_interval=30,
    )


def set_port(root: Path, device: str, state: str, phys: str) -> None:
    ports = root / "sys" / "class" / "infiniband" / device / "ports" / "1"
    (ports / "state").write_text(state + "\n")
    (ports / "phys_state").write_text(phys + "\n")


def sample(w: FabricWatcher) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    warnings: list[str] = []
    ports, managers = asyncio.run(w.sample(warnings))
    return ports, managers, warnings


def test_every_port_is_read_with_the_master_it_sees_and_the_managers_of_its_fabric(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    w = watcher(root, tools, Clock())
    ports, managers, _warnings = sample(w)
    assert [p["device"] for p in ports] == [f"mlx5_{i}" for i in (0, 1, 2, 3, 6, 7, 8, 9)]
    up = {p["device"]: p["up"] for p in ports}
    assert up["mlx5_6"] is False and up["mlx5_8"] is False  # INIT: a link, no subnet manager
    assert sum(up.values()) == 6
    for port in ports:
        assert port["fabric"] == "ib-a" and port["rate_gbps"] == 200.0
        # Only the active ports are asked which master they see.
        assert port.get("sm_guid") == (MASTER if port["up"] else None)
    [entry] = managers  # one saquery through one port of the one master
    assert entry["master"] == MASTER
    assert [(m["guid"], m["priority"], m["state"]) for m in entry["managers"]] == [(MASTER, 14, 3), (STANDBY, 10, 2)]
    body = w.snapshot()
    assert body is not None and body["declared"] == ["ib-a"]
    assert {(p["device"], p["up"]) for p in body["ports"]} == {(p["device"], p["up"]) for p in ports}


def test_a_port_going_down_is_said_once_and_a_flapping_one_once_per_interval(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    clock = Clock()
    w = watcher(root, tools, clock)
    sample(w)
    assert w.snapshot() is not None  # said at registration
    sample(w)
    assert w.due() is None  # nothing changed
    set_port(root, "mlx5_0", "1: DOWN", "3: Disabled")
    clock.now += 31
    ports, _, _ = sample(w)
    body = w.due()
    assert body is not None
    assert next(p for p in body["ports"] if p["device"] == "mlx5_0")["up"] is False
    assert body["flaps"] == {"mlx5_0/1": 1}
    assert w.due() is None  # said once
    # Flapping every heartbeat for a minute: at most one message per 30 s interval.
    said = 0
    for beat in range(12):
        clock.now += 5
        if beat % 2:
            set_port(root, "mlx5_0", "1: DOWN", "3: Disabled")
        else:
            set_port(root, "mlx5_0", "4: ACTIVE", "5: LinkUp")
        sample(w)
        if w.due() is not None:
            said += 1
    assert said <= 2
    ports, _, _ = sample(w)
    assert next(p for p in ports if p["device"] == "mlx5_0")["flaps"] == 13


def test_a_failover_is_seen_at_the_next_check(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    clock = Clock()
    w = watcher(root, tools, clock)
    sample(w)
    w.snapshot()
    (root / "ib" / "master").write_text(STANDBY + "\n")
    (root / "ib" / "smir").write_text(smir((MASTER, 14, 2), (STANDBY, 10, 3)))
    clock.now += 10
    ports, _, _ = sample(w)
    assert {p.get("sm_guid") for p in ports if p["up"]} == {MASTER}  # not asked again yet
    clock.now += 60
    ports, managers, _ = sample(w)
    assert {p.get("sm_guid") for p in ports if p["up"]} == {STANDBY}
    assert managers[0]["master"] == STANDBY
    body = w.due()
    assert body is not None and {p.get("sm_guid") for p in body["ports"] if p["up"]} == {STANDBY}


def test_without_sminfo_the_ports_are_reported_and_the_fabric_cannot_be_checked(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    tools["sminfo"] = str(tmp_path / "no-sminfo-here")
    apt = tmp_path / "apt-get"
    apt.write_text(
        "#!/bin/sh\necho \"$*\" >> $0.log\necho 'E: Unable to locate package infiniband-diags' >&2\nexit 100\n"
    )
    apt.chmod(0o755)
    tools["apt-get"] = str(apt)
    clock = Clock()
    w = watcher(root, tools, clock)
    ports, managers, warnings = sample(w)
    assert sum(p["up"] for p in ports) == 6
    assert all("sm_guid" not in p for p in ports) and managers == []
    assert any("installing infiniband-diags failed (E: Unable to locate package" in w for w in warnings)
    assert (tmp_path / "apt-get.log").read_text() == "install -y --no-install-recommends infiniband-diags\n"
    clock.now += 120
    sample(w)  # tried once, not at every check
    assert len((tmp_path / "apt-get.log").read_text().splitlines()) == 1


def test_a_master_that_does_not_answer_leaves_the_port_unchecked(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    (root / "ib" / "master").write_text("")
    w = watcher(root, tools, Clock())
    ports, managers, _ = sample(w)
    assert all("sm_guid" not in p for p in ports) and managers == []


def test_ports_on_no_declared_fabric_are_reported_as_such(tmp_path: Path) -> None:
    root, tools = host(tmp_path)
    w = watcher(root, tools, Clock(), fabrics=[{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_1"]}])
    ports, _, _ = sample(w)
    assert {p["device"]: p["fabric"] for p in ports if p["fabric"]} == {"mlx5_0": "ib-a", "mlx5_1": "ib-a"}
    assert sum(1 for p in ports if not p["fabric"]) == 6


def test_a_host_without_adapters_reports_nothing(tmp_path: Path) -> None:
    root, tools = host(tmp_path, "cpu")
    w = watcher(root, tools, Clock())
    assert sample(w) == ([], [], [])
    assert w.snapshot() is None and w.due() is None


def test_a_roce_port_is_on_the_network_of_its_roce_v2_address(tmp_path: Path) -> None:
    from tests.fleet import _infiniband

    base = "/sys/devices/pci0000:00/0000:00:01.0/0000:17:00.0/infiniband/mlx5_0"
    port = f"{base}/ports/1"
    mapped = "0000:0000:0000:0000:0000:ffff:0a01:0203"  # 10.1.2.3
    tree = {
        f"{base}/node_guid": "b859:9f03:0012:3456\n",
        f"{port}/state": "4: ACTIVE\n",
        f"{port}/phys_state": "5: LinkUp\n",
        f"{port}/rate": "100 Gb/sec (4X EDR)\n",
        f"{port}/link_layer": "Ethernet\n",
        f"{port}/lid": "0x0\n",
        f"{port}/sm_lid": "0x0\n",
        f"{port}/gids/0": "fe80:0000:0000:0000:ba59:9fff:fe12:3456\n",
        f"{port}/gids/1": "fe80:0000:0000:0000:ba59:9fff:fe12:3456\n",
        f"{port}/gids/2": f"{mapped}\n",
        f"{port}/gids/3": f"{mapped}\n",
        f"{port}/gid_attrs/types/0": "IB/RoCE v1\n",
        f"{port}/gid_attrs/types/1": "RoCE v2\n",
        f"{port}/gid_attrs/types/2": "IB/RoCE v1\n",
        f"{port}/gid_attrs/types/3": "RoCE v2\n",
        **{f"{port}/gid_attrs/ndevs/{i}": "ens1f0np0\n" for i in range(4)},
    }
    root = tmp_path / "host"
    (root / "bin").mkdir(parents=True)
    tools = _infiniband(tree, root, root / "bin")
    w = watcher(root, tools, Clock(), fabrics=[{"name": "roce", "netdevs": ["ens1f0np0"]}])
    ports, managers, _ = sample(w)
    [roce] = ports
    assert (roce["fabric"], roce["link_layer"], roce["up"]) == ("roce", "Ethernet", True)
    assert (roce["roce_ip"], roce["roce_gid_index"], roce["network"]) == ("10.1.2.3", 3, "10.1.2.0/24")
    assert "sm_guid" not in roce and managers == []  # no subnet manager on Ethernet
    body = w.snapshot()
    assert body is not None and body["interfaces"] == {"ens1f0np0": ["10.1.2.3"]}
