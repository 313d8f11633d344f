"""The last way to a CPU engine: compiled on the node from a source distribution found on its own
package index (a local server of ours speaking the simple API), when no release archive can be had.
The source is a tiny CMake project standing in for llama.cpp's: the same steps, built for real."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import shutil
import tarfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from agent.install.builds import NodeFacts
from agent.install.manager import Installer, parse_desired_engines
from agent.install.source import SourceError, index_url

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
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
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
    # It stands in for release b10991 and is reported as what it is: built from the source.
    assert entry["build"] == "source-llama-cpp-python-0.0.1-x64" and entry["version"] == "llama-cpp-python 0.0.1 source"
    assert engines.report()["status"] == {}
    assert any("compiling llama.cpp (100 %" in s for s in seen), seen
    # The time it takes is said before it starts, with whether a compiler cache helps.
    assert any(s.startswith("installing: configuring llama.cpp (expected about ") for s in seen), seen
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


def _release(folder: Path, tag: str, *, escape: bool = False) -> Path:
    """A small CPU release archive of `tag` (its llama-server is never run: it is refused first),
    with a member that leaves the install directory when `escape`."""
    import io

    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in ((f"llama-{tag}/llama-server", b"#!/bin/sh\n"), (f"llama-{tag}/../../escaped", b"x")):
            if name.endswith("escaped") and not escape:
                continue
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return archive


def offered(github: Any, tag: str, digest: str, *, after_refusal: bool = False) -> list:
    """The control plane's entry for a CPU node: the release's archive, and the source to compile."""
    source = {"package": "llama-cpp-python", "version": "0.0.1", "sha256": digest, "after_refusal": after_refusal}
    return parse_desired_engines(
        [{"engine": "llama.cpp", "version": tag, "assets": github.release(tag)["assets"], "source": source}]
    )


def downloads(github: Any) -> list[str]:
    return [path for path in github.requests if path.startswith("/objects/")]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("digest", "refused: cpu-x64: digest mismatch for llama-b10991-bin-ubuntu-x64.tar.gz"),
        ("path", "refused: cpu-x64: member llama-b10991/../../escaped leaves the install directory"),
    ],
)
def test_a_refused_archive_is_not_replaced_by_a_compile_and_the_refusal_stays(
    tmp_path: Path, index: tuple[str, Path], fault: str, reason: str
) -> None:
    """It once fell through to the source build, and the node then reported nothing wrong."""
    from agent import doctor
    from agent.config import AgentConfig
    from tests.engine_releases import ReleaseServer

    url, sdist_file = index
    digest = hashlib.sha256(sdist_file.read_bytes()).hexdigest()
    with ReleaseServer() as github:
        archive = _release(tmp_path / "release", "b10991", escape=fault == "path")
        github.add("b10991", archive)
        if fault == "digest":
            github.digest_override[archive.name] = "sha256:" + "0" * 64
        engines = Installer(
            tmp_path / "state",
            facts=lambda: NodeFacts(arch="x86_64"),
            tools={"package-index": url, "apt-get": ""},
            retry_after=0,
        )
        engines.converge_sync(offered(github, "b10991", digest))
        status = engines.report()["status"]["llama.cpp"]
        assert status.startswith(reason), status
        assert status.endswith(
            "; not compiled from llama-cpp-python 0.0.1 in its place: the control plane allows that only "
            "with LLMGW_ENGINE_SOURCE_AFTER_REFUSAL"
        ), status
        assert engines.binaries() == {} and engines.report()["installed"] == []
        assert not (tmp_path / "state" / "engines" / ".source-builds").exists()  # nothing was compiled
        fetched = downloads(github)
        assert len(fetched) == 1
        # The next pass: the same offer is not fetched again, and the words stay.
        engines.converge_sync(offered(github, "b10991", digest))
        assert downloads(github) == fetched and engines.report()["status"]["llama.cpp"] == status
    assert not (tmp_path / "escaped").exists()
    # `llmgw doctor` on the node says it too.
    (check,) = doctor.install_checks(AgentConfig(server="http://127.0.0.1:1", state_dir=tmp_path / "state"))
    assert (check.name, check.status, check.detail) == ("install llama.cpp", "fail", status)
    assert "llmgw engine-files" in check.fix


def test_a_refused_archive_is_compiled_over_only_where_the_control_plane_allows_it_and_stays_said(
    tmp_path: Path, index: tuple[str, Path]
) -> None:
    from tests.engine_releases import ReleaseServer, llama_tarball
    from tests.enginebin import llama_server_path

    server = llama_server_path()
    if server is None:
        pytest.skip("no llama-server binary")
    url, sdist_file = index
    digest = hashlib.sha256(sdist_file.read_bytes()).hexdigest()
    with ReleaseServer() as github:
        archive = llama_tarball(tmp_path / "release", "b10991", server=server)
        github.add("b10991", archive)
        github.digest_override[archive.name] = "sha256:" + "0" * 64
        engines = Installer(
            tmp_path / "state",
            facts=lambda: NodeFacts(arch="x86_64"),
            tools={"package-index": url, "apt-get": ""},
            retry_after=0,
        )
        engines.converge_sync(offered(github, "b10991", digest, after_refusal=True))
        status = engines.report()["status"]["llama.cpp"]
        assert status.startswith("refused: cpu-x64: digest mismatch for llama-b10991-bin-ubuntu-x64.tar.gz"), status
        assert status.endswith(
            "; running llama.cpp compiled from llama-cpp-python 0.0.1 in its place, as the control plane allows "
            "(LLMGW_ENGINE_SOURCE_AFTER_REFUSAL)"
        ), status
        # What runs is what is reported: the compiled build, not release b10991.
        (entry,) = engines.report()["installed"]
        assert entry["build"] == "source-llama-cpp-python-0.0.1-x64"
        assert entry["version"] == "llama-cpp-python 0.0.1 source"
        assert engines.versions() == {
            "llama.cpp": "0.0.1-dev (build 7, commit abc1234), source-llama-cpp-python-0.0.1-x64"
        }
        # Later passes keep the compiled build and the refusal, without fetching the same file again.
        fetched = downloads(github)
        engines.converge_sync(offered(github, "b10991", digest, after_refusal=True))
        assert engines.report()["status"]["llama.cpp"] == status and downloads(github) == fetched
        # A good archive offered at last replaces the compiled build, and the refusal is over.
        github.digest_override.clear()
        engines.converge_sync(offered(github, "b10991", digest, after_refusal=True))
    assert engines.report()["status"] == {}
    assert engines.report()["installed"][0]["build"] == "cpu-x64"


def test_the_same_source_is_not_built_twice(tmp_path: Path, index: tuple[str, Path]) -> None:
    """A new release tag with the same source (or an install the re-check withdrew) reuses the tree
    kept for the source's digest: nothing is downloaded or compiled again."""
    url, sdist_file = index
    digest = hashlib.sha256(sdist_file.read_bytes()).hexdigest()
    seen: list[str] = []
    engines: Installer
    engines = Installer(
        tmp_path / "state",
        facts=lambda: NodeFacts(arch="x86_64"),
        tools={"package-index": url, "apt-get": ""},
        on_change=lambda: seen.append(str(engines.report()["status"].get("llama.cpp"))),
    )
    engines.converge_sync(wanted(digest))
    kept = tmp_path / "state" / "engines" / ".source-builds" / digest[:16]
    built = kept / "build" / "bin" / "llama-server"
    assert built.is_file()
    stamp = built.stat().st_mtime_ns
    seen.clear()
    (again,) = wanted(digest)
    engines.converge_sync([dataclasses.replace(again, version="b10992")])
    assert engines.report()["installed"][0]["build"] == "source-llama-cpp-python-0.0.1-x64"
    assert not any("downloading" in s for s in seen), seen
    assert any("the build of this source is kept from before" in s for s in seen), seen
    assert built.stat().st_mtime_ns == stamp  # not compiled again
    # Another source replaces the kept tree: only one is kept.
    (other,) = wanted("f" * 64)
    assert other.source is not None
    with pytest.raises(SourceError, match="digest mismatch"):  # not the sdist the index serves
        engines._install_source(other, other.source, NodeFacts(arch="x86_64"))
    assert sorted(p.name for p in kept.parent.iterdir()) == ["f" * 16]


def test_the_build_uses_the_cores_it_may_run_on(tmp_path: Path) -> None:
    from agent.install.source import usable_cores

    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a container given one and a half cores
    assert usable_cores(str(tmp_path)) == min(2, usable_cores(str(tmp_path / "none")))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(tmp_path)) == usable_cores(str(tmp_path / "none")) >= 1
