"""The agent installs llama.cpp from a release, as it would from GitHub: a local server of ours
speaks the releases API and serves real archives of the real llama-server; bad ones are refused
with the reason and the engine that worked before stays."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.install.archive import Limits
from agent.install.builds import NodeFacts, parse_assets
from agent.install.manager import DesiredEngine, Installer, parse_desired_engines
from agent.probes import nvidia
from tests.agent.fixturefiles import fixtures_root, read_text
from tests.engine_releases import LAUNCH_LIBRARY, ReleaseServer, cudart_tarball, have_cc, llama_tarball
from tests.enginebin import llama_server_path, missing_reason

SERVER = llama_server_path()
pytestmark = pytest.mark.skipif(SERVER is None, reason=missing_reason())


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    assert SERVER is not None
    folder = tmp_path_factory.mktemp("archives")
    made = {
        "b100": llama_tarball(folder / "b100", "b100", server=SERVER),
        "b200": llama_tarball(folder / "b200", "b200", server=SERVER),
    }
    if have_cc():
        made["b300"] = llama_tarball(folder / "b300", "b300", server=SERVER, launcher=True)
    return made


@pytest.fixture
def releases() -> Iterator[ReleaseServer]:
    with ReleaseServer() as server:
        yield server


def desired(server: ReleaseServer, tag: str) -> DesiredEngine:
    """What the control plane sends for a release: its listing, relayed (it never calls GitHub for the node)."""
    (item,) = parse_desired_engines([{"engine": "llama.cpp", "version": tag, "assets": server.release(tag)["assets"]}])
    return item


def installer(tmp_path: Path, facts: NodeFacts | None = None, **kwargs: object) -> tuple[Installer, list[str]]:
    seen: list[str] = []
    made: Installer

    def changed() -> None:
        status = made.report()["status"].get("llama.cpp")
        if status:
            seen.append(status)

    made = Installer(tmp_path / "state", facts=lambda: facts or NodeFacts(), on_change=changed, **kwargs)  # type: ignore[arg-type]
    return made, seen


def test_a_node_from_nothing_installs_the_cpu_build_and_reports_it(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b100", archives["b100"])
    engines, seen = installer(tmp_path)
    assert engines.report() == {"probed": True, "installed": [], "status": {}}  # looked, has none
    engines.converge_sync([desired(releases, "b100")])
    report = engines.report()
    (entry,) = report["installed"]
    assert entry["engine"] == "llama.cpp" and entry["version"] == "b100" and entry["build"] == "cpu-x64"
    binary = Path(entry["path"])
    assert binary.name == "llama-server" and os.access(binary, os.X_OK)
    assert binary.is_relative_to(tmp_path / "state" / "engines" / "llama.cpp" / "b100-cpu-x64")
    assert engines.binaries() == {"llama.cpp": str(binary)}
    assert report["status"] == {}
    assert any(s.startswith("installing: downloading llama-b100-bin-ubuntu-x64.tar.gz (") for s in seen)
    assert any(s.startswith("installing: checking cpu-x64") for s in seen)
    # nothing left behind but the install and its manifest
    assert sorted(p.name for p in (tmp_path / "state" / "engines").iterdir()) == ["installed.json", "llama.cpp"]
    # the node asks GitHub for nothing but the files: the listing came from the control plane
    assert not any(r.startswith("/repos/") for r in releases.requests)
    # a new agent process reads the manifest and does not download again
    again, _ = installer(tmp_path)
    count = len(releases.requests)
    again.converge_sync([desired(releases, "b100")])
    assert again.binaries() == engines.binaries() and len(releases.requests) == count


def test_an_upgrade_replaces_the_install_and_keeps_the_one_before(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b100", archives["b100"])
    releases.add("b200", archives["b200"])
    engines, _ = installer(tmp_path)
    engines.converge_sync([desired(releases, "b100")])
    engines.converge_sync([desired(releases, "b200")])
    assert engines.report()["installed"][0]["version"] == "b200"
    folder = tmp_path / "state" / "engines" / "llama.cpp"
    assert sorted(p.name for p in folder.iterdir()) == ["b100-cpu-x64", "b200-cpu-x64"]
    engines.converge_sync([])  # no longer wanted
    assert engines.binaries() == {}


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("digest", "refused: cpu-x64: digest mismatch"),  # it arrived whole and is not the file published
        ("truncate", "failed: cpu-x64: truncated"),
        ("missing", "failed: cpu-x64: HTTP 404"),
        ("no-digest", "failed: cpu-x64: no sha256 published"),
    ],
)
def test_a_bad_download_is_refused_with_its_reason_and_the_old_engine_stays(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path], fault: str, reason: str
) -> None:
    releases.add("b100", archives["b100"])
    releases.add("b200", archives["b200"])
    engines, _ = installer(tmp_path, retry_after=3600)
    engines.converge_sync([desired(releases, "b100")])
    before = engines.binaries()
    name = archives["b200"].name
    if fault == "digest":
        releases.digest_override[name] = "sha256:" + "0" * 64
    elif fault == "truncate":
        releases.truncate[name] = 1000
    elif fault == "missing":
        releases.drop.add(name)
    else:
        releases.digest_override[name] = None
    engines.converge_sync([desired(releases, "b200")])
    status = engines.report()["status"]["llama.cpp"]
    assert status.startswith(reason), status
    assert engines.binaries() == before  # still b100
    assert engines.report()["installed"][0]["version"] == "b100"
    assert not list((tmp_path / "state" / "engines").glob(".staging-*"))


def _evil(tmp_path: Path, tag: str, kind: str) -> Path:
    """A release archive with one member that would leave the install directory."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    archive = tmp_path / f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:  # the real server: packed quickly
        assert SERVER is not None
        tar.add(SERVER, f"llama-{tag}/llama-server")
        info = tarfile.TarInfo()
        if kind == "traversal":
            info.name, data = f"llama-{tag}/../../../escaped", b"x"
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        elif kind == "absolute":
            info.name, data = str(tmp_path.parent / "escaped"), b"x"
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        elif kind == "symlink":
            info.name, info.type, info.linkname = f"llama-{tag}/lib", tarfile.SYMTYPE, "../../../.."
            tar.addfile(info)
        elif kind == "hardlink":
            info.name, info.type, info.linkname = f"llama-{tag}/passwd", tarfile.LNKTYPE, "/etc/passwd"
            tar.addfile(info)
        elif kind == "device":
            info.name, info.type = f"llama-{tag}/null", tarfile.CHRTYPE
            info.devmajor, info.devminor = 1, 3
            tar.addfile(info)
    return archive


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("traversal", "leaves"),
        ("absolute", "absolute"),
        ("symlink", "symlink"),
        ("hardlink", "hard link"),
        ("device", "device"),
    ],
)
def test_a_malicious_archive_is_refused_before_anything_is_written(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path], kind: str, reason: str
) -> None:
    releases.add("b100", archives["b100"])
    releases.add("b666", _evil(tmp_path / "evil", "b666", kind))
    engines, _ = installer(tmp_path, retry_after=3600)
    engines.converge_sync([desired(releases, "b100")])
    engines.converge_sync([desired(releases, "b666")])
    status = engines.report()["status"]["llama.cpp"]
    assert status.startswith("refused: cpu-x64: ") and reason in status.lower()
    assert engines.report()["installed"][0]["version"] == "b100"
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "state" / "escaped").exists()


MIB = 2**20


def _zeros_release(folder: Path, tag: str, zeros: int) -> Path:
    """A release archive holding the real llama-server and a file of ``zeros`` zero bytes (a few
    hundred kilobytes packed), as a hostile release server made one with 10 GiB of them."""
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    assert SERVER is not None
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(SERVER, f"llama-{tag}/llama-server")
        info = tarfile.TarInfo(f"llama-{tag}/zeros.bin")
        info.size = zeros
        tar.addfile(info, io.BytesIO(bytes(zeros)))
    return archive


def test_a_release_past_what_an_engine_may_unpack_to_is_refused_with_the_numbers_and_the_old_engine_stays(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    # The limit set low (the real one is 2 GiB), the member a few MB over it.
    small = Limits(max_total_bytes=32 * MIB, max_member_bytes=32 * MIB)
    releases.add("b100", archives["b100"])
    releases.add("b666", _zeros_release(tmp_path / "evil", "b666", 36 * MIB))
    engines, _ = installer(tmp_path, retry_after=3600, archive_limits=small)
    engines.converge_sync([desired(releases, "b100")])
    engines.converge_sync([desired(releases, "b666")])
    status = engines.report()["status"]["llama.cpp"]
    assert status == (
        "refused: cpu-x64: member llama-b666/zeros.bin declares 37,748,736 bytes: "
        "more than the limit of 32 MiB per member of an engine release archive"
    )
    assert engines.report()["installed"][0]["version"] == "b100"
    folder = tmp_path / "state" / "engines"
    assert sorted(p.name for p in (folder / "llama.cpp").iterdir()) == ["b100-cpu-x64"]
    assert not list(folder.glob(".staging-*"))


def test_a_release_that_would_leave_the_disk_below_its_reserve_is_refused_with_the_numbers(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b100", archives["b100"])
    releases.add("b200", archives["b200"])
    engines, _ = installer(tmp_path, retry_after=3600)
    engines.converge_sync([desired(releases, "b100")])
    engines.disk_reserve = shutil.disk_usage(tmp_path).total  # no disk keeps all of itself free
    engines.converge_sync([desired(releases, "b200")])
    status = engines.report()["status"]["llama.cpp"]
    size = archives["b200"].stat().st_size
    assert re.fullmatch(
        rf"failed: cpu-x64: llama-b200-bin-ubuntu-x64.tar.gz is {size:,} bytes and \S+ has [0-9,]+ bytes free: "
        r"downloading it would leave less than the [0-9,]+ \w+ this node keeps free",
        status,
    ), status
    assert engines.report()["installed"][0]["version"] == "b100"


def test_staging_left_by_a_killed_install_is_removed_when_the_agent_starts_and_both_installs_stay(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b100", archives["b100"])
    releases.add("b200", archives["b200"])
    engines, _ = installer(tmp_path)
    engines.converge_sync([desired(releases, "b100")])
    engines.converge_sync([desired(releases, "b200")])  # b200 in use, b100 kept for rollback
    root = tmp_path / "state" / "engines"
    # What installs killed part way left: a half-done download (3.1 MB was seen), a half-unpacked
    # tree, uv's staging, a copy of the manifest being written.
    killed = root / ".staging-llama.cpp-0badf00d"
    (killed / "downloads").mkdir(parents=True)
    (killed / "downloads" / "llama-b300-bin-ubuntu-x64.tar.gz").write_bytes(os.urandom(3 * MIB))
    (killed / "tree" / "llama-b300").mkdir(parents=True)
    (killed / "tree" / "llama-b300" / "zeros.bin").write_bytes(bytes(MIB))
    (root / ".staging-uv-0badf00d" / "release").mkdir(parents=True)
    (root / ".tools" / ".uv-0.9.0-0badf00d").mkdir(parents=True)
    (root / ".installed.json.4242.tmp").write_text("{")
    locks = root / "llama.cpp" / ".locks"
    locks.mkdir()
    (locks / "b200-cpu-x64.txt").write_text("resolved\n")
    before = engines.binaries()

    again, _ = installer(tmp_path)  # the agent starts again

    assert sorted(p.name for p in root.iterdir()) == [".tools", "installed.json", "llama.cpp"]
    assert list((root / ".tools").iterdir()) == []
    assert sorted(p.name for p in (root / "llama.cpp").iterdir()) == [".locks", "b100-cpu-x64", "b200-cpu-x64"]
    assert again.binaries() == before and os.access(before["llama.cpp"], os.X_OK)


def test_an_install_moved_aside_when_the_agent_was_killed_is_put_back_at_start(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b100", archives["b100"])
    engines, _ = installer(tmp_path)
    engines.converge_sync([desired(releases, "b100")])
    folder = tmp_path / "state" / "engines" / "llama.cpp"
    # Killed between moving the install aside and renaming its replacement in: the one aside is
    # the one the manifest names, so it is put back; one aside whose place was taken goes.
    (folder / ".old-b100-cpu-x64-5ca1ab1e").mkdir()  # an earlier one whose removal did not finish
    (folder / "b100-cpu-x64").rename(folder / ".old-b100-cpu-x64-0badf00d")
    again, _ = installer(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["b100-cpu-x64"]
    assert again.binaries() == engines.binaries() and os.access(again.binaries()["llama.cpp"], os.X_OK)


@pytest.mark.skipif(not have_cc(), reason="needs cc to build the dynamically linked launcher")
def test_an_engine_whose_library_goes_is_withdrawn_at_the_next_recheck(
    tmp_path: Path, releases: ReleaseServer, archives: dict[str, Path]
) -> None:
    releases.add("b300", archives["b300"])
    engines, _ = installer(tmp_path, retry_after=3600)
    engines.converge_sync([desired(releases, "b300")])
    (entry,) = engines.report()["installed"]
    assert engines.recheck_sync() == []
    (Path(entry["path"]).parent / LAUNCH_LIBRARY).unlink()  # as an upgrade removing a package would
    assert engines.recheck_sync() == ["llama.cpp"]
    assert engines.binaries() == {}
    status = engines.report()["status"]["llama.cpp"]
    assert status.startswith("failed: re-check of b300 (cpu-x64): missing shared libraries: " + LAUNCH_LIBRARY)
    # within retry_after it is not fetched again; after it, it is installed afresh and works
    engines.converge_sync([desired(releases, "b300")])
    assert engines.binaries() == {}
    engines.retry_after = 0
    engines.converge_sync([desired(releases, "b300")])
    assert engines.report()["installed"][0]["version"] == "b300" and engines.report()["status"] == {}


@pytest.mark.skipif(not have_cc(), reason="needs cc to build the dynamically linked launcher")
def test_a_build_missing_a_library_is_refused_naming_it(tmp_path: Path, releases: ReleaseServer) -> None:
    assert SERVER is not None
    broken = tmp_path / "broken"
    archive = llama_tarball(broken, "b400", server=SERVER, launcher=True)
    # repack without the library the launcher needs
    stripped = tmp_path / "stripped" / archive.name
    stripped.parent.mkdir()
    with tarfile.open(archive) as src, tarfile.open(stripped, "w:gz", compresslevel=1) as dst:
        for member in src.getmembers():
            if LAUNCH_LIBRARY not in member.name and "libllmgw-launch.so" not in member.name:
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    releases.add("b400", stripped)
    engines, _ = installer(tmp_path, tools={"apt-get": ""}, retry_after=3600)
    engines.converge_sync([desired(releases, "b400")])
    assert engines.binaries() == {}
    assert f"missing shared libraries: {LAUNCH_LIBRARY}" in engines.report()["status"]["llama.cpp"]


def _gpu_facts() -> NodeFacts:
    path = fixtures_root() / "nvidia-smi-q" / "h100-80gb-hbm3-vm-drv590-idle-masked.txt"
    if not path.exists():
        pytest.skip(f"{path} not found (set LLMGW_FIXTURES_DIR)")
    report = nvidia.parse_nvidia_smi_text(read_text(path))
    return NodeFacts(driver_version=report.driver_version, gpus=[dataclasses.asdict(g) for g in report.gpus])


def test_a_gpu_build_that_runs_on_the_cpu_is_refused_and_the_cpu_build_never_tried(
    tmp_path: Path, releases: ReleaseServer
) -> None:
    """A CUDA archive whose GPU backend cannot load still runs (on the CPU): `--list-devices`
    shows no GPU, so it is not used; neither is the Vulkan one; and never the CPU build."""
    assert SERVER is not None
    tag = "b500"
    for name in (
        f"llama-{tag}-bin-ubuntu-cuda-13.3-x64.tar.gz",
        f"llama-{tag}-bin-ubuntu-vulkan-x64.tar.gz",
        f"llama-{tag}-bin-ubuntu-x64.tar.gz",
    ):
        releases.add(tag, llama_tarball(tmp_path / name, tag, server=SERVER, name=name))
    releases.add(tag, cudart_tarball(tmp_path / "cudart", tag, "13.3"))
    engines, _ = installer(tmp_path, facts=_gpu_facts(), tools={"apt-get": ""}, retry_after=3600)
    engines.converge_sync([desired(releases, tag)])
    assert engines.binaries() == {}
    status = engines.report()["status"]["llama.cpp"]
    assert "cuda-13.3-x64: llama-server --list-devices shows no GPU" in status
    assert "vulkan-x64: llama-server --list-devices shows no GPU" in status
    assert "CPU build is never used" in status or "cpu-x64" not in status
    downloaded = [r for r in releases.requests if r.startswith("/objects/")]
    assert f"/objects/llama-{tag}-bin-ubuntu-x64.tar.gz" not in downloaded
    assert f"/objects/cudart-llama-{tag}-bin-ubuntu-cuda-13.3-x64.tar.gz" in downloaded


def test_an_engine_named_in_agent_yaml_is_used_as_named(tmp_path: Path, releases: ReleaseServer) -> None:
    assert SERVER is not None
    engines, _ = installer(tmp_path, configured={"llama.cpp": str(SERVER)})
    engines.converge_sync([DesiredEngine("llama.cpp", "b100", tuple(parse_assets({"assets": []})))])
    assert engines.binaries() == {"llama.cpp": str(SERVER)}
    assert engines.report()["installed"] == [] and releases.requests == []


def test_a_release_the_control_plane_could_not_read_waits_with_its_words(tmp_path: Path) -> None:
    engines, _ = installer(tmp_path)
    (item,) = parse_desired_engines(
        [{"engine": "llama.cpp", "version": "b9", "note": "the control plane cannot read release b9: HTTP 404"}]
    )
    engines.converge_sync([item])
    assert engines.report()["status"] == {"llama.cpp": "waiting: the control plane cannot read release b9: HTTP 404"}
    assert parse_desired_engines([{"engine": "tensorrt", "version": "1"}, "junk", {"version": 2}]) == []


def test_a_node_the_control_plane_holds_no_archive_for_says_the_command_that_fixes_it(tmp_path: Path) -> None:
    from agent import doctor
    from agent.config import AgentConfig

    note = "the control plane cannot read release b9: cannot reach https://api.github.com/repos/..."
    fix = "on the control plane, run “llmgw engine-files fetch b9” where GitHub can be reached"
    engines, _ = installer(tmp_path)
    (item,) = parse_desired_engines([{"engine": "llama.cpp", "version": "b9", "note": note, "fix": fix}])
    engines.converge_sync([item])
    assert engines.report()["status"] == {"llama.cpp": f"waiting: {note}; {fix}"}
    config = AgentConfig(server="http://127.0.0.1:1", state_dir=tmp_path / "state")
    assert doctor.install_checks(config) == [doctor.Check("install llama.cpp", "warn", f"waiting: {note}", fix)]
    # Once it is installed there is nothing left to say, here or in the doctor.
    engines.configured = {"llama.cpp": str(SERVER)}
    engines.converge_sync([item])
    assert engines.report()["status"] == {} and doctor.install_checks(config) == []


@pytest.mark.skipif(not have_cc(), reason="needs cc to build the dynamically linked launcher")
@pytest.mark.skipif(os.geteuid() != 0, reason="the agent installs OS packages only as root")
def test_a_missing_os_library_is_installed_from_the_nodes_package_tool(
    tmp_path: Path, releases: ReleaseServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build needs a library the OS lacks: the agent names its package to the node's package
    tool (apt-get; here a stand-in that puts the library where the loader finds it, since a real
    install would change this machine) and checks the build again."""
    assert SERVER is not None
    archive = llama_tarball(tmp_path / "full", "b401", server=SERVER, launcher=True)
    library = tmp_path / "library" / LAUNCH_LIBRARY
    library.parent.mkdir()
    stripped = tmp_path / "stripped" / archive.name
    stripped.parent.mkdir()
    with tarfile.open(archive) as src, tarfile.open(stripped, "w:gz", compresslevel=1) as dst:
        for member in src.getmembers():
            if "libllmgw-launch" in member.name:
                if member.isfile():
                    library.write_bytes(src.extractfile(member).read())  # type: ignore[union-attr]
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    releases.add("b401", stripped)
    calls = tmp_path / "apt-calls"
    apt = tmp_path / "apt-get"
    apt.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {calls}\n'
        f'for dir in $(find {tmp_path / "state"} -path "*staging*" -name llama-server -printf "%h\\n"); do\n'
        f'  cp {library} "$dir/"\n'
        "done\n"
    )
    apt.chmod(0o755)
    from agent.install import verify

    sources = (*verify.LIBRARY_SOURCES, (re.compile(r"^libllmgw-launch\.so\.0$"), "llmgw-launch1"))
    monkeypatch.setattr(verify, "LIBRARY_SOURCES", sources)
    engines, _ = installer(tmp_path, tools={"apt-get": str(apt)}, retry_after=3600)
    engines.converge_sync([desired(releases, "b401")])
    assert calls.read_text().split() == ["install", "-y", "--no-install-recommends", "llmgw-launch1"]
    assert engines.report()["installed"][0]["version"] == "b401" and engines.report()["status"] == {}
