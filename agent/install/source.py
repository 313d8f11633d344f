"""The last way to a CPU engine: compile llama.cpp from a source distribution on the node's
package index, where neither GitHub nor the control plane can give a release archive.

The control plane names the source with the engine (`{"package": "llama-cpp-python", "version":
"0.3.36", "sha256": ..., "subdir": "vendor/llama.cpp"}`); the agent finds the sdist on the node's
own package index (PEP 503 simple API: PIP_INDEX_URL, else pip.conf's index-url, else PyPI),
downloads it checked against that sha256, unpacks it with the same checks as a release archive,
and builds `llama-server` with CMake as scripts/ensure-llama-server does (portable x86-64 with
AVX2, static, server only): about 18 minutes on 2 cores, its progress reported from CMake's
"[ 45%]" (Make) or "[12/300]" (Ninja) lines. The result is verified like any build before it counts.
"""

from __future__ import annotations

import configparser
import contextlib
import html
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

__all__ = ["SourceBuild", "SourceError", "build", "find_sdist", "index_url", "parse_source"]

DEFAULT_INDEX = "https://pypi.org/simple"
BUILD_TIMEOUT_S = 3 * 3600.0
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


def build(
    source: SourceBuild,
    work: Path,
    *,
    tools: Mapping[str, str] | None = None,
    status: Callable[[str], None] | None = None,
) -> Path:
    """Fetch, check, unpack and compile; the built llama-server (inside `work`)."""
    say = status or (lambda text: None)
    missing = [tool for tool in ("cmake", "cc", "c++") if shutil.which((tools or {}).get(tool, tool)) is None]
    if missing:
        raise SourceError(f"building from source needs {', '.join(missing)} on the node (apt-get install cmake g++)")
    url = find_sdist(source, index_url(tools))
    name = url.rsplit("/", 1)[-1]
    work.mkdir(parents=True, exist_ok=True)
    archive = work / name

    def progress(done: int, total: int | None) -> None:
        from agent.install.fetch import progress_text

        say("installing: " + progress_text(name, done, total))

    try:
        download(url, archive, sha256=source.sha256, progress=progress)
    except FetchError as exc:
        raise SourceError(str(exc)) from None
    say(f"installing: unpacking {name}")
    tree = work / "src"
    extract(archive, tree, limits=SOURCE)
    archive.unlink()
    roots = [p for p in tree.iterdir() if p.is_dir()]
    cmake_root = (roots[0] if len(roots) == 1 else tree) / source.subdir
    if not (cmake_root / "CMakeLists.txt").is_file():
        raise SourceError(f"{name} has no {source.subdir}/CMakeLists.txt")
    cmake = (tools or {}).get("cmake", "cmake")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else ["-G", "Unix Makefiles"]
    out = work / "build"
    _run(
        [cmake, "-S", str(cmake_root), "-B", str(out), *generator, *CMAKE_FLAGS],
        work / "configure.log",
        say,
        "configuring",
    )
    jobs = str(os.cpu_count() or 2)
    _run([cmake, "--build", str(out), "--target", "llama-server", "-j", jobs], work / "build.log", say, "compiling")
    built = out / "bin" / "llama-server"
    if not built.is_file():
        found = [p for p in out.rglob("llama-server") if p.is_file() and os.access(p, os.X_OK)]
        if not found:
            raise SourceError("the build finished but made no llama-server")
        built = found[0]
    return built


def _run(argv: list[str], log: Path, say: Callable[[str], None], what: str) -> None:
    """Run one CMake step, its output to `log`, its progress ("[ 45%]") to `say`. When `say`
    raises (the agent is stopping) the step's whole process group is killed: no compiler is left."""
    say(f"installing: {what} llama.cpp")
    with open(log, "w") as handle:
        process = subprocess.Popen(  # noqa: S603 - argv built here
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True
        )
        try:
            code = _follow(process, handle, say, what)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise SourceError(f"{what} llama.cpp failed (exit code {code}): {tail[0][:300]}")


def _follow(process: subprocess.Popen[str], handle: Any, say: Callable[[str], None], what: str) -> int:
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
            say(f"installing: {what} llama.cpp ({last} %)")
    return process.wait(timeout=BUILD_TIMEOUT_S)
