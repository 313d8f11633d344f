"""`llmgw doctor` on AMD nodes: the amdgpu driver and its compute interface (KFD), /dev/kfd and the
render nodes in /dev/dri readable and writable by the agent's user, and the ROCm release, on filesystem
roots laid out as such a node's, with captured rocminfo output as the tool's answer."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from fixturefiles import fixture_files, read_text

from agent import doctor
from agent.config import AgentConfig
from agent.doctor import Check
from agent.probes.amd import parse_rocminfo
from tests.agent.test_doctor import by_name, node, script

CARDS = ("0000:0c:00.0", "0000:22:00.0")


def amd_node(
    tmp_path: Path,
    *,
    cards: tuple[str, ...] = CARDS,
    loaded: bool = True,
    kfd: bool = True,
    dev_kfd: bool = True,
    render: int = 2,
    rocm: str | None = "6.3.1-48\n",
    rocminfo: str | None = None,
) -> AgentConfig:
    """A node whose root holds what the kernel shows of its AMD cards; `rocminfo`: the tool's answer
    (a script that prints it), or none installed."""
    config = node(tmp_path)
    root = Path(config.root)
    devices = root / "sys" / "bus" / "pci" / "devices"
    # Beside the cards: an AMD CPU's host bridge (vendor 0x1022) and a network card, neither a GPU.
    for address, vendor, kind in [
        *((card, "0x1002", "0x120000") for card in cards),
        ("0000:00:00.0", "0x1022", "0x060000"),
        ("0000:41:00.0", "0x15b3", "0x020700"),
    ]:
        (devices / address).mkdir(parents=True)
        (devices / address / "vendor").write_text(vendor + "\n")
        (devices / address / "class").write_text(kind + "\n")
    (root / "sys" / "module" / "nvme").mkdir(parents=True)
    (root / "proc" / "modules").write_text("nvme 61440 3 - Live 0x0000000000000000\n")
    if loaded:
        (root / "sys" / "module" / "amdgpu").mkdir()
        (root / "sys" / "module" / "amdgpu" / "version").write_text("6.10.5\n")
        with (root / "proc" / "modules").open("a") as modules:
            modules.write("amdgpu 19464192 8 - Live 0x0000000000000000\n")
    if kfd:
        (root / "sys" / "class" / "kfd" / "kfd" / "topology" / "nodes").mkdir(parents=True)
    (root / "dev" / "dri").mkdir(parents=True)
    if dev_kfd:
        (root / "dev" / "kfd").write_text("")
    for number in range(render):
        (root / "dev" / "dri" / f"card{number}").write_text("")
        (root / "dev" / "dri" / f"renderD{128 + number}").write_text("")
    if rocm is not None:
        (root / "opt" / "rocm" / ".info").mkdir(parents=True)
        (root / "opt" / "rocm" / ".info" / "version").write_text(rocm)
    if rocminfo is None:
        config.tools["rocminfo"] = str(tmp_path / "absent" / "rocminfo")
    else:
        (tmp_path / "rocminfo.txt").write_text(rocminfo)
        config.tools["rocminfo"] = script(
            tmp_path / "bin" / "rocminfo", f"cat {shlex.quote(str(tmp_path / 'rocminfo.txt'))}\n"
        )
    return config


def denying(*shut: str) -> Callable[[str, int], bool]:
    """os.access for a user who may not open the paths ending in `shut` (tests run as root, who may)."""
    return lambda path, mode: not path.endswith(shut)


@pytest.mark.parametrize("path", fixture_files("rocminfo"))
def test_a_healthy_amd_node_passes_every_check_naming_what_rocminfo_sees(tmp_path: Path, path: Path) -> None:
    text = read_text(path)
    info = parse_rocminfo(text)
    config = amd_node(tmp_path, rocminfo=text)
    found = by_name(doctor.amd_checks(config))
    assert [c.status for c in found.values()] == ["pass"] * 4, found
    driver = found["amd driver"].detail
    assert "2 AMD GPUs on the PCI bus (0000:0c:00.0, 0000:22:00.0)" in driver
    assert "amdgpu 6.10.5 loaded with its compute interface (KFD)" in driver
    assert f"rocminfo: {len(info.gpus)} GPU agents: " in driver
    assert (info.gpus[0].marketing_name or "") in driver
    assert found["amd /dev/kfd"].detail.startswith("/dev/kfd readable and writable by ")
    assert found["amd /dev/dri"].detail.startswith("2 render nodes (renderD128 … renderD129) readable and writable")
    assert found["rocm"].detail == "ROCm 6.3.1-48 (/opt/rocm): llama.cpp's ROCm builds up to ROCm 6.3 can run here"


def test_a_node_without_an_amd_gpu_has_no_amd_checks(tmp_path: Path) -> None:
    assert doctor.amd_checks(amd_node(tmp_path, cards=(), loaded=False, kfd=False, dev_kfd=False)) == []


def test_a_card_on_the_bus_without_its_driver_fails_and_says_how_to_load_it(tmp_path: Path) -> None:
    config = amd_node(tmp_path, loaded=False, kfd=False, dev_kfd=False, render=0)
    found = by_name(doctor.amd_checks(config))
    driver = found["amd driver"]
    assert driver.status == "fail"
    assert (
        driver.detail == "2 AMD GPUs on the PCI bus (0000:0c:00.0, 0000:22:00.0), but the amdgpu driver is not loaded"
    )
    assert "modprobe amdgpu" in driver.fix and "amdgpu-dkms" in driver.fix
    assert found["amd /dev/kfd"].status == "fail" and "/dev/kfd does not exist" in found["amd /dev/kfd"].detail
    assert found["amd /dev/dri"].status == "fail" and "no render node" in found["amd /dev/dri"].detail


def test_the_driver_without_its_compute_interface_fails(tmp_path: Path) -> None:
    driver = by_name(doctor.amd_checks(amd_node(tmp_path, kfd=False)))["amd driver"]
    assert driver.status == "fail"
    assert "amdgpu 6.10.5 is loaded but its compute interface (KFD) is not: /sys/class/kfd/kfd is absent" in (
        driver.detail
    )


def test_rocminfo_that_cannot_use_the_driver_fails_and_one_that_says_nothing_is_unknown(tmp_path: Path) -> None:
    refused = amd_node(tmp_path / "a", rocminfo="ROCk module is NOT loaded, possibly no GPU devices\n")
    driver = by_name(doctor.amd_checks(refused))["amd driver"]
    assert driver.status == "fail" and "rocminfo says it cannot use it" in driver.detail
    silent = amd_node(tmp_path / "b")
    silent.tools["rocminfo"] = script(tmp_path / "b" / "bin" / "rocminfo", "exit 3\n")
    driver = by_name(doctor.amd_checks(silent))["amd driver"]
    assert driver.status == "warn" and "rocminfo: exit status 3, no output" in driver.detail
    empty = amd_node(tmp_path / "c", rocminfo="ROCk module is loaded\n*** Done ***\n")
    driver = by_name(doctor.amd_checks(empty))["amd driver"]
    assert driver.status == "warn" and "rocminfo lists no GPU agent" in driver.detail


def test_device_files_the_agent_s_user_cannot_open_fail_naming_the_group_to_join(tmp_path: Path) -> None:
    config = amd_node(tmp_path, render=3)
    found = by_name(doctor.amd_checks(config, access=denying("/dev/kfd", "renderD129", "renderD130")))
    kfd, dri = found["amd /dev/kfd"], found["amd /dev/dri"]
    assert kfd.status == "fail" and kfd.detail.startswith("/dev/kfd is not readable and writable by ")
    assert "group '" in kfd.detail and "usermod -aG render,video" in kfd.fix and "restart the agent" in kfd.fix
    assert dri.status == "fail"
    assert "2 of 3 render nodes are not readable and writable by " in dri.detail
    assert "renderD129, renderD130" in dri.detail and "usermod -aG render,video" in dri.fix
    assert found["amd driver"].status == "pass"


def test_a_missing_dev_dri_fails(tmp_path: Path) -> None:
    config = amd_node(tmp_path, render=0)
    os.rmdir(Path(config.root) / "dev" / "dri")
    dri = by_name(doctor.amd_checks(config))["amd /dev/dri"]
    assert dri.status == "fail" and dri.detail.startswith("cannot list /dev/dri: ")
    assert "--device /dev/dri" in dri.fix


@pytest.mark.parametrize(
    ("rocm", "status", "detail"),
    [
        (None, "warn", "no ROCm release installed (/opt/rocm/.info/version absent)"),
        ("garbage here\n", "warn", "/opt/rocm/.info/version does not hold a ROCm version: 'garbage here'"),
        ("7.0.2\n", "pass", "ROCm 7.0.2 (/opt/rocm): llama.cpp's ROCm builds up to ROCm 7.0 can run here"),
    ],
)
def test_the_rocm_release(tmp_path: Path, rocm: str | None, status: str, detail: str) -> None:
    check = by_name(doctor.amd_checks(amd_node(tmp_path, rocm=rocm)))["rocm"]
    assert (check.status, check.detail) == (status, detail)
    if status == "warn":
        assert "Vulkan build" in check.fix and "amdgpu-install --usecase=rocm" in check.fix


def test_on_an_amd_node_the_doctor_shows_the_amd_checks_instead_of_calling_it_a_cpu_node(tmp_path: Path) -> None:
    config = amd_node(tmp_path)
    checks = doctor.run_checks(config, installed={}, timeout=0.5)
    names = [c.name for c in checks]
    assert "gpu driver" not in names  # "no NVIDIA GPU (CPU node)" would mislead
    assert names[names.index("amd driver") : names.index("amd driver") + 4] == [
        "amd driver",
        "amd /dev/kfd",
        "amd /dev/dri",
        "rocm",
    ]
    assert Check("gpu driver", "pass", "no NVIDIA GPU (CPU node)") in doctor.run_checks(
        node(tmp_path / "cpu"), installed={}, timeout=0.5
    )
