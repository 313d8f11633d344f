"""`llmgw doctor` on NVSwitch nodes: each GPU's NVLink fabric, the node's NVLink domain and IMEX.

nvidia-smi and nvidia-imex-ctl are shell scripts that print captured output
(../shared/fixtures/nvidia-smi-q, nvidia-imex-ctl), or a copy of it changed the way a GB200 tray
would print it (a non-zero ClusterUUID, a CliqueId, an unhealthy GPU): no such capture exists.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from fixturefiles import fixture_text

from agent import doctor
from agent.config import AgentConfig
from agent.doctor import FAIL, PASS, WARN, Check, nvlink_checks

HGX = "h100-sxm-80gb-x8-drv565-fabric-clique0-zero-uuid.txt"
UUID = "3b4f5e2a-9c1d-4e8f-a7b6-0123456789ab"
NEWER_IMEX = """Connectivity Table Legend:
I - Invalid - Node wasn't reachable, no connection status available
N - Never Connected
R - Recovering - Connection was lost, but clean up has not yet been triggered.
D - Disconnected - Connection was lost, and clean up has been triggreed.
A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.
!V! - Version mismatch, communication disabled.
C - Connected - Ready for operation

6/1/2025 10:00:00.000
Nodes:
Node #0   - 10.0.0.1        - READY                - Version: 570.172
Node #1   - 10.0.0.2        - UNAVAILABLE          - Version: 570.172

 Nodes From\\To  0    1
       0        C    N
       1        N    C
Domain State: {state}
"""


def script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def printing(path: Path, outputs: dict[str, str]) -> str:
    """A tool that prints ``outputs[<its arguments>]`` (kept next to it) and fails on anything else."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cases = []
    for number, (args, text) in enumerate(outputs.items()):
        saved = path.parent / f"{path.name}.{number}.out"
        saved.write_text(text)
        cases.append(f"  {shlex.quote(args)}) cat {shlex.quote(str(saved))} ;;")
    return script(path, 'case "$*" in\n' + "\n".join(cases) + "\n  *) exit 2 ;;\nesac\n")


def node(
    tmp_path: Path,
    smi: str,
    imex: dict[str, str] | None = None,
    channels: tuple[str, ...] = (),
) -> AgentConfig:
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True, exist_ok=True)
    if channels:
        directory = root / "dev" / "nvidia-caps-imex-channels"
        directory.mkdir(parents=True)
        for name in channels:
            (directory / name).write_text("")
    tools = {"nvidia-smi": printing(tmp_path / "bin" / "nvidia-smi", {"-q": smi})}
    tools["nvidia-imex-ctl"] = (
        printing(tmp_path / "bin" / "nvidia-imex-ctl", imex) if imex is not None else str(tmp_path / "absent" / "ctl")
    )
    return AgentConfig(server="http://127.0.0.1:1", state_dir=tmp_path / "state", root=str(root), tools=tools)


def gpu_sections(text: str) -> list[tuple[int, int]]:
    """(start, end) of each GPU's section of ``nvidia-smi -q`` text."""
    starts = [m.start() for m in re.finditer(r"^GPU [0-9A-Fa-f]{8}:", text, re.MULTILINE)]
    return list(zip(starts, [*starts[1:], len(text)], strict=True))


def fabric(text: str, changes: dict[int, dict[str, str]]) -> str:
    """The ``-q`` text with the Fabric block of GPU <i> changed: ``{"State": "In Progress"}``
    replaces a row's value; ``Summary`` is added under Health when the driver did not print it."""
    pieces = []
    last = 0
    for i, (start, end) in enumerate(gpu_sections(text)):
        section = text[start:end]
        block = re.search(r"\n    Fabric\n(?:        .*\n)+", section)
        assert block is not None, f"GPU {i} has no Fabric block"
        body = block.group(0)
        for key, value in changes.get(i, {}).items():
            row = re.compile(rf"^(\s+{re.escape(key)}\s+: ).*$", re.MULTILINE)
            if row.search(body):
                body = row.sub(lambda m, value=value: m.group(1) + value, body, count=1)
            else:
                body = body.replace("        Health\n", f"        Health\n            {key:<30}: {value}\n", 1)
        pieces.append(text[last:start] + section[: block.start()] + body + section[block.end() :])
        last = end
    return "".join(pieces) + text[last:]


def everywhere(changes: dict[str, str], count: int = 8) -> dict[int, dict[str, str]]:
    return {i: dict(changes) for i in range(count)}


def by_name(checks: list[Check]) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


@pytest.fixture
def hgx() -> str:
    return fixture_text("nvidia-smi-q", HGX)


@pytest.fixture
def imex_ok() -> dict[str, str]:
    return {
        "-q": fixture_text("nvidia-imex-ctl", "q-ready.txt"),
        "-N": fixture_text("nvidia-imex-ctl", "N-gh200-2node-domain-up-drv570.txt"),
    }


def test_the_mutation_helper_changes_only_what_it_names(hgx: str) -> None:
    from agent.probes.nvidia import parse_nvidia_smi_text

    changed = fabric(hgx, {2: {"State": "In Progress"}, 3: {"Summary": "Unhealthy", "Bandwidth": "Degraded"}})
    gpus = parse_nvidia_smi_text(changed).gpus
    assert len(gpus) == 8
    assert [g.fabric.state for g in gpus if g.fabric] == ["Completed"] * 2 + ["In Progress"] + ["Completed"] * 5
    third = gpus[3].fabric
    assert third is not None and third.health_summary == "Unhealthy"
    assert getattr(third, "bandwidth", "Degraded") == "Degraded"
    assert parse_nvidia_smi_text(hgx).gpus[3].fabric.health_summary is None  # type: ignore[union-attr]


# --------------------------------------------------------------------------- nothing to check


@pytest.mark.parametrize(
    "name", ["l40s-drv550.txt", "a100-sxm4-80gb-x4-drv555-fabric-na.txt", "gtx680-kepler-drv470-legacy-format.txt"]
)
def test_no_nvswitch_no_checks(tmp_path: Path, name: str) -> None:
    assert nvlink_checks(node(tmp_path, fixture_text("nvidia-smi-q", name))) == []


def test_a_failing_or_missing_nvidia_smi_is_left_to_the_gpu_check(tmp_path: Path) -> None:
    config = node(tmp_path, "")
    broken = "echo 'Failed to initialize NVML: Driver/library version mismatch' >&2\nexit 9\n"
    config.tools["nvidia-smi"] = script(tmp_path / "broken" / "nvidia-smi", broken)
    assert nvlink_checks(config) == []
    config.tools["nvidia-smi"] = str(tmp_path / "nowhere" / "nvidia-smi")
    assert nvlink_checks(config) == []


# --------------------------------------------------------------------------- one machine's NVSwitch


def test_single_node_hgx_passes_without_imex(tmp_path: Path, hgx: str) -> None:
    checks = nvlink_checks(node(tmp_path, hgx))  # nvidia-imex-ctl is absent: it must not be asked
    assert [c.name for c in checks] == [f"GPU {i} NVLink fabric" for i in range(8)]
    assert all(c.status == PASS for c in checks)
    assert checks[0].detail == "Completed/Success: a single machine's NVSwitch, no multi-node domain"


def test_in_progress_unhealthy_degraded_and_a_bad_status_on_one_machine(tmp_path: Path, hgx: str) -> None:
    text = fabric(
        hgx,
        {
            1: {"State": "In Progress"},
            2: {"Status": "Insufficient Resources"},
            3: {"Summary": "Unhealthy"},
            4: {"Bandwidth": "Degraded"},
            5: {"Summary": "Limited Capacity"},
            6: {"State": "Not Started"},
        },
    )
    found = by_name(nvlink_checks(node(tmp_path, text)))
    assert found["GPU 0 NVLink fabric"].status == PASS
    gpu1 = found["GPU 1 NVLink fabric"]
    assert gpu1.status == FAIL and "In Progress" in gpu1.detail and "partition not active" in gpu1.detail
    assert "nvidia-fabricmanager" in gpu1.fix and "NVLink switch trays" in gpu1.fix
    gpu2 = found["GPU 2 NVLink fabric"]
    assert gpu2.status == FAIL and "Status Insufficient Resources" in gpu2.detail
    gpu3 = found["GPU 3 NVLink fabric"]
    assert gpu3.status == FAIL and "Unhealthy" in gpu3.detail and "CliqueId 0" in gpu3.detail
    gpu4 = found["GPU 4 NVLink fabric"]
    assert gpu4.status == WARN and "Bandwidth Degraded" in gpu4.detail and "nvlink -e" in gpu4.fix
    assert found["GPU 5 NVLink fabric"].status == WARN and "Limited Capacity" in found["GPU 5 NVLink fabric"].detail
    assert found["GPU 6 NVLink fabric"].status == FAIL and "Not Started" in found["GPU 6 NVLink fabric"].detail
    assert "NVLink domain" not in found and not any(name.startswith("IMEX") for name in found)


# --------------------------------------------------------------------------- a multi-node NVLink domain


def test_a_healthy_multi_node_domain(tmp_path: Path, hgx: str, imex_ok: dict[str, str]) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7", "Bandwidth": "Full"}))
    checks = nvlink_checks(node(tmp_path, text, imex_ok, channels=("channel0",)))
    found = by_name(checks)
    assert [c.name for c in checks][8:] == ["NVLink domain", "IMEX daemon", "IMEX domain", "IMEX channels"]
    assert all(c.status == PASS for c in checks), [c for c in checks if c.status != PASS]
    assert found["GPU 0 NVLink fabric"].detail == f"Completed/Success, NVLink domain {UUID}.7"
    assert found["NVLink domain"].detail == f"8 GPUs in NVLink domain {UUID}.7"
    assert found["IMEX daemon"].detail == "READY"
    assert found["IMEX domain"].detail == "UP, 2 nodes"
    assert found["IMEX channels"].detail == "channel0 under /dev/nvidia-caps-imex-channels"


def test_an_unhealthy_gpu_with_a_clique_and_a_gpu_in_another_clique(
    tmp_path: Path, hgx: str, imex_ok: dict[str, str]
) -> None:
    changes = everywhere({"ClusterUUID": UUID, "CliqueId": "7"})
    changes[3].update({"Summary": "Unhealthy", "Bandwidth": "Degraded"})
    changes[5]["CliqueId"] = "8"
    changes[6]["State"] = "In Progress"
    found = by_name(nvlink_checks(node(tmp_path, fabric(hgx, changes), imex_ok, channels=("channel0", "channel3"))))
    gpu3 = found["GPU 3 NVLink fabric"]
    assert gpu3.status == FAIL
    assert "Unhealthy (CliqueId 7 reported" in gpu3.detail and "Bandwidth Degraded" in gpu3.detail
    assert f"NVLink domain {UUID}.7" in gpu3.detail and "drain the node" in gpu3.fix
    assert found["GPU 5 NVLink fabric"].status == PASS and f"{UUID}.8" in found["GPU 5 NVLink fabric"].detail
    assert found["GPU 6 NVLink fabric"].status == FAIL and "In Progress" in found["GPU 6 NVLink fabric"].detail
    domain = found["NVLink domain"]
    assert domain.status == FAIL and "a node must be in one domain" in domain.detail
    assert f"{UUID}.7: GPU 0,1,2,3,4,6,7" in domain.detail and f"{UUID}.8: GPU 5" in domain.detail
    assert found["IMEX channels"].detail == "channel0, channel3 under /dev/nvidia-caps-imex-channels"


def test_some_gpus_without_a_domain(tmp_path: Path, hgx: str, imex_ok: dict[str, str]) -> None:
    changes = {i: {"ClusterUUID": UUID, "CliqueId": "7"} for i in range(4)}
    found = by_name(nvlink_checks(node(tmp_path, fabric(hgx, changes), imex_ok, channels=("channel0",))))
    assert found["NVLink domain"].status == FAIL
    assert "no domain: GPU 4,5,6,7" in found["NVLink domain"].detail
    assert found["GPU 7 NVLink fabric"].status == PASS


def test_without_imex_and_without_channels(tmp_path: Path, hgx: str) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    found = by_name(nvlink_checks(node(tmp_path, text)))
    daemon = found["IMEX daemon"]
    assert daemon.status == FAIL
    assert "without IMEX the domain's GPUs cannot share memory across nodes" in daemon.detail
    assert "install and start nvidia-imex" in daemon.fix
    assert "IMEX domain" not in found
    channels = found["IMEX channels"]
    assert channels.status == FAIL and channels.detail == "no IMEX channel under /dev/nvidia-caps-imex-channels"
    assert "nvidia-modprobe -i 0:1" in channels.fix and "NVreg_CreateImexChannel0=1" in channels.fix


def test_an_empty_channel_directory_fails(tmp_path: Path, hgx: str, imex_ok: dict[str, str]) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    config = node(tmp_path, text, imex_ok)
    (Path(config.root) / "dev" / "nvidia-caps-imex-channels").mkdir(parents=True)
    assert by_name(nvlink_checks(config))["IMEX channels"].status == FAIL


def test_imex_waiting_and_a_down_domain(tmp_path: Path, hgx: str) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    imex = {"-q": "WAITING_FOR_PEERS\n", "-N": NEWER_IMEX.format(state="DOWN")}
    found = by_name(nvlink_checks(node(tmp_path, text, imex, channels=("channel0",))))
    assert found["IMEX daemon"].status == FAIL and "WAITING_FOR_PEERS" in found["IMEX daemon"].detail
    domain = found["IMEX domain"]
    assert domain.status == FAIL and domain.detail.startswith("DOWN, 2 nodes")
    assert "node #1 10.0.0.2 UNAVAILABLE" in domain.detail and "10.0.0.1" not in domain.detail
    assert "0→1 N" in domain.detail and "1→0 N" in domain.detail


def test_a_degraded_domain_warns(tmp_path: Path, hgx: str) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    imex = {"-q": "READY\n", "-N": NEWER_IMEX.format(state="DEGRADED")}
    found = by_name(nvlink_checks(node(tmp_path, text, imex, channels=("channel0",))))
    assert found["IMEX daemon"].status == PASS
    assert found["IMEX domain"].status == WARN and "DEGRADED" in found["IMEX domain"].detail
    assert "node #1 10.0.0.2 UNAVAILABLE" in found["IMEX domain"].detail


def test_imex_without_a_node_list(tmp_path: Path, hgx: str) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    imex = {"-q": "Query Status returned error code: 14\n", "-N": "Failed to read node configuration file\n"}
    found = by_name(nvlink_checks(node(tmp_path, text, imex, channels=("channel0",))))
    assert found["IMEX daemon"].status == FAIL and "error code: 14" in found["IMEX daemon"].detail
    domain = found["IMEX domain"]
    assert domain.status == FAIL and "Failed to read node configuration file" in domain.detail
    assert "/etc/nvidia-imex/nodes_config.cfg" in domain.fix


def test_imex_unknown_answers(tmp_path: Path, hgx: str) -> None:
    text = fabric(hgx, everywhere({"ClusterUUID": UUID, "CliqueId": "7"}))
    imex = {"-q": "", "-N": "something else entirely\n"}
    found = by_name(nvlink_checks(node(tmp_path, text, imex, channels=("channel0",))))
    assert found["IMEX daemon"].status == FAIL and "gave no state" in found["IMEX daemon"].detail
    assert found["IMEX domain"].status == WARN and "no Domain State" in found["IMEX domain"].detail


# --------------------------------------------------------------------------- run_checks


def test_run_checks_runs_it_after_the_fabric_ports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = node(tmp_path, "")
    config.tools["nvidia-smi"] = str(tmp_path / "absent" / "nvidia-smi")
    order: list[str] = []
    monkeypatch.setattr(doctor, "fabric_checks", lambda c, timeout: order.append("fabric") or [])
    monkeypatch.setattr(doctor, "nvlink_checks", lambda c, timeout: order.append("nvlink") or [])
    doctor.run_checks(config, installed={}, timeout=0.5)
    assert order == ["fabric", "nvlink"]

    def broken(config: AgentConfig, *, timeout: float) -> list[Check]:
        raise RuntimeError("parser bug")

    monkeypatch.setattr(doctor, "nvlink_checks", broken)
    found = by_name(doctor.run_checks(config, installed={}, timeout=0.5))
    assert found["NVLink fabric"] == Check("NVLink fabric", FAIL, "the check itself failed: RuntimeError: parser bug")


def test_health_rows_not_supported_are_not_a_warning_and_faults_are(tmp_path: Path) -> None:
    text = fixture_text("nvidia-smi-q", HGX)
    unsupported = (
        "            Summary                       : Not Supported\n"
        "            Bandwidth                     : Not Supported"
    )
    text = text.replace("            Bandwidth                     : N/A", unsupported)
    faulty = text.replace(
        unsupported,
        "            Summary                       : Healthy\n"
        "            Bandwidth                     : Full\n"
        "            Route Recovery in progress    : True",
        1,
    )
    for name, body, status in (("quiet", text, PASS), ("faulty", faulty, WARN)):
        checks = nvlink_checks(node(tmp_path / name, body))
        first = next(c for c in checks if c.name == "GPU 0 NVLink fabric")
        assert first.status == status, first
        if status == WARN:
            assert "health reports Route Recovery in progress" in first.detail
