"""The llama.cpp build a node picks, from captured nvidia-smi output and real asset names, and
what `--version` / `--list-devices` / ldd say."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent.install.builds import (
    Asset,
    NodeFacts,
    choose_builds,
    compute_capability,
    parse_assets,
)
from agent.install.verify import VerifyError, check, parse_devices, parse_version
from agent.probes import nvidia
from tests.agent.fixturefiles import fixture_files, read_text
from tests.enginebin import llama_server_path, missing_reason

TAG = "b11070"
# The Linux assets of a late-2026 release (names as the releases API lists them).
NAMES = [
    f"llama-{TAG}-bin-ubuntu-x64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-arm64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-vulkan-arm64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-cuda-13.3-x64.tar.gz",
    f"cudart-llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz",
    f"cudart-llama-{TAG}-bin-ubuntu-cuda-13.3-x64.tar.gz",
    f"llama-{TAG}-bin-ubuntu-rocm-7.2-x64.tar.gz",
    f"llama-{TAG}-bin-macos-arm64.tar.gz",
    "cudart-llama-bin-win-cuda-12.4-x64.zip",
    f"llama-{TAG}-bin-win-cpu-x64.zip",
]
ASSETS = [Asset(name=n, size=1, sha256="0" * 64, urls=(f"https://example/{n}",)) for n in NAMES]


def facts_from(path: Path) -> NodeFacts:
    text = read_text(path)
    report = nvidia.parse_nvidia_smi_xml(text) if path.suffix == ".xml" else nvidia.parse_nvidia_smi_text(text)
    gpus = [dataclasses.asdict(g) for g in report.gpus]
    return NodeFacts(os="linux", arch="x86_64", driver_version=report.driver_version, gpus=gpus)


def keys(facts: NodeFacts) -> list[str]:
    return [b.key for b in choose_builds(facts, ASSETS)[0]]


def test_a_cpu_node_gets_the_cpu_build_for_its_architecture() -> None:
    assert keys(NodeFacts(arch="x86_64")) == ["cpu-x64"]
    assert keys(NodeFacts(arch="aarch64")) == ["cpu-arm64"]
    builds, skipped = choose_builds(NodeFacts(arch="riscv64"), ASSETS)
    assert builds == [] and "riscv64" in skipped[0]


def test_the_cpu_build_needs_libgomp_from_the_os() -> None:
    (build,) = choose_builds(NodeFacts(), ASSETS)[0]
    assert build.packages == ("libgomp1",) and not build.gpu


@pytest.mark.parametrize("path", fixture_files("nvidia-smi-q") + fixture_files("nvidia-smi-q-xml"))
def test_a_gpu_node_never_gets_the_cpu_build_and_cuda_follows_driver_and_generation(path: Path) -> None:
    facts = facts_from(path)
    if not facts.nvidia:
        pytest.skip(f"{path.name}: no GPU and driver in this capture")
    builds, skipped = choose_builds(facts, ASSETS)
    names = [b.key for b in builds]
    assert "cpu-x64" not in names
    assert names[-1] == "vulkan-x64"  # the last resort, and a GPU build too
    assert all(b.gpu for b in builds)
    driver = facts.driver_major or 0
    ccs = [compute_capability(g) for g in facts.gpus]
    oldest = min(cc for cc in ccs if cc is not None) if any(ccs) else None
    if driver >= 580 and oldest is not None and oldest >= (7, 5):
        assert names[0] == "cuda-13.3-x64"
    else:
        assert "cuda-13.3-x64" not in names
        assert any("CUDA 13.3" in s for s in skipped)
    if driver < 525:
        assert "cuda-12.8-x64" not in names
    for build in builds:
        if build.key.startswith("cuda"):
            assert build.runtime is not None and build.runtime.name.startswith("cudart-")


def test_cuda_12_needs_driver_570_for_gpus_it_ships_only_as_ptx() -> None:
    blackwell = [{"name": "NVIDIA GeForce RTX 5090", "architecture": "Blackwell"}]
    hopper = [{"name": "NVIDIA H100 80GB HBM3", "architecture": "Hopper"}]
    assert "cuda-12.8-x64" not in keys(NodeFacts(driver_version="565.57.01", gpus=blackwell))
    assert "cuda-12.8-x64" in keys(NodeFacts(driver_version="570.86.10", gpus=blackwell))
    assert "cuda-12.8-x64" in keys(NodeFacts(driver_version="535.161.08", gpus=hopper))
    assert compute_capability(blackwell[0]) == (12, 0)
    assert compute_capability({"name": "NVIDIA B200", "architecture": "Blackwell"}) == (10, 0)
    assert compute_capability({"name": "Graphics Device", "architecture": "Volta"}) == (7, 0)
    assert compute_capability({"name": "Graphics Device"}) is None


def test_cuda_13_is_not_offered_to_volta() -> None:
    volta = [{"name": "Tesla V100-SXM2-16GB", "architecture": "Volta"}]
    builds, skipped = choose_builds(NodeFacts(driver_version="580.65.06", gpus=volta), ASSETS)
    assert [b.key for b in builds] == ["cuda-12.8-x64", "vulkan-x64"]
    assert any("compute capability 7.0" in s for s in skipped)


def test_no_cudart_archive_is_fetched_where_the_host_has_the_runtime() -> None:
    hopper = [{"name": "NVIDIA H100 80GB HBM3"}]
    builds, _ = choose_builds(NodeFacts(driver_version="580.65.06", gpus=hopper, has_cuda_runtime=True), ASSETS)
    assert builds[0].key == "cuda-13.3-x64" and builds[0].runtime is None


def test_assets_are_read_from_the_release_listing_with_their_digest() -> None:
    release = {
        "assets": [
            {
                "name": f"llama-{TAG}-bin-ubuntu-x64.tar.gz",
                "size": 16_900_000,
                "digest": "sha256:" + "AB" * 32,
                "browser_download_url": "https://github.com/x",
            },
            {"name": "nightly-tag.txt", "size": 7, "browser_download_url": "https://github.com/y"},
            "junk",
        ]
    }
    first, second = parse_assets(release)
    assert first.sha256 == "ab" * 32 and first.urls == ("https://github.com/x",) and first.size == 16_900_000
    assert second.sha256 is None


def test_zip_assets_of_older_releases_are_recognised() -> None:
    old = [Asset(name="llama-b6000-bin-ubuntu-x64.zip", size=1, sha256="0" * 64, urls=("u",))]
    assert [b.key for b in choose_builds(NodeFacts(), old)[0]] == ["cpu-x64"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: 0.3.0-dev (build 10807, commit 163a4079)\nbuilt with cc for x86_64\n", (10807, "163a4079")),
        ("version: 6500 (abc1234)\nbuilt with GNU 12.2.0 for x86_64-linux-gnu\n", (6500, "abc1234")),
        ("load_backend: loaded CPU backend\nversion: 0.5.0-dev (build 1, commit 0c1e570)\n", (1, "0c1e570")),
        ("usage: llama-server [options]\n", None),
    ],
)
def test_both_version_formats(text: str, expected: tuple[int, str] | None) -> None:
    assert parse_version(text) == expected


def test_devices_listed_or_none() -> None:
    assert parse_devices("Available devices:\n  (none)\n") == ()
    card = "NVIDIA H100 80GB HBM3 (81079 MiB, 80552 MiB free)"
    listed = f"Available devices:\n  CUDA0: {card}\n  CUDA1: {card}\n"
    assert len(parse_devices(listed)) == 2
    assert parse_devices("ggml_cuda_init: failed\n") == ()


def test_the_real_engine_passes_on_the_cpu_and_is_refused_as_a_gpu_build() -> None:
    binary = llama_server_path()
    if binary is None:
        pytest.skip(missing_reason())
    verified = check(binary, gpu=False)
    assert verified.version_line.startswith("version:") and verified.devices == ()
    with pytest.raises(VerifyError, match="--list-devices shows no GPU"):
        check(binary, gpu=True)


def test_a_file_that_is_not_a_program_is_refused(tmp_path: Path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'usage: nothing'\n")
    fake.chmod(0o755)
    with pytest.raises(VerifyError, match="printed no version"):
        check(fake, gpu=False)
    fake.write_text("#!/bin/sh\necho 'boom' >&2\nexit 3\n")
    with pytest.raises(VerifyError, match="exited with 3: boom"):
        check(fake, gpu=False)
    (tmp_path / "plain").write_text("x")
    with pytest.raises(VerifyError, match="not an executable file"):
        check(tmp_path / "plain", gpu=False)


MI300X = {"name": "AMD Instinct MI300X", "vendor": "amd", "gpu_class": "MI300X-192GB"}


def test_an_amd_node_gets_the_rocm_build_then_vulkan_and_never_the_cpu_build() -> None:
    amd = NodeFacts(arch="x86_64", gpus=(MI300X,), rocm_version="7.2.0")
    builds, skipped = choose_builds(amd, ASSETS)
    assert [b.key for b in builds] == ["rocm-7.2-x64", "vulkan-x64"] and all(b.gpu for b in builds)
    older = NodeFacts(arch="x86_64", gpus=(MI300X,), rocm_version="6.1.0-82")
    builds, skipped = choose_builds(older, ASSETS)
    assert [b.key for b in builds] == ["vulkan-x64"]
    assert skipped == ["ROCm 7.2: built for ROCm 7.2, this node has ROCm 6.1.0-82"]
    no_gpu_builds = [a for a in ASSETS if "rocm" not in a.name and "vulkan" not in a.name]
    builds, skipped = choose_builds(amd, no_gpu_builds)
    assert builds == [] and skipped[-1] == "the CPU build is never used on a node with AMD GPUs"


def test_a_rocm_or_vulkan_build_counts_only_once_it_lists_an_amd_card() -> None:
    listed = "ggml_cuda_init: found 0\nAvailable devices:\n  ROCm0: AMD Instinct MI300X (196592 MiB, 196400 MiB free)\n"
    assert parse_devices(listed) == ("ROCm0: AMD Instinct MI300X (196592 MiB, 196400 MiB free)",)
    vulkan = "Available devices:\n  Vulkan0: AMD Instinct MI300X (RADV GFX942) (196592 MiB, 196000 MiB free)\n"
    assert parse_devices(vulkan)[0].startswith("Vulkan0: AMD Instinct MI300X")
