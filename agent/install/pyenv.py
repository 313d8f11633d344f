"""vLLM and SGLang: Python environments built by uv, checked before they count.

An engine of this kind is not an archive but an environment of several gigabytes. The agent
builds it as it installs a llama.cpp archive, under a scratch name, and renames it into place
only once it works:

1. **uv** comes from its GitHub release (`uv-<triple>.tar.gz`, checked against the release's
   `<asset>.sha256` and GitHub's `digest`), relayed by the control plane, or else from the
   node's package index (the `uv` wheel, checked against the index's sha256). It is kept under
   `<state_dir>/engines/.tools/uv-<version>/`.
2. **The variant** (`choose_variants`): which CUDA build of the engine this node can run, from
   its driver and GPUs. CUDA 13 needs driver 580 and compute capability 7.5; CUDA 12.x needs
   525. The build the package index publishes (`vllm==V`, CUDA 12.9 today) needs no listing;
   the others are the release's own wheels (`vllm-V+cu130-…-manylinux_2_28_x86_64.whl`, read
   off the listing, never built from a template), with torch from PyTorch's index for that
   variant. The control plane's per-node choice (auto, cu13, cu129) narrows the list.
3. **The environment**: `uv venv --relocatable` on Python 3.12 (uv installs the interpreter at
   a fixed path, `<state_dir>/python`, since `pyvenv.cfg` keeps it absolute); the requirements
   resolved once with `uv pip compile --generate-hashes` and installed with `--require-hashes`;
   the resolved list kept in the environment (`llmgw-requirements.txt`) and reused when the
   same version and variant are installed again, so a reinstall gets the same packages.
4. **The check**: the environment's Python imports the engine and reports its version; on a
   GPU node torch must see the GPUs and compute on them, or the variant is not used.
5. `gcc` is installed with it (Triton compiles its launcher at the first model load); where it
   cannot be, that is a warning, not a failure.

What a node cannot do (no NVIDIA GPU, a driver too old for every variant) is said in the
engine's status and the node stays usable for everything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import bounded
from agent.bounded import size_text
from agent.install.builds import Asset, NodeFacts, compute_capability, parse_assets

__all__ = [
    "CHECK_SCRIPT",
    "PACKAGES",
    "PythonEngine",
    "PythonError",
    "UvTool",
    "Variant",
    "choose_variants",
    "entry_point",
    "parse_python_engine",
    "parse_variants",
    "uv_asset",
]

#: Engine -> the package that provides it.
PACKAGES = {"vllm": "vllm", "sglang": "sglang"}
#: Engine -> what the supervisor starts, relative to the environment (`vllm serve …`;
#: `python -m sglang.launch_server …`).
ENTRY_POINTS = {"vllm": "bin/vllm", "sglang": "bin/python"}
#: Driver floors by CUDA major (minor-version compatibility: 12.x from 525, 13.x from 580).
DRIVER_FLOOR = {12: 525, 13: 580}
#: CUDA 13 dropped Maxwell, Pascal and Volta.
CUDA13_MIN_COMPUTE = (7, 5)
PYTHON_VERSION = "3.12"
UV_TIMEOUT_S = 3 * 3600.0
CHECK_TIMEOUT_S = 900.0
RECHECK_TIMEOUT_S = 120.0
REQUIREMENTS = "llmgw-requirements.txt"
#: The most a binary taken out of a wheel (uv's) may unpack to: uv is tens of megabytes.
MAX_WHEEL_BINARY = 512 * 2**20
_UV_TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "amd64": "x86_64-unknown-linux-gnu"}
_UV_TRIPLES |= {"aarch64": "aarch64-unknown-linux-gnu", "arm64": "aarch64-unknown-linux-gnu"}
_WHEEL_ARCH = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_VARIANT_RE = re.compile(r"^cu(\d{2})(\d)$")
_HREF_RE = re.compile(r"""<a\s[^>]*href=["']([^"']+)["'][^>]*>([^<]+)</a>""", re.IGNORECASE)

#: Run in the environment's own Python: import the engine, report its version and, on a GPU
#: node, prove torch sees the GPUs and computes on the first one. One JSON line on stdout.
CHECK_SCRIPT = r"""
import importlib, importlib.metadata as md, json, sys
package, gpu = sys.argv[1], sys.argv[2] == "1"
out = {"version": md.version(package)}
try:
    importlib.import_module(package)
except Exception as exc:
    out["error"] = f"import {package} failed: {type(exc).__name__}: {exc}"[:500]
    print(json.dumps(out)); sys.exit(0)
if gpu:
    import torch
    out["torch"] = getattr(torch, "__version__", None)
    out["cuda"] = getattr(getattr(torch, "version", None), "cuda", None)
    out["hip"] = getattr(getattr(torch, "version", None), "hip", None)
    if not torch.cuda.is_available():
        runtime = ("HIP %s" % out["hip"]) if out["hip"] else ("CUDA %s" % out["cuda"])
        out["error"] = "torch %s (%s) sees no GPU" % (out["torch"], runtime)
        print(json.dumps(out)); sys.exit(0)
    try:
        x = torch.ones((256, 256), device="cuda")
        total = (x @ x).sum().item()
        torch.cuda.synchronize()
    except Exception as exc:
        out["error"] = f"torch could not compute on the GPU: {type(exc).__name__}: {exc}"[:500]
        print(json.dumps(out)); sys.exit(0)
    if total != 256 * 256 * 256:
        out["error"] = "torch computed a wrong result on the GPU (%r)" % (total,)
    out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(json.dumps(out))
"""

#: The cheap re-check every ten minutes: the interpreter runs and the engine's files are there.
RECHECK_SCRIPT = r"""
import importlib.metadata as md, importlib.util, json, sys
package = sys.argv[1]
out = {"version": md.version(package)}
if importlib.util.find_spec(package) is None:
    out["error"] = f"{package} is not importable"
print(json.dumps(out))
"""


class PythonError(Exception):
    """One variant (or uv) could not be installed; str() is the reason."""


@dataclass(frozen=True)
class Variant:
    """One CUDA build of a Python engine."""

    key: str  # "cu130", "cu129"
    cuda_major: int
    wheel: Asset | None = None  # the release's own wheel; None: the package index's build
    torch_index: str | None = None  # an extra index for torch (PyTorch's, for a release wheel)

    @property
    def label(self) -> str:
        if self.rocm:
            digits = self.key[4:]
            return f"ROCm {digits[0]}.{digits[1:2] or '0'} ({self.key})"
        return f"CUDA {self.key[2:-1]}.{self.key[-1]} ({self.key})"

    @property
    def rocm(self) -> bool:
        """A build for AMD GPUs (``+rocm700``): it carries its own torch."""
        return self.key.startswith("rocm")


@dataclass(frozen=True)
class PythonEngine:
    """What the control plane says of a vLLM or SGLang install on this node."""

    index_variant: str = "cu129"  # the CUDA build the package index publishes
    torch_index: str = "https://download.pytorch.org/whl/{variant}"
    build: str = "auto"  # the node's choice: auto, cu13, cu129
    min_compute: tuple[int, int] = (7, 5)
    min_free_bytes: int = 0
    uv_version: str | None = None
    uv_assets: tuple[Asset, ...] = ()
    unsupported: str | None = None  # the control plane's reason this node cannot have it


def _compute(text: Any) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)\.(\d+)$", str(text or ""))
    return (int(match.group(1)), int(match.group(2))) if match else None


def parse_python_engine(item: Mapping[str, Any]) -> PythonEngine:
    given = item.get("uv")
    uv: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    build = str(item.get("build") or "auto")
    free = item.get("min_free_bytes")
    return PythonEngine(
        index_variant=str(item.get("index_variant") or "cu129"),
        torch_index=str(item.get("torch_index") or PythonEngine.torch_index),
        build=build if build in ("auto", "cu13", "cu129") else "auto",
        min_compute=_compute(item.get("min_compute")) or (7, 5),
        min_free_bytes=free if isinstance(free, int) and not isinstance(free, bool) and free > 0 else 0,
        uv_version=str(uv.get("version")) if uv.get("version") else None,
        uv_assets=tuple(parse_assets({"assets": uv.get("assets") or []})),
        unsupported=str(item["unsupported"]) if item.get("unsupported") else None,
    )


def entry_point(engine: str, env: Path) -> Path:
    return env / ENTRY_POINTS[engine]


# --------------------------------------------------------------------------- variants


def _variant_major(key: str) -> int | None:
    match = _VARIANT_RE.match(key)
    return int(match.group(1)) if match else None


def parse_variants(engine: str, version: str, assets: Iterable[Asset], arch: str, spec: PythonEngine) -> list[Variant]:
    """The builds of this version there are for this architecture: the package index's, and
    each `+cuNNN` wheel the release lists."""
    package = PACKAGES[engine]
    wheel_arch = _WHEEL_ARCH.get(arch.lower())
    pattern = re.compile(
        rf"^{re.escape(package)}-{re.escape(version)}\+(cu\d{{3}}|rocm\d{{2,4}})-[^-]+-[^-]+-(?:[A-Za-z0-9_.]*_)?"
        rf"{re.escape(wheel_arch or '-')}\.whl$"
    )
    variants: dict[str, Variant] = {}
    index_major = _variant_major(spec.index_variant)
    if index_major is not None:
        variants[spec.index_variant] = Variant(spec.index_variant, index_major)
    for asset in assets:
        match = pattern.match(asset.name)
        if not match or match.group(1) in variants:
            continue
        key = match.group(1)
        if key.startswith("rocm"):
            variants[key] = Variant(key, 0, wheel=asset)  # the ROCm wheel brings the torch it was built with
            continue
        major = _variant_major(key)
        if major is None:
            continue
        variants[key] = Variant(key, major, wheel=asset, torch_index=spec.torch_index.replace("{variant}", key))
    return sorted(variants.values(), key=lambda v: v.key, reverse=True)


def choose_variants(
    facts: NodeFacts, variants: Sequence[Variant], spec: PythonEngine, engine: str = "vllm"
) -> tuple[list[Variant], list[str]]:
    """The variants this node may run, best first, and why the others were passed over. An empty
    first list with reasons means the node cannot have the engine (a warning, not a fault)."""
    name = {"vllm": "vLLM", "sglang": "SGLang"}.get(engine, engine)
    if facts.os != "linux":
        return [], [f"{name} is installed on Linux nodes; this node runs {facts.os}"]
    if _WHEEL_ARCH.get(facts.arch.lower()) is None:
        return [], [f"no {name} build for the {facts.arch} architecture"]
    if facts.amd and not facts.nvidia:
        return _rocm_variants(name, variants)
    if not facts.nvidia:
        return [], [f"{name} runs on NVIDIA or AMD GPUs and this node has neither"]
    driver = facts.driver_major
    known = [cc for cc in (compute_capability(gpu) for gpu in facts.gpus) if cc is not None]
    oldest = min(known) if known else None
    if oldest is not None and oldest < spec.min_compute:
        floor = ".".join(map(str, spec.min_compute))
        have = f"{oldest[0]}.{oldest[1]}"
        return [], [f"{name} needs compute capability {floor} or newer; this node's oldest GPU is {have}"]
    wanted = {"auto": None, "cu13": 13, "cu129": 12}[spec.build]
    chosen, skipped = [], []
    for variant in variants:
        if variant.rocm:
            continue  # for AMD GPUs, which this node has none of
        if wanted == 13 and variant.cuda_major != 13:
            continue
        if wanted == 12 and variant.key != "cu129":
            continue
        driver_floor = DRIVER_FLOOR.get(variant.cuda_major)
        if driver_floor is None:
            skipped.append(f"{variant.label}: not a CUDA this agent knows the driver floor of")
            continue
        if driver is None or driver < driver_floor:
            skipped.append(f"{variant.label}: needs NVIDIA driver {driver_floor} or newer, this node has {driver}")
            continue
        if variant.cuda_major >= 13 and oldest is not None and oldest < CUDA13_MIN_COMPUTE:
            skipped.append(f"{variant.label}: no longer supports compute capability {oldest[0]}.{oldest[1]}")
            continue
        chosen.append(variant)
    if not chosen and wanted is not None and not skipped:
        have = ", ".join(v.key for v in variants) or "none"
        skipped.append(f"this node is set to the {spec.build} build, which this release does not publish ({have})")
    return chosen, skipped


def _rocm_variants(name: str, variants: Sequence[Variant]) -> tuple[list[Variant], list[str]]:
    """A node with AMD GPUs runs the ROCm wheels of the release, newest first (the package index's
    build is CUDA's); the environment's check proves torch computes on the card before it counts."""
    chosen = sorted((v for v in variants if v.rocm), key=lambda v: v.key, reverse=True)
    if chosen:
        return chosen, []
    have = ", ".join(v.key for v in variants) or "none"
    return [], [f"{name} on AMD GPUs needs a ROCm wheel (+rocmNNN); this release publishes {have}"]


# --------------------------------------------------------------------------- uv


def uv_asset(assets: Iterable[Asset], arch: str) -> tuple[Asset | None, Asset | None]:
    """The uv release archive for this architecture and its `.sha256` sidecar."""
    triple = _UV_TRIPLES.get(arch.lower())
    if triple is None:
        return None, None
    by_name = {asset.name: asset for asset in assets}
    archive = by_name.get(f"uv-{triple}.tar.gz")
    return archive, (by_name.get(archive.name + ".sha256") if archive else None)


def parse_sidecar(text: str, name: str) -> str:
    """`<hex>  <name>` (or a bare hex) -> the hex; PythonError when it is neither."""
    parts = text.strip().split()
    if not parts or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
        raise PythonError(f"{name}.sha256 is not a sha256 line: {text[:80]!r}")
    if len(parts) > 1 and parts[1].lstrip("*") != name:
        raise PythonError(f"{name}.sha256 names another file: {parts[1][:80]!r}")
    return parts[0].lower()


def find_index_wheel(package: str, version: str, arch: str, index: str, *, opener: Callable[[str], str]) -> Asset:
    """The package's wheel for this architecture on the node's package index (simple API), with
    the sha256 the index gives in the link."""
    import html
    import urllib.parse

    page = f"{index.rstrip('/')}/{package}/"
    text = opener(page)
    wheel_arch = _WHEEL_ARCH.get(arch.lower(), arch)
    for href, label in _HREF_RE.findall(text):
        name = html.unescape(label).strip()
        if not name.startswith(f"{package}-{version}-") or not name.endswith(".whl"):
            continue
        if "manylinux" not in name or not name.endswith(f"_{wheel_arch}.whl") or "musl" in name:
            continue
        url = urllib.parse.urljoin(page, html.unescape(href))
        url, _, fragment = url.partition("#")
        digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        return Asset(name=name, size=None, sha256=digest, urls=(url,))
    raise PythonError(f"{page} lists no {package} {version} wheel for {wheel_arch}")


def binary_from_wheel(wheel: Path, dest: Path, name: str = "uv") -> Path:
    """Take the `<pkg>-<v>.data/scripts/<name>` binary out of a wheel (one member, by name), its
    bytes counted as they are inflated and stopped past the size it declares (at most
    MAX_WHEEL_BINARY); PythonError says why it cannot be had."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            pattern = rf"[^/]+\.data/scripts/{re.escape(name)}"
            members = [m for m in archive.infolist() if re.fullmatch(pattern, m.filename)]
            if not members:
                raise PythonError(f"{wheel.name} holds no {name} binary")
            member = members[0]
            if member.file_size > MAX_WHEEL_BINARY:
                raise PythonError(
                    f"{wheel.name}: {name} is {member.file_size:,} bytes, more than {size_text(MAX_WHEEL_BINARY)}"
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, open(dest, "wb") as out:
                bounded.copy(source, out.write, limit=member.file_size, what=f"{wheel.name}: {name}")
    except bounded.TooLarge as exc:
        raise PythonError(f"{exc}, the size it declares") from None
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise PythonError(f"{wheel.name} cannot be read: {exc}") from None
    dest.chmod(0o755)
    return dest


@dataclass
class UvTool:
    """uv, and how it is run for this node (its package index, caches and interpreter)."""

    binary: Path
    state_dir: Path
    index: str | None = None
    python: str | None = None  # agent.yaml's tools.python: an interpreter uv must use as is

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            UV_CACHE_DIR=str(self.state_dir / "uv-cache"),
            UV_PYTHON_INSTALL_DIR=str(self.state_dir / "python"),
            UV_NO_PROGRESS="1",
            UV_NO_CONFIG="1",
        )
        if self.python:
            env["UV_PYTHON_DOWNLOADS"] = "never"
        for key in ("VIRTUAL_ENV", "UV_PYTHON", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_DEFAULT_INDEX", "UV_INDEX"):
            env.pop(key, None)
        return env

    def index_args(self, variant: Variant, find_links: Path | None) -> list[str]:
        args = ["--index-url", self.index] if self.index else []
        if variant.torch_index:
            args += ["--extra-index-url", variant.torch_index]
        if find_links is not None:
            args += ["--find-links", str(find_links)]
        return args


def run_logged(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log: Path,
    say: Callable[[str], None],
    what: str,
    timeout: float = UV_TIMEOUT_S,
) -> None:
    """Run one step, its output to `log` and its latest line to `say` ("installing: <what>:
    Downloading torch (846.0MiB)"). When `say` raises (the agent is stopping) the step's process
    group is killed."""
    say(f"installing: {what}")
    with open(log, "a") as handle:
        handle.write("$ " + " ".join(argv) + "\n")
        handle.flush()
        process = subprocess.Popen(  # noqa: S603 - argv built here
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=dict(env),
            start_new_session=True,
        )
        assert process.stdout is not None
        last = ""
        try:
            for line in process.stdout:
                handle.write(line)
                text = line.strip()
                if text != last and text.startswith(
                    ("Downloading", "Resolved", "Prepared", "Installed", "Building", "Built")
                ):
                    last = text
                    say(f"installing: {what}: {text[:200]}")
            code = process.wait(timeout=timeout)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if code != 0:
        lines = [line for line in log.read_text(errors="replace").strip().splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines[-1:] or [""]
        raise PythonError(f"{what} failed (exit code {code}): {errors[-1].strip()[:400]}")


def run_check(
    python: Path, package: str, *, gpu: bool, script: str = CHECK_SCRIPT, timeout: float = CHECK_TIMEOUT_S
) -> dict[str, Any]:
    """Run a check script in the environment's Python; its JSON answer, or PythonError."""
    try:
        done = subprocess.run(  # noqa: S603 - argv built here
            [str(python), "-c", script, package, "1" if gpu else "0"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")},
        )
    except subprocess.TimeoutExpired:
        raise PythonError(f"{python} did not finish its check within {timeout:g} s") from None
    except OSError as exc:
        raise PythonError(f"cannot run {python}: {exc.strerror or exc}") from None
    last = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    try:
        answer = json.loads(last[0]) if last else None
    except ValueError:
        answer = None
    if done.returncode != 0 or not isinstance(answer, dict):
        tail = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
        raise PythonError(f"{python.name} exited with {done.returncode}: {tail[:400]}")
    if answer.get("error"):
        raise PythonError(str(answer["error"]))
    return answer
