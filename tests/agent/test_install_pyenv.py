"""vLLM installed by the agent as a uv-built Python environment, the way it would be from GitHub
and PyPI: local servers of ours speak the releases API (vLLM's and uv's) and the simple API (the
node's package index and PyTorch's), and real uv resolves, hash-pins and installs real wheels.

The stand-in torch is the one thing that is not real: a test machine has no GPU, so whether torch
"sees" one is the wheel's say (tests/python_index.py)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.install import pyenv
from agent.install.builds import Asset, NodeFacts
from agent.install.manager import Installer, parse_desired_engines
from tests.engine_releases import ReleaseServer
from tests.python_index import SimpleIndex, engine_wheel, torch_wheel, uv_tarball, uv_wheel

UV = Path(sys.executable).parent / "uv"
pytestmark = pytest.mark.skipif(not UV.is_file(), reason="uv is not installed in the test environment (dev extra)")

VERSION = "0.11.0"
H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "architecture": "Hopper"}
V100 = {"index": 0, "name": "Tesla V100-SXM2-32GB", "architecture": "Volta"}


def uv_version() -> str:
    import subprocess

    return subprocess.run([str(UV), "--version"], capture_output=True, text=True, check=True).stdout.split()[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every file the servers hold, built once: uv packed two ways, the wheels for two indexes."""
    root = tmp_path_factory.mktemp("pyenv")
    made: dict[str, Path] = {"root": root}
    made["uv_tar"], made["uv_sha"] = uv_tarball(root / "uv-release", UV)
    made["uv_wheel"] = uv_wheel(root / "uv-wheel", UV, uv_version())
    main = root / "index"
    engine_wheel(main, VERSION)
    torch_wheel(main, "2.9.0", available=False, cuda=None)  # the CPU torch PyPI has
    made["index"] = main
    made["index_gpu"] = root / "index-gpu"  # an index whose torch sees the GPU (cu129 from PyPI)
    engine_wheel(made["index_gpu"], VERSION)
    torch_wheel(made["index_gpu"], "2.9.0", available=True, cuda="12.9")
    made["torch"] = root / "torch-cu130"
    torch_wheel(made["torch"], "2.9.0+cu130", available=True, cuda="13.0")
    made["vllm_cu130"] = engine_wheel(root / "vllm-release", VERSION, variant="cu130")
    made["vllm_cu130_arm"] = engine_wheel(root / "vllm-release", VERSION, variant="cu130", arch="aarch64")
    return made


class Servers:
    def __init__(self, built: dict[str, Path], index: Path) -> None:
        self.vllm = ReleaseServer("vllm-project/vllm")
        self.uv = ReleaseServer("astral-sh/uv")
        self.index = SimpleIndex(index)
        self.torch = SimpleIndex(built["torch"])
        self.built = built

    def __enter__(self) -> Servers:
        for server in (self.vllm, self.uv, self.index, self.torch):
            server.__enter__()
        self.vllm.add(f"v{VERSION}", self.built["vllm_cu130"])
        self.vllm.add(f"v{VERSION}", self.built["vllm_cu130_arm"])
        self.uv.add(uv_version(), self.built["uv_tar"])
        self.uv.add(uv_version(), self.built["uv_sha"])
        return self

    def __exit__(self, *exc: object) -> None:
        for server in (self.vllm, self.uv, self.index, self.torch):
            server.__exit__()

    def item(self, *, build: str = "auto", min_compute: str = "7.5", **extra: Any) -> dict[str, Any]:
        """What the control plane sends for vLLM: the release listing and uv's, relayed."""
        return {
            "engine": "vllm",
            "version": VERSION,
            "assets": self.vllm.release(f"v{VERSION}")["assets"],
            "index_variant": "cu129",
            "torch_index": self.torch.url,
            "build": build,
            "min_compute": min_compute,
            "uv": {"version": uv_version(), "assets": self.uv.release(uv_version())["assets"]},
            **extra,
        }


@pytest.fixture
def servers(built: dict[str, Path]) -> Iterator[Servers]:
    with Servers(built, built["index"]) as made:
        yield made


def installer(tmp_path: Path, servers: Servers, gpus: list[dict[str, Any]], driver: str | None, **tools: str):
    facts = NodeFacts(arch="x86_64", driver_version=driver, gpus=tuple(gpus))
    return Installer(
        tmp_path / "state",
        facts=lambda: facts,
        tools={"package-index": servers.index.url, "python": sys.executable, "apt-get": "", **tools},
        retry_after=0,
    )


def converge(made: Installer, item: dict[str, Any]) -> dict[str, Any]:
    made.converge_sync(parse_desired_engines([item]))
    return made.report()


def leftovers(made: Installer) -> list[str]:
    return sorted(p.name for p in made.root.rglob(".staging-*"))


def test_a_gpu_node_installs_the_cuda13_wheel_from_the_release_with_torch_from_its_index(
    tmp_path: Path, servers: Servers
) -> None:
    made = installer(tmp_path, servers, [H100], "590.48.01", gcc="/nonexistent/gcc")
    report = converge(made, servers.item())

    (installed,) = report["installed"]
    assert installed["engine"] == "vllm" and installed["version"] == VERSION and installed["build"] == "cu130"
    assert installed["devices"] == ["NVIDIA H100 80GB HBM3"]
    env = Path(made.manifest["vllm"]["dir"])
    assert env == made.root / "vllm" / f"{VERSION}-cu130"
    # Built under a scratch name and renamed: the relocatable entry point runs from its new place.
    import subprocess

    out = subprocess.run([installed["path"]], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["vllm", f"{VERSION}+cu130"]
    # Resolved once, hash-pinned, kept in the environment and beside it for a reinstall.
    pinned = (env / pyenv.REQUIREMENTS).read_text()
    assert "torch==2.9.0+cu130" in pinned and f"vllm=={VERSION}+cu130" in pinned
    assert pinned.count("--hash=sha256:") == 2
    assert (made.root / "vllm" / ".locks" / f"{VERSION}-cu130.txt").read_text() == pinned
    assert made.manifest["vllm"]["torch"] == "2.9.0+cu130" and made.manifest["vllm"]["cuda"] == "13.0"
    # uv came from its release (sidecar checked), and is kept for the next install.
    assert any(r.endswith(".sha256") for r in servers.uv.requests)
    assert (made.root / ".tools" / f"uv-{uv_version()}" / "uv").is_file()
    # No gcc and no way to install it: a warning in the node's words, not a failure.
    assert report["status"]["vllm"].startswith("warning: no gcc on this node")
    assert made.binaries()["vllm"] == installed["path"]
    assert leftovers(made) == []


def test_a_driver_too_old_for_cuda13_gets_the_index_build_which_must_compute_on_the_gpu(
    tmp_path: Path, servers: Servers, built: dict[str, Path]
) -> None:
    made = installer(tmp_path, servers, [H100], "550.54.15")
    report = converge(made, servers.item())
    # The index's torch is a CPU build: it runs, but finds no GPU, so the environment is not used.
    status = report["status"]["vllm"]
    assert status.startswith("failed: ")
    assert "CUDA 13.0 (cu130): needs NVIDIA driver 580 or newer, this node has 550" in status
    assert "cu129: torch 2.9.0 (CUDA None) sees no GPU" in status
    assert report["installed"] == [] and leftovers(made) == []
    assert not (made.root / "vllm" / ".locks" / f"{VERSION}-cu129.txt").exists()

    with Servers(built, built["index_gpu"]) as gpu_index:
        made = installer(tmp_path / "again", gpu_index, [H100], "550.54.15")
        report = converge(made, gpu_index.item())
    (installed,) = report["installed"]
    assert installed["build"] == "cu129" and made.manifest["vllm"]["cuda"] == "12.9"
    assert report["status"] == {}  # gcc is on this machine


def test_the_nodes_build_choice_narrows_the_variants_and_a_failed_switch_keeps_the_working_one(
    tmp_path: Path, servers: Servers
) -> None:
    made = installer(tmp_path, servers, [H100], "590.48.01")
    assert converge(made, servers.item(build="cu13"))["installed"][0]["build"] == "cu130"
    working = made.binaries()["vllm"]

    # The operator asks for cu129 on this node; the index's torch cannot see the GPU.
    report = converge(made, servers.item(build="cu129"))
    assert "cu129: torch 2.9.0 (CUDA None) sees no GPU" in report["status"]["vllm"]
    assert "cu130" not in report["status"]["vllm"]  # not tried: the node is set to cu129
    assert report["installed"][0]["build"] == "cu130" and made.binaries()["vllm"] == working
    assert Path(working).exists()


@pytest.mark.parametrize(
    ("gpus", "driver", "min_compute", "expected"),
    [
        ([], None, "7.5", "unavailable: vLLM runs on NVIDIA or AMD GPUs and this node has neither"),
        ([V100], "550.54.15", "7.5", "vLLM needs compute capability 7.5 or newer; this node's oldest GPU is 7.0"),
    ],
)
def test_a_node_that_cannot_run_vllm_says_why_without_downloading_anything(
    tmp_path: Path, servers: Servers, gpus: list[dict[str, Any]], driver: str | None, min_compute: str, expected: str
) -> None:
    made = installer(tmp_path, servers, gpus, driver)
    report = converge(made, servers.item(min_compute=min_compute))
    assert report["status"]["vllm"].startswith("unavailable: ") and expected in report["status"]["vllm"]
    assert report["installed"] == []
    assert servers.uv.requests == [] and servers.index.requests == [] and servers.vllm.requests == []


def test_the_control_planes_reason_is_shown_as_it_is(tmp_path: Path, servers: Servers) -> None:
    made = installer(tmp_path, servers, [V100], "550.54.15")
    report = converge(made, servers.item(unsupported="no vLLM release is built for compute capability 6.0"))
    assert report["status"]["vllm"] == "unavailable: no vLLM release is built for compute capability 6.0"


def test_a_uv_sidecar_that_disagrees_is_refused_and_uv_comes_from_the_package_index(
    tmp_path: Path, servers: Servers, built: dict[str, Path]
) -> None:
    bad = tmp_path / "bad" / built["uv_sha"].name
    bad.parent.mkdir()
    bad.write_text("0" * 64 + f"  {built['uv_tar'].name}\n")
    servers.uv.files[bad.name] = bad
    shutil.copy2(built["uv_wheel"], built["index"] / built["uv_wheel"].name)
    try:
        made = installer(tmp_path, servers, [H100], "590.48.01")
        report = converge(made, servers.item())
    finally:
        (built["index"] / built["uv_wheel"].name).unlink()
    assert report["installed"][0]["build"] == "cu130"
    assert f"/files/{built['uv_wheel'].name}" in servers.index.requests
    assert not any(r.endswith(built["uv_tar"].name) for r in servers.uv.requests)  # never downloaded


def test_without_a_verified_uv_nothing_is_installed_and_the_reasons_are_named(
    tmp_path: Path, servers: Servers, built: dict[str, Path]
) -> None:
    servers.uv.digest_override[built["uv_tar"].name] = "sha256:" + "1" * 64
    made = installer(tmp_path, servers, [H100], "590.48.01")
    status = converge(made, servers.item())["status"]["vllm"]
    assert status.startswith("failed: cannot install uv: ")
    assert "the release's digest says 111111111111" in status
    assert f"uv from the package index: HTTP 404 Not Found from {servers.index.url}/uv/" in status
    assert made.report()["installed"] == [] and leftovers(made) == []


def test_a_damaged_environment_is_withdrawn_at_its_recheck_and_installed_again_from_its_lock(
    tmp_path: Path, servers: Servers
) -> None:
    from agent import doctor
    from agent.config import AgentConfig

    made = installer(tmp_path, servers, [H100], "590.48.01")
    item = servers.item()
    converge(made, item)
    env = Path(made.manifest["vllm"]["dir"])
    assert made.recheck_sync() == []
    config = AgentConfig(server="http://127.0.0.1:1", state_dir=tmp_path / "state", root=str(tmp_path))
    (check,) = doctor.engine_checks(config)
    assert check.name == "engine vllm" and check.status == "pass"
    assert check.detail == f"vllm {VERSION}+cu130 (cu130), torch 2.9.0+cu130 (CUDA 13.0) at {env}"
    for package in env.glob("lib/python*/site-packages/vllm"):
        shutil.rmtree(package)  # an unrelated upgrade, or a hand, removed the engine's files
    assert made.recheck_sync() == ["vllm"]
    status = made.report()["status"]["vllm"]
    assert status.startswith(f"failed: re-check of {VERSION} (cu130): vllm is not importable")
    assert "vllm" not in made.binaries()
    made.manifest["vllm"] = {"kind": "python", "dir": str(env), "path": str(env / "bin" / "vllm"), "version": VERSION}
    made._save()  # as it stood before the re-check: what doctor, run by hand, reads
    (check,) = doctor.engine_checks(config)
    assert check.status == "fail" and check.detail == f"{env}: vllm is not importable", check
    del made.manifest["vllm"]

    lock = made.root / "vllm" / ".locks" / f"{VERSION}-cu130.txt"
    lock.write_text(lock.read_text() + "# resolved on the first install\n")
    report = converge(made, item)
    assert report["installed"][0]["build"] == "cu130" and made.recheck_sync() == []
    # The kept list was installed as it was, not resolved again.
    assert (
        (Path(made.manifest["vllm"]["dir"]) / pyenv.REQUIREMENTS)
        .read_text()
        .endswith("# resolved on the first install\n")
    )


def test_a_wheel_with_a_wrong_digest_is_refused(tmp_path: Path, servers: Servers, built: dict[str, Path]) -> None:
    servers.vllm.digest_override[built["vllm_cu130"].name] = "sha256:" + "2" * 64
    made = installer(tmp_path, servers, [H100], "590.48.01")
    status = converge(made, servers.item(build="cu13"))["status"]["vllm"]
    assert f"cu130: digest mismatch for {built['vllm_cu130'].name}" in status
    assert made.report()["installed"] == []


def test_the_variants_are_read_off_the_release_listing() -> None:
    def asset(name: str) -> Asset:
        return Asset(name, 1, "0" * 64, (f"https://example/{name}",))

    listing = [
        asset("vllm-0.11.0+cu126-cp38-abi3-manylinux1_x86_64.whl"),
        asset("vllm-0.11.0+cu130-cp38-abi3-manylinux_2_35_x86_64.whl"),
        asset("vllm-0.11.0+cu130-cp38-abi3-manylinux_2_35_aarch64.whl"),
        asset("vllm-0.10.2+cu128-cp38-abi3-manylinux_2_28_x86_64.whl"),  # another version
        asset("vllm-0.11.0.tar.gz"),
    ]
    spec = pyenv.PythonEngine(torch_index="https://download.pytorch.org/whl/{variant}")
    variants = pyenv.parse_variants("vllm", "0.11.0", listing, "x86_64", spec)
    assert [(v.key, v.wheel.name if v.wheel else None) for v in variants] == [
        ("cu130", "vllm-0.11.0+cu130-cp38-abi3-manylinux_2_35_x86_64.whl"),
        ("cu129", None),
        ("cu126", "vllm-0.11.0+cu126-cp38-abi3-manylinux1_x86_64.whl"),
    ]
    assert variants[0].torch_index == "https://download.pytorch.org/whl/cu130"
    assert variants[1].torch_index is None  # the package index's own build and its torch

    facts = NodeFacts(arch="x86_64", driver_version="535.104.05", gpus=({"name": "NVIDIA A100-SXM4-80GB"},))
    chosen, skipped = pyenv.choose_variants(facts, variants, spec)
    assert [v.key for v in chosen] == ["cu129", "cu126"]
    assert skipped == ["CUDA 13.0 (cu130): needs NVIDIA driver 580 or newer, this node has 535"]
    chosen, skipped = pyenv.choose_variants(facts, variants, pyenv.PythonEngine(build="cu13"))
    assert chosen == [] and skipped == ["CUDA 13.0 (cu130): needs NVIDIA driver 580 or newer, this node has 535"]


def test_an_amd_node_takes_the_release_s_rocm_wheel_and_never_a_cuda_one() -> None:
    def asset(name: str) -> Asset:
        return Asset(name, 1, "0" * 64, (f"https://example/{name}",))

    listing = [
        asset("vllm-0.14.0+cu130-cp38-abi3-manylinux_2_35_x86_64.whl"),
        asset("vllm-0.14.0+rocm700-cp312-cp312-manylinux_2_35_x86_64.whl"),
    ]
    spec = pyenv.PythonEngine()
    variants = pyenv.parse_variants("vllm", "0.14.0", listing, "x86_64", spec)
    rocm = next(v for v in variants if v.rocm)
    assert (rocm.key, rocm.torch_index, rocm.label) == ("rocm700", None, "ROCm 7.0 (rocm700)")
    amd = NodeFacts(arch="x86_64", gpus=({"name": "AMD Instinct MI300X", "vendor": "amd"},))
    chosen, skipped = pyenv.choose_variants(amd, variants, spec)
    assert [v.key for v in chosen] == ["rocm700"] and skipped == []
    chosen, skipped = pyenv.choose_variants(amd, [v for v in variants if not v.rocm], spec)
    assert chosen == [] and skipped == [
        "vLLM on AMD GPUs needs a ROCm wheel (+rocmNNN); this release publishes cu130, cu129"
    ]
    nvidia = NodeFacts(arch="x86_64", driver_version="590.48.01", gpus=({"name": "NVIDIA H100 80GB HBM3"},))
    assert "rocm700" not in [v.key for v in pyenv.choose_variants(nvidia, variants, spec)[0]]


def test_sglang_is_built_the_same_way_and_started_as_its_python(tmp_path: Path, built: dict[str, Path]) -> None:
    engine_wheel(built["index_gpu"], "0.5.3", engine="sglang")
    with Servers(built, built["index_gpu"]) as made_servers:
        made = installer(tmp_path, made_servers, [H100], "550.54.15")
        item = made_servers.item() | {"engine": "sglang", "version": "0.5.3", "assets": []}
        report = converge(made, item)
    (installed,) = report["installed"]
    assert installed["engine"] == "sglang" and installed["build"] == "cu129"
    env = Path(made.manifest["sglang"]["dir"])
    assert installed["path"] == str(env / "bin" / "python")  # `python -m sglang.launch_server`
    import subprocess

    out = subprocess.run([installed["path"], "-m", "sglang.launch_server"], capture_output=True, text=True)
    assert out.stdout.strip() == "launch_server"
