"""The last way to a CPU engine: compiled on the node from a source distribution found on its own
package index (a local server of ours speaking the simple API), when no release archive can be had.
The source is a tiny CMake project standing in for llama.cpp's: the same steps, built for real."""

from __future__ import annotations

import functools
import hashlib
import shutil
import tarfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.install.builds import NodeFacts
from agent.install.manager import Installer, parse_desired_engines
from agent.install.source import index_url

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("cmake", "cc", "c++")), reason="needs cmake and a C/C++ compiler"
)

SERVER_C = r"""
#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--version")) {
            fprintf(stderr, "version: 0.0.1-dev (build 7, commit abc1234)\nbuilt with cc for test\n");
            return 0;
        }
        if (!strcmp(argv[i], "--list-devices")) { printf("Available devices:\n  (none)\n"); return 0; }
    }
    return 1;
}
"""
CMAKE = """cmake_minimum_required(VERSION 3.13)
project(tiny C)
option(LLAMA_BUILD_SERVER "" ON)
add_executable(llama-server server.c)
set_target_properties(llama-server PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""


def sdist(folder: Path, version: str = "0.0.1") -> Path:
    root = folder / f"llama_cpp_python-{version}"
    (root / "vendor" / "llama.cpp").mkdir(parents=True)
    (root / "vendor" / "llama.cpp" / "CMakeLists.txt").write_text(CMAKE)
    (root / "vendor" / "llama.cpp" / "server.c").write_text(SERVER_C)
    (root / "PKG-INFO").write_text(f"Metadata-Version: 2.1\nName: llama-cpp-python\nVersion: {version}\n")
    archive = folder / "packages" / f"llama_cpp_python-{version}.tar.gz"
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, root.name)
    return archive


@pytest.fixture
def index(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A PEP 503 simple index at /simple/, its files under /packages/."""
    top = tmp_path / "index"
    top.mkdir()
    archive = sdist(top)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    page = top / "simple" / "llama-cpp-python"
    page.mkdir(parents=True)
    page.joinpath("index.html").write_text(
        f'<html><body><a href="../../packages/{archive.name}#sha256={digest}">{archive.name}</a></body></html>'
    )
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(SimpleHTTPRequestHandler, directory=str(top)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/simple", archive
    httpd.shutdown()


def wanted(digest: str) -> list:
    return parse_desired_engines(
        [
            {
                "engine": "llama.cpp",
                "version": "b10991",
                "note": "the control plane cannot read release b10991: cannot reach https://api.github.com",
                "unreachable": True,
                "source": {"package": "llama-cpp-python", "version": "0.0.1", "sha256": digest},
            }
        ]
    )


def test_a_cpu_node_compiles_its_engine_when_no_release_can_be_had(tmp_path: Path, index: tuple[str, Path]) -> None:
    url, archive = index
    seen: list[str] = []
    engines: Installer
    engines = Installer(
        tmp_path / "state",
        facts=lambda: NodeFacts(arch="x86_64"),
        tools={"package-index": url, "apt-get": ""},
        on_change=lambda: seen.append(str(engines.report()["status"].get("llama.cpp"))),
    )
    engines.converge_sync(wanted(hashlib.sha256(archive.read_bytes()).hexdigest()))
    (entry,) = engines.report()["installed"]
    assert entry["build"] == "source-llama-cpp-python-0.0.1-x64" and entry["version"] == "b10991"
    assert engines.report()["status"] == {}
    assert any("compiling llama.cpp (100 %)" in s for s in seen), seen
    assert engines.recheck_sync() == []  # it passes the same checks as any build
    # It stands in for release b10991 but is not it: the node reports what its --version says.
    assert engines.versions() == {"llama.cpp": "0.0.1-dev (build 7, commit abc1234), source-llama-cpp-python-0.0.1-x64"}


def test_a_source_whose_digest_differs_is_not_built(tmp_path: Path, index: tuple[str, Path]) -> None:
    url, _ = index
    engines = Installer(
        tmp_path / "state", facts=lambda: NodeFacts(arch="x86_64"), tools={"package-index": url}, retry_after=3600
    )
    engines.converge_sync(wanted("0" * 64))
    status = engines.report()["status"]["llama.cpp"]
    assert status.startswith("failed: the control plane cannot read release b10991"), status
    assert "; source-llama-cpp-python-0.0.1: digest mismatch for llama_cpp_python-0.0.1.tar.gz" in status
    assert engines.binaries() == {}


def test_a_gpu_node_never_compiles_a_cpu_engine(tmp_path: Path, index: tuple[str, Path]) -> None:
    url, archive = index
    gpus = [{"name": "NVIDIA H100 80GB HBM3", "architecture": "Hopper"}]
    engines = Installer(
        tmp_path / "state",
        facts=lambda: NodeFacts(driver_version="580.65.06", gpus=gpus),
        tools={"package-index": url},
        retry_after=3600,
    )
    engines.converge_sync(wanted(hashlib.sha256(archive.read_bytes()).hexdigest()))
    assert engines.binaries() == {}
    # Nothing on the node failed: it waits for the control plane to read the release's CUDA builds.
    status = engines.report()["status"]["llama.cpp"]
    assert status.startswith("waiting: the control plane cannot read release b10991"), status
    assert "source" not in status


def test_the_package_index_is_the_nodes_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple/")
    assert index_url() == "https://mirror.example/simple"
    assert index_url({"package-index": "http://local/simple"}) == "http://local/simple"
    monkeypatch.delenv("PIP_INDEX_URL")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".config" / "pip").mkdir(parents=True)
    (tmp_path / ".config" / "pip" / "pip.conf").write_text("[global]\nindex-url = https://pip.corp/simple\n")
    if not Path("/etc/pip.conf").exists():
        assert index_url() == "https://pip.corp/simple"


def test_a_compiled_engine_gives_way_to_the_release_once_it_can_be_had(tmp_path: Path, index: tuple[str, Path]) -> None:
    from tests.engine_releases import ReleaseServer, llama_tarball
    from tests.enginebin import llama_server_path

    server = llama_server_path()
    if server is None:
        pytest.skip("no llama-server binary")
    url, archive = index
    engines = Installer(
        tmp_path / "state", facts=lambda: NodeFacts(arch="x86_64"), tools={"package-index": url, "apt-get": ""}
    )
    engines.converge_sync(wanted(hashlib.sha256(archive.read_bytes()).hexdigest()))
    assert engines.report()["installed"][0]["build"].startswith("source-")
    with ReleaseServer() as github:
        github.add("b10991", llama_tarball(tmp_path / "release", "b10991", server=server))
        (item,) = parse_desired_engines(
            [{"engine": "llama.cpp", "version": "b10991", "assets": github.release("b10991")["assets"]}]
        )
        engines.converge_sync([item])
    assert engines.report()["installed"][0]["build"] == "cpu-x64" and engines.report()["status"] == {}


def test_stopping_the_agent_ends_a_build_under_way_and_leaves_no_compiler(
    tmp_path: Path, index: tuple[str, Path]
) -> None:
    """An 18-minute compile must not hold the agent's exit: stop() ends it at its next progress
    line and kills the build's whole process group (a stand-in CMake that runs a child for minutes)."""
    import os
    import time

    url, archive = index
    cmake = tmp_path / "cmake"
    pid_file = tmp_path / "child.pid"
    cmake.write_text(
        "#!/bin/sh\n"
        'case "$1" in --build) ;; *) exit 0 ;; esac\n'
        f"sleep 300 & echo $! > {pid_file}\n"
        'i=0; while [ $i -lt 600 ]; do i=$((i+1)); echo "[ $((i % 100))%] Building CXX object x$i.o"; sleep 0.1; done\n'
    )
    cmake.chmod(0o755)
    engines = Installer(
        tmp_path / "state",
        facts=lambda: NodeFacts(arch="x86_64"),
        tools={"package-index": url, "cmake": str(cmake), "apt-get": ""},
        retry_after=3600,
    )
    worker = threading.Thread(
        target=engines.converge_sync, args=(wanted(hashlib.sha256(archive.read_bytes()).hexdigest()),)
    )
    worker.start()
    deadline = time.monotonic() + 60
    while "compiling" not in str(engines.report()["status"].get("llama.cpp")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "compiling" in str(engines.report()["status"].get("llama.cpp"))
    engines.stop()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert engines.report()["status"]["llama.cpp"].startswith("failed: ")
    assert "stopped: the agent is stopping" in engines.report()["status"]["llama.cpp"]
    child = int(pid_file.read_text())
    for _ in range(50):  # killed with its group; reaped by init
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the build's child {child} still runs")
    assert engines.binaries() == {}
