"""Which llama.cpp build a node should run, from what only the node knows.

A release (GitHub's `releases/tags/<tag>` answer, relayed by the control plane) lists assets
named `llama-<tag>-bin-<os>[-<backend>]-<arch>.<ext>`; the extension is read off the name
(`.zip` in 2025, `.tar.gz` since). `choose_builds(facts, assets)` gives the builds this node
may run, best first:

- a node with an NVIDIA driver: CUDA 13.x (driver >= 580, Turing or newer: CUDA 13 dropped
  Maxwell, Pascal and Volta), then CUDA 12.x (driver >= 525 where the build carries the GPU's
  own code, >= 570 where it ships that GPU only as PTX, which the driver must compile), then
  Vulkan; never the CPU build, which would run a GPU node's models on its processor without
  a word;
- a node with AMD GPUs: the ROCm (HIP) build (`…-ubuntu-rocm-<ver>-<arch>`, newest first, not
  one for a ROCm newer than the node's), then Vulkan; never the CPU build either;
- any other Linux node: the CPU build for its architecture (x64 or arm64).

A CUDA build also needs the CUDA runtime (`libcudart`, `libcublas`): when the host has none,
the release's `cudart-llama-<tag>-bin-ubuntu-cuda-<ver>-<arch>` archive is installed with it.
Each build names the OS packages it needs from the node's own package sources.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Asset",
    "Build",
    "NodeFacts",
    "choose_builds",
    "compute_capability",
    "parse_assets",
]

#: Driver floors (see the reference table: CUDA 12.x minor-version compatibility needs 525,
#: PTX compiled for 12.8 needs the 12.8 GA driver 570; CUDA 13.x needs 580).
CUDA12_DRIVER = 525
CUDA12_PTX_DRIVER = 570
CUDA13_DRIVER = 580

#: GPU generations the CUDA 12 release builds carry compiled code for (compute capability,
#: major and minor); any other generation runs from PTX and needs CUDA12_PTX_DRIVER.
CUDA12_REAL_ARCHS = frozenset({(7, 5), (8, 0), (8, 6), (8, 9), (9, 0)})

#: nvidia-smi's "Product Architecture" -> the lowest compute capability of that generation.
ARCHITECTURE_CC = {
    "kepler": (3, 5),
    "maxwell": (5, 0),
    "pascal": (6, 0),
    "volta": (7, 0),
    "turing": (7, 5),
    "ampere": (8, 0),
    "ada lovelace": (8, 9),
    "ada": (8, 9),
    "hopper": (9, 0),
    "blackwell": (10, 0),
}

#: Product names -> compute capability, for drivers that print no architecture. First match wins.
_NAME_CC: tuple[tuple[re.Pattern[str], tuple[int, int]], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cc)
    for pattern, cc in (
        (r"\bRTX PRO \d+ Blackwell|RTX 50\d0\b", (12, 0)),
        (r"\b(B200|B100|GB200|B300|GB300)\b", (10, 0)),
        (r"\b(H100|H200|H800|H20|GH200)\b", (9, 0)),
        (r"\b(L4|L40S?|RTX 40\d0|RTX \d+ Ada|RTX 4000 SFF Ada)\b", (8, 9)),
        (r"\b(A10G?|A16|A2|A40|RTX A\d+|RTX 30\d0)\b", (8, 6)),
        (r"\b(A100|A800|A30)\b", (8, 0)),
        (r"\b(T4|RTX 20\d0|Quadro RTX|TITAN RTX|GTX 16\d0)\b", (7, 5)),
        (r"\b(V100|TITAN V)\b", (7, 0)),
        (r"\b(P100|P40|P4|P2000|P400|GTX 10\d0|TITAN X)\b", (6, 0)),
        (r"\b(M60|M40|GTX 9\d0)\b", (5, 0)),
        (r"\b(K80|K40|GTX 6\d0|GTX 7\d0)\b", (3, 0)),
    )
)

_ASSET_RE = re.compile(
    r"^llama-(?P<tag>b\d+)-bin-ubuntu-(?:(?P<backend>cuda)-(?P<cuda>\d+\.\d+)-|(?P<vulkan>vulkan)-"
    r"|(?P<rocm>rocm|hip)-(?P<rocm_version>\d+\.\d+)-)?"
    r"(?P<arch>x64|arm64)\.(?P<ext>tar\.gz|tgz|tar\.xz|zip)$"
)
_CUDART_RE = re.compile(
    r"^cudart-llama-(?P<tag>b\d+)-bin-ubuntu-cuda-(?P<cuda>\d+\.\d+)-(?P<arch>x64|arm64)\.(?P<ext>tar\.gz|tgz|tar\.xz|zip)$"
)
_ARCH = {"x86_64": "x64", "amd64": "x64", "x64": "x64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class Asset:
    """One downloadable file of a release."""

    name: str
    size: int | None
    sha256: str | None  # bare hex; None when the release publishes no digest (never installed)
    urls: tuple[str, ...]  # where to fetch it, best first (the control plane's copy, then GitHub)


@dataclass(frozen=True)
class Build:
    """One way this node could run llama.cpp."""

    key: str  # "cuda-13.3-x64", "cuda-12.8-x64", "vulkan-x64", "cpu-x64"
    asset: Asset
    gpu: bool  # the install must see a GPU in `--list-devices` before it counts
    runtime: Asset | None = None  # the CUDA runtime archive, when the host has none
    packages: tuple[str, ...] = ()  # OS packages the build needs (Debian names)


@dataclass
class NodeFacts:
    """What the build choice reads: the agent's own hardware report."""

    os: str = "linux"
    arch: str = "x86_64"
    cpu_flags: frozenset[str] = frozenset()
    driver_version: str | None = None  # NVIDIA driver, "550.54.15"; None on a node without one
    gpus: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    has_cuda_runtime: bool = False  # libcudart and libcublas found on the host
    rocm_version: str | None = None  # the ROCm release installed ("6.1.0"); None: none or not read

    @classmethod
    def from_hardware(
        cls, hardware: Mapping[str, Any], *, has_cuda_runtime: bool = False, system: str | None = None
    ) -> NodeFacts:
        """From the agent's hardware report; `system` is platform.system() (the report's "os" is
        the distribution's name, "Debian GNU/Linux 12 (bookworm)")."""
        return cls(
            os=(system or platform.system() or "linux").lower(),
            arch=str(hardware.get("arch") or "x86_64"),
            cpu_flags=frozenset(hardware.get("cpu_flags") or ()),
            driver_version=hardware.get("driver_version") or None,
            gpus=tuple(hardware.get("gpus") or ()),
            has_cuda_runtime=has_cuda_runtime,
            rocm_version=hardware.get("rocm_version") or None,
        )

    @property
    def driver_major(self) -> int | None:
        if not self.driver_version:
            return None
        match = re.match(r"(\d+)", self.driver_version)
        return int(match.group(1)) if match else None

    @property
    def nvidia(self) -> bool:
        return self.driver_version is not None and any(g.get("vendor", "nvidia") == "nvidia" for g in self.gpus)

    @property
    def amd(self) -> bool:
        """Whether the node has AMD GPUs (amd-smi or rocm-smi listed some)."""
        return any(g.get("vendor") == "amd" for g in self.gpus)


def compute_capability(gpu: Mapping[str, Any]) -> tuple[int, int] | None:
    """The GPU's compute capability from its product name, else its architecture (which does not
    tell a B200, 10.0, from an RTX 5090, 12.0); None when neither says."""
    name = str(gpu.get("name") or "")
    for pattern, cc in _NAME_CC:
        if pattern.search(name):
            return cc
    architecture = str(gpu.get("architecture") or "").strip().lower()
    return ARCHITECTURE_CC.get(architecture)


def parse_assets(release: Mapping[str, Any]) -> list[Asset]:
    """The assets of a GitHub release answer (`digest` is "sha256:<hex>"; assets without one
    are kept, with sha256 None, so the refusal can name them)."""
    assets = []
    for item in release.get("assets") or ():
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            continue
        digest = item.get("digest")
        sha256 = None
        if isinstance(digest, str) and digest.lower().startswith("sha256:"):
            sha256 = digest.split(":", 1)[1].lower()
        urls = item.get("urls")
        if not isinstance(urls, list):
            url = item.get("browser_download_url")
            urls = [url] if isinstance(url, str) else []
        size = item.get("size")
        assets.append(
            Asset(
                name=item["name"],
                size=size if isinstance(size, int) and not isinstance(size, bool) else None,
                sha256=sha256,
                urls=tuple(u for u in urls if isinstance(u, str)),
            )
        )
    return assets


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def choose_builds(facts: NodeFacts, assets: Iterable[Asset]) -> tuple[list[Build], list[str]]:
    """The builds this node may run, best first, and why the others were passed over."""
    arch = _ARCH.get(facts.arch.lower())
    skipped: list[str] = []
    if facts.os != "linux":
        return [], [f"llama.cpp builds are installed on Linux nodes; this node runs {facts.os}"]
    if arch is None:
        return [], [f"no llama.cpp build for the {facts.arch} architecture"]
    cpu: Asset | None = None
    vulkan: Asset | None = None
    cuda: dict[str, Asset] = {}
    rocm: dict[str, Asset] = {}
    runtimes: dict[str, Asset] = {}
    for asset in assets:
        if match := _ASSET_RE.match(asset.name):
            if match.group("arch") != arch:
                continue
            if match.group("backend"):
                cuda[match.group("cuda")] = asset
            elif match.group("rocm"):
                rocm[match.group("rocm_version")] = asset
            elif match.group("vulkan"):
                vulkan = asset
            else:
                cpu = asset
        elif (match := _CUDART_RE.match(asset.name)) and match.group("arch") == arch:
            runtimes[match.group("cuda")] = asset
    builds: list[Build] = []
    if facts.amd and not facts.nvidia:
        return _amd_builds(facts, arch, rocm, vulkan)
    if not facts.nvidia:
        if cpu is None:
            skipped.append(f"the release has no CPU build for {arch}")
        else:
            builds.append(Build(key=f"cpu-{arch}", asset=cpu, gpu=False, packages=("libgomp1",)))
        return builds, skipped

    driver = facts.driver_major
    ccs = [compute_capability(gpu) for gpu in facts.gpus]
    known = [cc for cc in ccs if cc is not None]
    oldest = min(known) if known else None
    for version in sorted(cuda, key=_version_key, reverse=True):
        major = _version_key(version)[0]
        label = f"CUDA {version}"
        if major >= 13:
            if driver is None or driver < CUDA13_DRIVER:
                skipped.append(f"{label}: needs NVIDIA driver {CUDA13_DRIVER} or newer, this node has {driver}")
                continue
            if oldest is not None and oldest < (7, 5):
                skipped.append(f"{label}: no longer supports compute capability {oldest[0]}.{oldest[1]}")
                continue
        elif major == 12:
            ptx_only = any(cc not in CUDA12_REAL_ARCHS for cc in known) or not known
            floor = CUDA12_PTX_DRIVER if ptx_only else CUDA12_DRIVER
            if driver is None or driver < floor:
                why = " for GPUs it ships only as PTX" if ptx_only else ""
                skipped.append(f"{label}: needs NVIDIA driver {floor} or newer{why}, this node has {driver}")
                continue
        else:
            skipped.append(f"{label}: too old a CUDA for this release's builds")
            continue
        runtime = None if facts.has_cuda_runtime else runtimes.get(version)
        if runtime is None and not facts.has_cuda_runtime:
            skipped.append(f"{label}: the host has no CUDA runtime and the release has no cudart archive for it")
            continue
        builds.append(
            Build(key=f"cuda-{version}-{arch}", asset=cuda[version], gpu=True, runtime=runtime, packages=("libgomp1",))
        )
    if vulkan is not None:
        builds.append(Build(key=f"vulkan-{arch}", asset=vulkan, gpu=True, packages=("libgomp1", "libvulkan1")))
    else:
        skipped.append(f"the release has no Vulkan build for {arch}")
    if not builds:
        skipped.append("the CPU build is never used on a node with NVIDIA GPUs")
    return builds, skipped


def _amd_builds(
    facts: NodeFacts, arch: str, rocm: dict[str, Asset], vulkan: Asset | None
) -> tuple[list[Build], list[str]]:
    """A node with AMD GPUs: the ROCm builds it can run (not one for a newer ROCm than the node
    has), newest first, then Vulkan; the CPU build never, which would run its models on the CPU.
    Each build counts only once `--list-devices` shows the cards (verify.check)."""
    builds: list[Build] = []
    skipped: list[str] = []
    have = (
        _version_key(facts.rocm_version.split("-")[0])
        if facts.rocm_version and _ROCM_RE.match(facts.rocm_version)
        else None
    )
    for version in sorted(rocm, key=_version_key, reverse=True):
        if have is not None and have[:2] < _version_key(version)[:2]:
            skipped.append(f"ROCm {version}: built for ROCm {version}, this node has ROCm {facts.rocm_version}")
            continue
        builds.append(Build(key=f"rocm-{version}-{arch}", asset=rocm[version], gpu=True, packages=("libgomp1",)))
    if not rocm:
        skipped.append(f"the release has no ROCm build for {arch}")
    if vulkan is not None:
        builds.append(Build(key=f"vulkan-{arch}", asset=vulkan, gpu=True, packages=("libgomp1", "libvulkan1")))
    else:
        skipped.append(f"the release has no Vulkan build for {arch}")
    if not builds:
        skipped.append("the CPU build is never used on a node with AMD GPUs")
    return builds, skipped


_ROCM_RE = re.compile(r"^\d+\.\d+(?:\.\d+)?(?:-\S*)?$")
