"""What proves an unpacked llama.cpp engine works on this node.

- `missing_libraries(binary)`: `ldd`'s "=> not found" lines, named outright (a static binary
  has none); the build's other shared objects are looked for next to it, as its RUNPATH says.
- `parse_version(text)`: `llama-server --version` prints, to stderr, either
  "version: 0.3.0-dev (build 10807, commit 163a4079)" (current builds) or
  "version: 6500 (abc1234)" (older ones); the build number is the release tag's number.
- `parse_devices(text)`: `--list-devices` prints "Available devices:" and one line per device,
  or "(none)" when no GPU backend loaded (a CUDA build without its runtime runs on the CPU
  without failing: the reason a GPU build must show its GPU before it counts).

`check(binary, gpu=...)` runs all three and raises `VerifyError` with the first reason.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LIBRARY_SOURCES",
    "NOT_FOUND_RE",
    "Verified",
    "VerifyError",
    "check",
    "library_fix",
    "missing_libraries",
    "package_for",
    "parse_devices",
    "parse_version",
]

TIMEOUT_S = 20.0

# Libraries an engine may miss, and where each comes from: a Debian/Ubuntu package name, or
# (starting with "the ") a description of what provides it.
LIBRARY_SOURCES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), source)
    for pattern, source in (
        (r"^libgomp\.so\.1$", "libgomp1"),
        (r"^libvulkan\.so\.1$", "libvulkan1"),
        (r"^lib(ssl|crypto)\.so\.3$", "libssl3"),
        (r"^libstdc\+\+\.so\.6$", "libstdc++6"),
        (r"^libgcc_s\.so\.1$", "libgcc-s1"),
        (r"^libcurl\.so\.4$", "libcurl4"),
        (r"^libnuma\.so\.1$", "libnuma1"),
        (r"^libOpenCL\.so\.1$", "ocl-icd-libopencl1"),
        (r"^lib(cuda|nvidia-ml)\.so(\.1)?$", "the NVIDIA driver"),
        (r"^lib(cudart|cublas|cublasLt|curand|cusparse|nvrtc)\.so\.\d+", "the CUDA runtime archive for this build"),
        (r"^lib(amdhip64|hipblas|hipblaslt|rocblas|rocsolver|hsa-runtime64)\.so", "the ROCm runtime"),
    )
)


def library_fix(missing: Iterable[str]) -> str:
    """What to do about shared libraries ldd cannot find: the packages to install, where known."""
    packages: list[str] = []
    others: list[str] = []
    unknown: list[str] = []
    for library in missing:
        source = next((s for pattern, s in LIBRARY_SOURCES if pattern.match(library)), None)
        if source is None:
            if library not in unknown:
                unknown.append(library)
        elif source.startswith("the "):
            if source == "the NVIDIA driver":
                text = f"{library} comes with the NVIDIA driver: install the driver, or use a CPU build on this node"
            elif source == "the ROCm runtime":
                text = f"{library} comes with ROCm: install it (amdgpu-install --usecase=rocm), or use the Vulkan build"
            else:
                text = f"{library} comes with the CUDA runtime archive for this build: unpack it next to the binary"
            if text not in others:
                others.append(text)
        elif source not in packages:
            packages.append(source)
    parts = []
    if packages:
        names = " ".join(packages)
        parts.append(f"install {names}: apt-get install {names}")
    parts += others
    if unknown:
        parts.append(f"find the package that ships {', '.join(unknown)} (apt-file search), or reinstall the engine")
    return "; ".join(parts)


def package_for(library: str) -> str | None:
    """The Debian/Ubuntu package that ships `library`, None when not a package (or unknown)."""
    source = next((s for pattern, s in LIBRARY_SOURCES if pattern.match(library)), None)
    return None if source is None or source.startswith("the ") else source


_NEW_VERSION_RE = re.compile(
    r"version:\s*(?P<semver>\S+)\s*\(build\s+(?P<build>\d+),\s*commit\s+(?P<commit>[0-9a-f]+)\)"
)
_OLD_VERSION_RE = re.compile(r"version:\s*(?P<build>\d+)\s*\((?P<commit>[0-9a-f]+)\)")
NOT_FOUND_RE = re.compile(r"^\s*(\S+)\s*=>\s*not found", re.MULTILINE)


class VerifyError(Exception):
    """The engine cannot be used; str() says why, for the node's report."""


@dataclass(frozen=True)
class Verified:
    build: int | None  # llama.cpp build number (the tag's number); None when the build has none
    commit: str | None
    version_line: str
    devices: tuple[str, ...]  # the GPU devices `--list-devices` shows; () on a CPU build


def parse_version(text: str) -> tuple[int | None, str | None] | None:
    """(build, commit) from `--version`'s output, None when it says no version."""
    if match := _NEW_VERSION_RE.search(text):
        return int(match.group("build")), match.group("commit")
    if match := _OLD_VERSION_RE.search(text):
        return int(match.group("build")), match.group("commit")
    return None


def parse_devices(text: str) -> tuple[str, ...]:
    """The device lines after "Available devices:" ("CUDA0: NVIDIA H100 80GB HBM3 (81079 MiB, ...)")."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().lower().startswith("available devices"):
            found = []
            for rest in lines[i + 1 :]:
                item = rest.strip()
                if not item or item == "(none)":
                    continue
                if not rest.startswith((" ", "\t")):
                    break
                found.append(item)
            return tuple(found)
    return ()


def _run(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 - argv built here, no shell
        argv, capture_output=True, text=True, errors="replace", timeout=timeout, env=env, check=False
    )


def missing_libraries(binary: Path, *, ldd: str = "ldd", timeout: float = TIMEOUT_S) -> list[str]:
    """The shared objects `binary` needs and this node lacks (empty for a static binary)."""
    try:
        done = _run([ldd, str(binary)], timeout=timeout)
    except FileNotFoundError:
        return []  # no ldd (a minimal image): --version below still proves the binary loads
    except subprocess.TimeoutExpired:
        raise VerifyError(f"ldd {binary} did not finish in {timeout:.0f} s") from None
    return sorted(set(NOT_FOUND_RE.findall(done.stdout + done.stderr)))


def check(
    binary: Path,
    *,
    gpu: bool,
    ldd: str = "ldd",
    env: dict[str, str] | None = None,
    timeout: float = TIMEOUT_S,
) -> Verified:
    """Prove `binary` runs here (and, for a GPU build, sees a GPU), or raise VerifyError."""
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise VerifyError(f"{binary} is not an executable file")
    missing = missing_libraries(binary, ldd=ldd, timeout=timeout)
    if missing:
        named = ", ".join(f"{lib} (package {package_for(lib)})" if package_for(lib) else lib for lib in missing)
        raise VerifyError(f"missing shared libraries: {named}")
    run_env = dict(os.environ if env is None else env)
    try:
        done = _run([str(binary), "--version"], timeout=timeout, env=run_env)
    except subprocess.TimeoutExpired:
        raise VerifyError(f"{binary.name} --version did not finish in {timeout:.0f} s") from None
    except OSError as exc:
        raise VerifyError(f"{binary.name} cannot start: {exc.strerror or exc}") from None
    out = done.stdout + done.stderr
    if done.returncode != 0:
        last = (out.strip().splitlines() or [""])[-1][:300]
        raise VerifyError(f"{binary.name} --version exited with {done.returncode}: {last}")
    version = parse_version(out)
    if version is None:
        raise VerifyError(f"{binary.name} --version printed no version: {out.strip()[:200]!r}")
    line = next((x.strip() for x in out.splitlines() if x.strip().startswith("version:")), "")
    devices: tuple[str, ...] = ()
    if gpu:
        try:
            listed = _run([str(binary), "--list-devices"], timeout=timeout, env=run_env)
        except subprocess.TimeoutExpired:
            raise VerifyError(f"{binary.name} --list-devices did not finish in {timeout:.0f} s") from None
        devices = parse_devices(listed.stdout + listed.stderr)
        if not devices:
            raise VerifyError(
                f"{binary.name} --list-devices shows no GPU: this build would run on the CPU "
                "(its GPU backend did not load: the CUDA or ROCm runtime, the Vulkan loader or the driver missing)"
            )
    return Verified(build=version[0], commit=version[1], version_line=line, devices=devices)
