"""Installing llama.cpp's CPU build from a local release server, and what keeping it costs.

    .venv/bin/python bench/engines.py [--rounds 3]

One run, on loopback:

- a local server speaking GitHub's releases API (tests/engine_releases.py) serves a release
  archive of the real llama-server (LLMGW_LLAMA_SERVER, ../shared/bin/llama-server, or the one
  scripts/ensure-llama-server builds), packed as llama.cpp packs its Linux builds;
- the baseline, measured in the same run: what a person would do by hand, as separate processes:
  `curl -o` (or urllib when there is no curl), `sha256sum`, `tar xzf`, and one `--version`;
- the agent's installer (agent/install/manager.py) on the same archive, from nothing each round:
  download with sha256 on the way, the safe pre-scan and unpack, ldd, `--version`, rename;
- its peak Python heap during an install (tracemalloc), next to the archive's size: the download
  is streamed, never held whole;
- the longest gap between two progress reports while the archive downloads from a server that
  sends it slowly (64 kB every 20 ms);
- the re-check the agent runs every ten minutes (ldd and `--version` per installed engine): wall
  and CPU time (the children's included) per engine, for 1 and for 8 installed engines, and that
  cost as a share of the ten minutes; and the agent's idle heap with 1 and with 8 installed.

- a vLLM environment (a stand-in vLLM and torch from a local package index, built with the real
  uv of the dev environment): the agent's install (resolve with hashes, install with
  --require-hashes, check, rename) against `uv venv` + `uv pip install` by hand, and the cost of
  its re-check (one Python start per environment).

Prints the figures and the ratios. Target: the longest gap between two progress reports at most
2 s; the rest is printed for comparison. `--rounds 1` is the quickest run.

    .venv/bin/python bench/engines.py --source-build SDIST [--jobs N]

The CPU node's last way to an engine, llama.cpp compiled from the llama-cpp-python source
distribution (SDIST: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`), served
from a local package index (PEP 503) on loopback; it takes minutes, so it is run on its own:

- before: the build as the agent ran it until it kept its trees: the sdist unpacked afresh,
  CMake configured and `llama-server` built with `-j` the machine's CPU count, no compiler cache;
- the agent's first install now (agent/install/source.py): download against the digest, unpack,
  configure, build `llama-server` only with `-j` the cores it may use (affinity, cgroup quota),
  with ccache where it is on PATH; the expected time it prints is shown next to the one measured;
- the same source installed again (another tag, or a re-check that withdrew it): the kept tree;
- where ccache is on PATH, the kept tree gone but ccache's results kept.

Wall and CPU (the compilers' included) for each, and each one's ratio to before. Target: the
first install at most half the time of before. `--source-build tiny` runs the same steps on the
tests' tiny stand-in (a check of the bench itself, in seconds).

Either way the load average is printed at the start and the end, and each target as met, missed or
not measured (the other mode's targets; without llama-server, the install's). No assertions (a
script, not a test).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.install.builds import NodeFacts  # noqa: E402
from agent.install.manager import Installer, parse_desired_engines  # noqa: E402
from bench.report import Report  # noqa: E402
from tests.engine_releases import ReleaseServer, llama_tarball  # noqa: E402
from tests.enginebin import llama_server_path, missing_reason  # noqa: E402

RECHECK_INTERVAL_S = 600.0
GAP_TARGET_S = 2.0
SOURCE_TARGET = 0.5  # the first source install's wall time over the build as it was before
INSTALL_TARGETS = ("progress gap",)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def by_hand(url: str, work: Path) -> float:
    """curl, sha256sum, tar, --version: the floor an install cannot go under."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.perf_counter()
    target = work / "archive.tar.gz"
    if shutil.which("curl"):
        subprocess.run(["curl", "-sSfL", "-o", str(target), url], check=True)
    else:
        with urllib.request.urlopen(url) as answer, open(target, "wb") as out:  # noqa: S310 - loopback
            shutil.copyfileobj(answer, out, 1 << 20)
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", str(target)], check=True, capture_output=True)
    else:
        hashlib.sha256(target.read_bytes()).hexdigest()
    subprocess.run(["tar", "xzf", str(target), "-C", str(work)], check=True)
    binary = next(work.glob("llama-*/llama-server"))
    subprocess.run([str(binary), "--version"], check=True, capture_output=True)
    return time.perf_counter() - started


def installer_for(state: Path, **kwargs: Any) -> Installer:
    return Installer(state, facts=lambda: NodeFacts(arch="x86_64"), tools={"apt-get": ""}, **kwargs)


def install_once(github: ReleaseServer, tag: str, state: Path) -> tuple[float, float, Installer]:
    if state.exists():
        shutil.rmtree(state)
    engines = installer_for(state)
    wanted = parse_desired_engines([{"engine": "llama.cpp", "version": tag, "assets": github.release(tag)["assets"]}])
    started, cpu = time.perf_counter(), own_cpu() + children_cpu()
    engines.converge_sync(wanted)
    elapsed = time.perf_counter() - started
    if not engines.binaries():
        raise SystemExit(f"the install failed: {engines.report()['status']}")
    return elapsed, own_cpu() + children_cpu() - cpu, engines


class SlowServer:
    """Serves one file 64 kB at a time, 20 ms apart, for the progress gaps."""

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                for i in range(0, len(data), 64 * 1024):
                    self.wfile.write(data[i : i + 64 * 1024])
                    time.sleep(0.02)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/{path.name}"


def progress_gaps(archive: Path, digest: str, work: Path) -> tuple[float, int, float]:
    from agent.install.fetch import download

    slow = SlowServer(archive)
    times: list[float] = []
    started = time.perf_counter()
    download(
        slow.url, work / archive.name, sha256=digest, progress=lambda done, total: times.append(time.perf_counter())
    )
    total = time.perf_counter() - started
    slow.httpd.shutdown()
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(gaps) if gaps else total, len(times), total


def recheck_cost(engines: Installer, count: int, state: Path) -> tuple[float, float, int]:
    """Wall and CPU seconds of one re-check with `count` installed engines, and the heap the
    agent keeps for them while idle (its manifest, read back as a new agent process would)."""
    import json

    entry = next(iter(engines.manifest.values()))
    (state / "engines").mkdir(parents=True, exist_ok=True)
    manifest = {f"llama.cpp#{i}": dict(entry) for i in range(count)}
    (state / "engines" / "installed.json").write_text(json.dumps(manifest))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    many = installer_for(state)
    idle_heap = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    started, cpu = time.perf_counter(), own_cpu() + children_cpu()
    withdrawn = many.recheck_sync()
    assert not withdrawn, withdrawn
    return time.perf_counter() - started, own_cpu() + children_cpu() - cpu, idle_heap


def python_engine(root: Path, rounds: int) -> tuple[float, float, float, float] | None:
    """(by hand s, the agent's s, re-check wall s, re-check CPU s) for a vLLM environment, or None
    without uv."""
    from tests.python_index import SimpleIndex, engine_wheel, torch_wheel

    uv = Path(sys.executable).parent / "uv"
    if not uv.is_file():
        return None
    index = root / "index"
    engine_wheel(index, "0.11.0")
    torch_wheel(index, "2.9.0", available=True, cuda="12.9")
    facts = NodeFacts(arch="x86_64", driver_version="550.54.15", gpus=({"name": "NVIDIA H100 80GB HBM3"},))
    hand, ours = [], []
    installer = None
    with SimpleIndex(index) as pypi:
        item = {"engine": "vllm", "version": "0.11.0", "assets": [], "uv": {"version": "0", "assets": []}}
        for i in range(rounds):
            work = root / f"hand-{i}"
            env = dict(os.environ, UV_CACHE_DIR=str(work / "cache"), UV_PYTHON_DOWNLOADS="never")
            started = time.perf_counter()
            subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(work / "env")], env=env, check=True)
            subprocess.run(
                [
                    str(uv),
                    "pip",
                    "install",
                    "-q",
                    "--python",
                    str(work / "env" / "bin" / "python"),
                    "--index-url",
                    pypi.url,
                    "vllm==0.11.0",
                ],
                env=env,
                check=True,
            )
            subprocess.run([str(work / "env" / "bin" / "python"), "-c", "import vllm, torch"], check=True)
            hand.append(time.perf_counter() - started)
            installer = Installer(
                root / f"state-py-{i}",
                facts=lambda: facts,
                tools={"package-index": pypi.url, "python": sys.executable, "uv": str(uv), "apt-get": ""},
            )
            started = time.perf_counter()
            installer.converge_sync(parse_desired_engines([item]))
            ours.append(time.perf_counter() - started)
            assert installer.report()["installed"], installer.report()
    assert installer is not None
    started, cpu = time.perf_counter(), own_cpu() + children_cpu()
    assert installer.recheck_sync() == []
    return (
        statistics.median(hand),
        statistics.median(ours),
        time.perf_counter() - started,
        own_cpu() + children_cpu() - cpu,
    )


class PackageIndex:
    """A PEP 503 simple index of one sdist on loopback (the node's own package index)."""

    def __init__(self, sdist: Path, folder: Path) -> None:
        self.sdist, self.folder = sdist, folder
        self.sha256 = hashlib.sha256(sdist.read_bytes()).hexdigest()

    def __enter__(self) -> str:
        from functools import partial
        from http.server import SimpleHTTPRequestHandler

        packages = self.folder / "packages"
        packages.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.sdist, packages / self.sdist.name)
        page = self.folder / "simple" / "llama-cpp-python"
        page.mkdir(parents=True, exist_ok=True)
        page.joinpath("index.html").write_text(
            f'<html><body><a href="../../packages/{self.sdist.name}#sha256={self.sha256}">{self.sdist.name}</a>'
            "</body></html>"
        )

        class Quiet(SimpleHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(Quiet, directory=str(self.folder)))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/simple"

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def tiny_sdist(folder: Path) -> Path:
    from tests.agent.test_install_source import sdist

    return sdist(folder)


def measured(step: Any) -> tuple[float, float, Any]:
    """Wall and CPU seconds (this process's and its children's) of step(), and what it returned."""
    started, cpu = time.perf_counter(), own_cpu() + children_cpu()
    result = step()
    return time.perf_counter() - started, own_cpu() + children_cpu() - cpu, result


def build_before(sdist: Path, work: Path, subdir: str) -> Path:
    """The build as the agent ran it before it kept trees and counted its cores: unpacked afresh,
    `-j` the machine's CPU count, no compiler cache."""
    from agent.install.source import CMAKE_FLAGS

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    subprocess.run(["tar", "xzf", str(sdist), "-C", str(work)], check=True)
    (root,) = [p for p in work.iterdir() if p.is_dir()]
    out = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else ["-G", "Unix Makefiles"]
    jobs = str(os.cpu_count() or 2)
    for argv in (
        ["cmake", "-S", str(root / subdir), "-B", str(out), *generator, *CMAKE_FLAGS, "-DGGML_CCACHE=OFF"],
        ["cmake", "--build", str(out), "--target", "llama-server", "-j", jobs],
    ):
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return next(out.rglob("llama-server"))


def source_build_bench(sdist_arg: str, jobs: int | None, report: Report) -> None:
    """The source build before and after, on this machine (see the module's docstring)."""
    from agent.install.source import SourceBuild, build, expected_minutes, usable_cores

    with tempfile.TemporaryDirectory(prefix="llmgw-bench-source-") as tmp:
        root = Path(tmp)
        sdist = tiny_sdist(root / "tiny") if sdist_arg == "tiny" else Path(sdist_arg).resolve()
        index = PackageIndex(sdist, root / "index")
        source = SourceBuild("llama-cpp-python", sdist.name.removesuffix(".tar.gz").rsplit("-", 1)[-1], index.sha256)
        cores = usable_cores()
        print(
            f"Source build bench: {sdist.name} ({sdist.stat().st_size / 1e6:.1f} MB), {os.cpu_count()} CPUs, "
            f"{cores} usable by the agent"
        )
        print("=" * 100)
        rows: list[tuple[str, float, float]] = []
        with index as url:
            tools = {"package-index": url}
            wall, cpu, _binary = measured(lambda: build_before(sdist, root / "before", source.subdir))
            rows.append(("before: unpacked afresh (no download), -j CPU count, no compiler cache", wall, cpu))
            cache = root / "cache"
            said: list[str] = []

            def ours(work: str) -> Path:
                return build(source, root / work, tools=tools, status=said.append, cache=cache, jobs=jobs)

            wall, cpu, _binary = measured(lambda: ours("first"))
            expected = expected_minutes(jobs or cores)
            rows.append((f"the agent's first install, download included (it said: about {expected} min)", wall, cpu))
            wall, cpu, _binary = measured(lambda: ours("again"))
            rows.append(("the same source installed again (the kept tree)", wall, cpu))
            if shutil.which("ccache"):
                for kept in cache.iterdir():
                    if kept.name != "ccache":
                        shutil.rmtree(kept)
                wall, cpu, _binary = measured(lambda: ours("ccache"))
                rows.append(("the kept tree gone, ccache's results kept", wall, cpu))
            else:
                print("(no ccache on PATH: the install from ccache's results is not measured)")
        base = rows[0][1]
        for label, wall, cpu in rows:
            print(f"{label}: {wall:.1f} s wall, {cpu:.1f} s CPU, {wall / base:.2f}x before")
        first = rows[1][1] / base
        if sdist_arg == "tiny":
            report.not_measured("source build first / before", f"the tiny stand-in checks the bench only ({first:.2f})")
        else:
            report.target("source build first / before", measured=first, limit=SOURCE_TARGET)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--source-build", metavar="SDIST", help="measure the source build instead (or: tiny)")
    parser.add_argument("--jobs", type=int, help="the source build's jobs (default: the cores it may use)")
    args = parser.parse_args()
    with Report(__doc__) as report:
        if args.source_build:
            for name in INSTALL_TARGETS:
                report.not_measured(name, "run without --source-build")
            source_build_bench(args.source_build, args.jobs, report)
            return 0
        report.not_measured("source build first / before", "run with --source-build SDIST")
        server = llama_server_path()
        if server is None:
            for name in INSTALL_TARGETS:
                report.not_measured(name, missing_reason())
            return 1
        install_bench(args, server, report)
    return 0


def install_bench(args: argparse.Namespace, server: Path, report: Report) -> None:
    """The release archive's install, its heap, progress and re-check (see the module's docstring)."""
    tag = "b900"
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-engines-") as tmp:
        root = Path(tmp)
        archive = llama_tarball(root / "release", tag, server=server)
        size = archive.stat().st_size
        with ReleaseServer() as github:
            github.add(tag, archive)
            asset = github.release(tag)["assets"][0]
            url = f"{github.url}/objects/{archive.name}"
            hand, ours, ours_cpu = [], [], []
            engines: Installer | None = None
            for i in range(args.rounds):
                hand.append(by_hand(url, root / "by-hand"))
                elapsed, cpu, engines = install_once(github, tag, root / f"state-{i % 2}")
                ours.append(elapsed)
                ours_cpu.append(cpu)
            assert engines is not None
            tracemalloc.start()
            install_once(github, tag, root / "state-heap")
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            gap, calls, slow_total = progress_gaps(archive, asset["digest"], root / "slow")
            one = recheck_cost(engines, 1, root / "state-one")
            eight = recheck_cost(engines, 8, root / "state-eight")
        python = python_engine(root, args.rounds)

    hand_s, ours_s = statistics.median(hand), statistics.median(ours)
    print(f"Engine install bench: {os.cpu_count()} CPUs, loopback, archive {archive.name} ({size / 1e6:.1f} MB)")
    print("=" * 100)
    print(f"by hand (curl, sha256sum, tar, --version), median of {args.rounds}: {hand_s * 1000:.0f} ms")
    print(
        f"the agent's install (sha256 streamed, pre-scan, unpack, ldd, --version, rename), median of {args.rounds}: "
        f"{ours_s * 1000:.0f} ms, CPU {statistics.median(ours_cpu) * 1000:.0f} ms: {ours_s / hand_s:.2f}x by hand"
    )
    print(f"  peak Python heap during an install: {peak / 1e6:.2f} MB, {peak / size:.3f}x the archive (streamed)")
    print(f"  progress while downloading slowly ({slow_total:.1f} s): {calls} reports, longest gap {gap:.2f} s")
    report.target("progress gap", measured=gap, limit=GAP_TARGET_S, unit=" s")
    for label, (wall, cpu, heap), count in (("1 engine", one, 1), ("8 engines", eight, 8)):
        print(
            f"re-check with {label}: {wall * 1000:.0f} ms wall, {cpu * 1000:.0f} ms CPU "
            f"({cpu / count * 1000:.0f} ms per engine), {cpu / RECHECK_INTERVAL_S * 100:.4f} % of a CPU over its "
            f"10-minute interval; the agent's idle heap for them {heap / 1000:.1f} kB"
        )
    print(
        f"  8 engines / 1 engine: re-check CPU {eight[1] / one[1]:.1f}x (one ldd and --version each); "
        "between re-checks the agent does nothing per engine"
    )
    if python is None:
        print("vLLM environment: skipped (no uv in this environment: install the dev extra)")
    else:
        p_hand, p_ours, p_wall, p_cpu = python
        print(
            f"vLLM environment (stand-in wheels, local index), median of {args.rounds}: by hand (uv venv, uv pip "
            f"install, import) {p_hand * 1000:.0f} ms; the agent's (resolve with hashes, --require-hashes install, "
            f"check, rename) {p_ours * 1000:.0f} ms: {p_ours / p_hand:.2f}x by hand"
        )
        print(
            f"  its re-check: {p_wall * 1000:.0f} ms wall, {p_cpu * 1000:.0f} ms CPU, "
            f"{p_cpu / RECHECK_INTERVAL_S * 100:.4f} % of a CPU over the 10-minute interval"
        )


if __name__ == "__main__":
    sys.exit(main())
