"""`llmgw doctor` on a node with InfiniBand adapters: each port's state, rate and master."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config import parse_config
from agent.doctor import FAIL, PASS, WARN, fabric_checks
from tests.fleet import HOSTS, build_host, fixtures_available

pytestmark = pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")


def config(tmp_path: Path, spec: str, **tools: str) -> object:
    root = tmp_path / "host"
    root.mkdir()
    found = {**build_host(HOSTS[spec], root), **tools}
    return parse_config({"server": "http://cp", "root": str(root), "tools": found, "state_dir": str(tmp_path / "s")})


def test_each_port_says_its_master_and_a_port_without_a_subnet_manager_fails(tmp_path: Path) -> None:
    checks = {c.name: c for c in fabric_checks(config(tmp_path, "h100-ib"))}  # type: ignore[arg-type]
    assert checks["port mlx5_0/1"].status == PASS
    assert "master subnet manager 0x0002c90300a1b2c3 (priority 14)" in checks["port mlx5_0/1"].detail
    assert checks["port mlx5_6/1"].status == FAIL
    assert "no subnet manager brought it up" in checks["port mlx5_6/1"].detail


def test_without_sminfo_the_ports_are_listed_and_the_fix_named(tmp_path: Path) -> None:
    checks = fabric_checks(config(tmp_path, "h100-ib", sminfo=str(tmp_path / "none")))  # type: ignore[arg-type]
    up = [c for c in checks if c.name == "port mlx5_0/1"]
    assert up[0].status == WARN and up[0].fix == "install infiniband-diags"


def test_a_node_without_adapters_has_no_fabric_checks(tmp_path: Path) -> None:
    assert fabric_checks(config(tmp_path, "cpu")) == []  # type: ignore[arg-type]


def test_a_master_whose_guid_sminfo_masks_is_named_by_its_lid_and_why(tmp_path: Path) -> None:
    # The line wrapped by the terminal it was captured from, inside a number, and its GUID masked.
    tool = tmp_path / "sminfo"
    tool.write_text(
        "#!/bin/sh\n"
        'printf "sminfo: sm lid 1 sm guid 0xXXXXXXXXXXXXXXXX, activity count 41\\n'
        '234 priority 14 state 3 SMINFO_MA\\nSTER\\n"\n'
    )
    tool.chmod(0o755)
    checks = {c.name: c for c in fabric_checks(config(tmp_path, "h100-ib", sminfo=str(tool)))}  # type: ignore[arg-type]
    assert checks["port mlx5_0/1"].status == PASS
    assert (
        "master subnet manager at LID 1 (the subnet manager's GUID is masked or cut short "
        "('0xXXXXXXXXXXXXXXXX'), so it is unknown) (priority 14)"
    ) in checks["port mlx5_0/1"].detail
