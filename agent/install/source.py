"""The last way to a CPU engine: compile llama.cpp from a source distribution on the node's
package index, where neither GitHub nor the control plane can give a release archive.

The control plane names the source with the engine (`{"package": "llama-cpp-python", "version":
"0.3.36", "sha256": ..., "subdir": "vendor/llama.cpp"}`); the agent finds the sdist on the node's
own package index (PEP 503 simple API: PIP_INDEX_URL, else pip.conf's index-url, else PyPI),
downloads it checked against that sha256, unpacks it with the same checks as a release archive,
and builds `llama-server` with CMake (portable x86-64 with AVX2, static): only that target and
what it links, the CPU backend, no tests, examples or Python binding, with as many jobs as the
node has cores it may use (its affinity and cgroup quota, `usable_cores`). Its progress is
reported from CMake's "[ 45%]" (Make) or "[12/300]" (Ninja) lines, after the time it is expected
to take (`expected_minutes`, from the build measured in bench/engines.py). The result is verified
like any build before it counts.

The unpacked source and the CMake build tree are kept under `cache` (the installer's
`engines/.source-builds/<sha256[:16]>/`), so installing from the same source again (another
release tag, an install the re-check withdrew) rebuilds only what changed: seconds. Only the
current source's tree is kept. Where ccache is on PATH the compiler results are cached in it too
(`cache/ccache`); where it is not, the status says so.
"""

from __future__ import annotations

import configparser
import contextlib
import html
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.install.archive import SOURCE, extract
from agent.install.fetch import FetchError, download

__all__ = [
    "SourceBuild",
    "SourceError",
    "build",
    "cmake_flags",
    "expected_minutes",
    "find_sdist",
    "index_url",
    "parse_source",
    "usable_cores",
]

log = logging.getLogger("llmgw.agent.install")

DEFAULT_INDEX = "https://pypi.org/simple"
BUILD_TIMEOUT_S = 3 * 3600.0
#: The CPU time (user + system, all jobs together) the build of llama-server from the
#: llama-cpp-python 0.3.36 sdist takes with CMAKE_FLAGS, measured by bench/engines.py on an
#: x86-64 machine (gcc 12): the wall time is about this divided by the jobs, on an idle machine.
BUILD_CPU_MINUTES = 36.0
#: A rebuild of a kept tree with nothing changed: CMake's configure check and Ninja's (or Make's) look.
REBUILD_MINUTES = 1.0
#: Where a kept tree is complete (the source unpacked whole).
_UNPACKED = ".unpacked"
#: What scripts/ensure-llama-server passes to CMake: a portable, static, server-only build.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
#: Progress as Make prints it ("[ 45%] Building ...") and as Ninja does ("[12/300] Building ...").
_PERCENT_RE = re.compile(r"^\[\s*(\d{1,3})%\]")
_STEPS_RE = re.compile(r"^\[(\d+)/(\d+)\]")
_HREF_RE = re.compile(r"""<a\s[^>]*href=["']([^"']+)["'][^>]*>([^<]+)</a>""", re.IGNORECASE)


class SourceError(Exception):
    """The source build could not be made; str() says why."""


@dataclass(frozen=True)
class SourceBuild:
    package: str
    version: str
    sha256: str
    subdir: str = "vendor/llama.cpp"
    # The control plane allows a compiled build in place of an archive the node refused.
    after_refusal: bool = False

    @property
    def key(self) -> str:
        return f"source-{self.package}-{self.version}"


def parse_source(item: Any) -> SourceBuild | None:
    if not isinstance(item, Mapping):
        return None
    try:
        return SourceBuild(
            package=str(item["package"]),
            version=str(item["version"]),
            sha256=str(item["sha256"]).lower(),
            subdir=str(item.get("subdir") or "vendor/llama.cpp"),
            after_refusal=item.get("after_refusal") is True,
        )
    except KeyError:
        return None


def index_url(tools: Mapping[str, str] | None = None) -> str:
    """The node's package index: agent.yaml's tools.package-index, PIP_INDEX_URL, pip.conf, PyPI."""
    if tools and tools.get("package-index"):
        return tools["package-index"].rstrip("/")
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].rstrip("/")
    for path in ("/etc/pip.conf", "~/.config/pip/pip.conf", "~/.pip/pip.conf"):
        parser = configparser.ConfigParser()
        try:
            parser.read(os.path.expanduser(path))
        except configparser.Error:
            continue
        if parser.has_option("global", "index-url"):
            return parser.get("global", "index-url").rstrip("/")
    return DEFAULT_INDEX


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_sdist(source: SourceBuild, index: str, *, timeout: float = 30.0) -> str:
    """The sdist's URL on the index's simple page for the package."""
    page = f"{index}/{_normalise(source.package)}/"
    request = urllib.request.Request(page, headers={"Accept": "text/html", "User-Agent": "llmgw-agent"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - the node's own index
            text = answer.read(32 * 1024 * 1024).decode("utf-8", "replace")
    except OSError as exc:
        raise SourceError(f"cannot read {page}: {getattr(exc, 'reason', exc)}") from None
    wanted = {
        f"{source.package.replace('-', '_')}-{source.version}.tar.gz",
        f"{source.package}-{source.version}.tar.gz",
    }
    for href, text_name in _HREF_RE.findall(text):
        if html.unescape(text_name).strip() in wanted:
            return urllib.parse.urljoin(page, html.unescape(href)).split("#", 1)[0]
    raise SourceError(f"{page} lists no {' or '.join(sorted(wanted))}")


def usable_cores(root: str = "/sys/fs/cgroup") -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 quota (a
    container given 2 of a host's 64 cores builds with 2 jobs, not 64)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = Path(root, "cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        pass
    return max(1, cores)


def expected_minutes(jobs: int) -> int:
    """About how long a build from nothing takes with `jobs` jobs on an idle machine (the build
    does not speed up much past 8: a few large files are compiled last, one job each)."""
    return max(1, math.ceil(BUILD_CPU_MINUTES / min(max(1, jobs), 8)))


def cmake_flags(ccache: bool = False) -> list[str]:
    """What CMake is given: CMAKE_FLAGS, and whether ccache wraps the compiler."""
    return [*CMAKE_FLAGS, f"-DGGML_CCACHE={'ON' if ccache else 'OFF'}"]


def build(
    source: SourceBuild,
    work: Path,
    *,
    tools: Mapping[str, str] | None = None,
    status: Callable[[str], None] | None = None,
    cache: Path | None = None,
    jobs: int | None = None,
) -> Path:
    """Fetch, check, unpack and compile; the built llama-server (inside `work`, or inside the tree
    kept under `cache` for this source's digest, which `work` never holds)."""
    say = status or (lambda text: None)
    tools = tools or {}
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which(tools.get(tool, tool)) is None]
    if missing:
        raise SourceError(f"building from source needs {', '.join(missing)} on the node (apt-get install cmake g++)")
    home = _home(source, work, cache)
    cmake_root = _unpacked(source, home, work, tools, say)
    jobs = jobs or usable_cores()
    out = home / "build"
    kept = (out / "CMakeCache.txt").is_file()
    ccache = shutil.which(tools.get("ccache", "ccache")) is not None
    env = dict(os.environ, CCACHE_DIR=str(cache / "ccache")) if ccache and cache is not None else None
    if kept:
        expect = f"the build of this source is kept from before: about {REBUILD_MINUTES:g} min"
    else:
        expect = f"expected about {expected_minutes(jobs)} min with {jobs} jobs"
    expect += "; ccache caches the compiler's results" if ccache else "; no ccache on this node"
    log.info("building llama.cpp from %s %s: %s", source.package, source.version, expect)
    cmake = tools.get("cmake", "cmake")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else ["-G", "Unix Makefiles"]
    steps = (
        ([cmake, "-S", str(cmake_root), "-B", str(out), *generator, *cmake_flags(ccache)], "configuring"),
        ([cmake, "--build", str(out), "--target", "llama-server", "-j", str(jobs)], "compiling"),
    )
    try:
        for argv, what in steps:
            _run(argv, work / f"{what}.log", say, what, expect, env)
    except SourceError:
        if not kept:
            raise
        # A kept tree that no longer builds (another generator, a compiler upgrade): once from nothing.
        shutil.rmtree(out, ignore_errors=True)
        for argv, what in steps:
            _run(argv, work / f"{what}.log", say, what, f"expected about {expected_minutes(jobs)} min", env)
    return _built(out)


def _home(source: SourceBuild, work: Path, cache: Path | None) -> Path:
    """Where the source is unpacked and built: `cache/<sha256[:16]>` (the only tree kept there
    besides ccache's), else `work`."""
    if not re.fullmatch(r"[0-9a-f]{64}", source.sha256):
        raise SourceError(f"malformed sha256 for {source.package} {source.version}: {source.sha256[:80]!r}")
    subdir = Path(source.subdir)
    if subdir.is_absolute() or ".." in subdir.parts:
        raise SourceError(f"the source's subdir {source.subdir[:300]!r} leaves the source tree")
    work.mkdir(parents=True, exist_ok=True)
    if cache is None:
        return work
    home = cache / source.sha256[:16]
    if cache.is_dir():
        for other in cache.iterdir():
            if other.name in (home.name, "ccache"):
                continue
            if other.is_dir() and not other.is_symlink():
                shutil.rmtree(other, ignore_errors=True)
            else:
                other.unlink(missing_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    return home


def _unpacked(
    source: SourceBuild, home: Path, work: Path, tools: Mapping[str, str], say: Callable[[str], None]
) -> Path:
    """The CMake root of the source: kept from before when its tree was unpacked whole, else
    found on the package index, downloaded against its digest and unpacked."""
    tree = home / "src"
    marker = home / _UNPACKED
    if marker.is_file() and marker.read_text().strip() == source.sha256:
        return _cmake_root(tree, source)
    marker.unlink(missing_ok=True)
    for stale in (tree, home / "build"):  # what a killed unpack or an older source left
        shutil.rmtree(stale, ignore_errors=True)
    url = find_sdist(source, index_url(tools))
    name = url.rsplit("/", 1)[-1]
    archive = work / name

    def progress(done: int, total: int | None) -> None:
        from agent.install.fetch import progress_text

        say("installing: " + progress_text(name, done, total))

    try:
        download(url, archive, sha256=source.sha256, progress=progress)
    except FetchError as exc:
        raise SourceError(str(exc)) from None
    say(f"installing: unpacking {name}")
    extract(archive, tree, limits=SOURCE)
    archive.unlink()
    root = _cmake_root(tree, source)
    marker.write_text(source.sha256 + "\n")
    return root


def _cmake_root(tree: Path, source: SourceBuild) -> Path:
    roots = [p for p in tree.iterdir() if p.is_dir()] if tree.is_dir() else []
    cmake_root = (roots[0] if len(roots) == 1 else tree) / source.subdir
    if not (cmake_root / "CMakeLists.txt").is_file():
        raise SourceError(f"{source.package} {source.version} has no {source.subdir}/CMakeLists.txt")
    return cmake_root


def _built(out: Path) -> Path:
    built = out / "bin" / "llama-server"
    if built.is_file():
        return built
    found = [p for p in out.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)]
    if not found:
        raise SourceError("the build finished but made no llama-server")
    return found[0]


def _run(
    argv: list[str],
    log_path: Path,
    say: Callable[[str], None],
    what: str,
    expect: str = "",
    env: Mapping[str, str] | None = None,
) -> None:
    """Run one CMake step, its output to `log_path`, its progress ("[ 45%]") to `say` with what
    is expected of the whole build. When `say` raises (the agent is stopping) the step's whole
    process group is killed: no compiler is left."""
    suffix = f"; {expect}" if expect else ""
    say(f"installing: {what} llama.cpp ({expect})" if expect else f"installing: {what} llama.cpp")
    with open(log_path, "w") as handle:
        process = subprocess.Popen(  # noqa: S603 - argv built here
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            env=None if env is None else dict(env),
        )
        try:
            code = _follow(process, handle, lambda percent: say(f"installing: {what} llama.cpp ({percent} %{suffix})"))
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise SourceError(f"{what} llama.cpp failed (exit code {code}): {tail[0][:300]}")


def _follow(process: subprocess.Popen[str], handle: Any, said: Callable[[int], None]) -> int:
    assert process.stdout is not None
    last = -1
    for line in process.stdout:
        handle.write(line)
        percent = None
        if match := _PERCENT_RE.match(line):
            percent = int(match.group(1))
        elif (match := _STEPS_RE.match(line)) and int(match.group(2)) > 0:
            percent = int(match.group(1)) * 100 // int(match.group(2))
        if percent is not None and percent != last:
            last = percent
            said(last)
    return process.wait(timeout=BUILD_TIMEOUT_S)
