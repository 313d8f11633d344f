"""`llmgw doctor`'s checks against real binaries, captured tool output and local servers."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import json
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fixturefiles import fixture_files, read_text

from agent import doctor
from agent.config import AgentConfig
from agent.doctor import Check
from agent.install.builds import compute_capability
from agent.probes.nvidia import parse_nvidia_smi_text, parse_nvidia_smi_xml
from agent.probes.procfs import parse_cpuinfo
from tests import enginebin

LLAMA_SERVER = enginebin.llama_server_path()
STATUSES = {"pass", "warn", "fail"}


def node(tmp_path: Path, **changes: Any) -> AgentConfig:
    """A CPU node laid out under tmp_path: no nvidia-smi, /proc under tmp_path/root."""
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "server": "http://127.0.0.1:1",
        "state_dir": tmp_path / "state",
        "root": str(root),
        "tools": {"nvidia-smi": str(tmp_path / "absent" / "nvidia-smi"), "dmesg": "dmesg"},
    }
    values.update(changes)
    return AgentConfig(**values)


def script(path: Path, body: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def by_name(checks: list[Check]) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), names
    return {c.name: c for c in checks}


# --------------------------------------------------------------------------- engines


@pytest.mark.skipif(LLAMA_SERVER is None, reason=enginebin.missing_reason())
def test_the_real_llama_server_passes_with_its_build_number(tmp_path: Path) -> None:
    assert LLAMA_SERVER is not None
    said = subprocess.run([LLAMA_SERVER, "--version"], capture_output=True, text=True, timeout=30)
    match = re.search(r"\(build (\d+), commit|version: (\d+) \(", said.stdout + said.stderr)
    assert match, said
    build = match.group(1) or match.group(2)
    installed = {
        "llama.cpp": {
            "version": f"b{build}",
            "build": "cpu-x64",
            "path": str(LLAMA_SERVER),
            "dir": str(LLAMA_SERVER.parent),
        }
    }
    # agent.yaml names the same binary: it is checked once
    config = node(tmp_path, engines={"llama.cpp": str(LLAMA_SERVER)})
    checks = doctor.engine_checks(config, installed)
    assert [c.name for c in checks] == ["engine llama.cpp"]
    check = checks[0]
    assert check.status == "pass", check
    assert f"build {build} (commit " in check.detail
    assert "cpu-x64" in check.detail and str(LLAMA_SERVER) in check.detail


def _compile(cc: str, *args: str) -> None:
    try:
        subprocess.run([cc, *args], check=True, capture_output=True, timeout=120)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"{cc} cannot build the test program: {exc.stderr.decode(errors='replace')[:300]}")


@pytest.fixture
def linked_program(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A real dynamically linked engine: bin/llama-server needs lib/libllmgwtest.so, and
    bin/libggml-test.so (a backend next to it, as llama.cpp ships them) needs lib/libllmgwdep.so."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build a dynamically linked test program")
    src, lib, bin_dir = tmp_path / "src", tmp_path / "lib", tmp_path / "bin"
    for folder in (src, lib, bin_dir):
        folder.mkdir()
    (src / "llmgwtest.c").write_text("int llmgwtest_build(void) { return 6500; }\n")
    (src / "llmgwdep.c").write_text("int llmgwdep(void) { return 1; }\n")
    (src / "backend.c").write_text("int llmgwdep(void);\nint backend(void) { return llmgwdep(); }\n")
    (src / "main.c").write_text(
        "#include <stdio.h>\nint llmgwtest_build(void);\n"
        'int main(void) { fprintf(stderr, "version: %d (abc1234)\\nbuilt with cc\\n", llmgwtest_build()); return 0; }\n'
    )
    _compile(cc, "-shared", "-fPIC", "-o", str(lib / "libllmgwtest.so"), str(src / "llmgwtest.c"))
    _compile(cc, "-shared", "-fPIC", "-o", str(lib / "libllmgwdep.so"), str(src / "llmgwdep.c"))
    rpath = f"-Wl,-rpath,{lib}"
    _compile(
        cc,
        "-shared",
        "-fPIC",
        "-o",
        str(bin_dir / "libggml-test.so"),
        str(src / "backend.c"),
        f"-L{lib}",
        "-lllmgwdep",
        rpath,
    )
    program = bin_dir / "llama-server"
    _compile(cc, "-o", str(program), str(src / "main.c"), f"-L{lib}", "-lllmgwtest", rpath)
    return program, lib / "libllmgwtest.so", lib / "libllmgwdep.so"


def test_a_missing_shared_library_fails_naming_it(tmp_path: Path, linked_program: tuple[Path, Path, Path]) -> None:
    program, own, backend_dep = linked_program
    config = node(tmp_path, engines={"llama.cpp": str(program)})
    (check,) = doctor.engine_checks(config, {})
    assert check.status == "pass", check
    assert "build 6500 (commit abc1234)" in check.detail and "libraries found" in check.detail

    own.unlink()
    (check,) = doctor.engine_checks(config, {})
    assert check.status == "fail"
    assert "libllmgwtest.so" in check.detail
    assert "libllmgwtest.so" in check.fix  # no package is known for it: says how to find one


def test_a_backend_library_next_to_the_binary_is_checked_too(
    tmp_path: Path, linked_program: tuple[Path, Path, Path]
) -> None:
    # A CUDA build whose runtime is missing still starts, on the CPU: the backend's ldd shows it.
    program, _, backend_dep = linked_program
    backend_dep.unlink()
    (check,) = doctor.engine_checks(node(tmp_path, engines={"llama.cpp": str(program)}), {})
    assert check.status == "fail"
    assert "libllmgwdep.so (needed by libggml-test.so)" in check.detail


def test_missing_libraries_name_the_package_to_install(tmp_path: Path) -> None:
    listing = tmp_path / "ldd-output.txt"
    listing.write_text(
        "\tlinux-vdso.so.1 (0x00007ffd1d5f2000)\n"
        "\tlibgomp.so.1 => not found\n"
        "\tlibcudart.so.12 => not found\n"
        "\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f0f1c000000)\n"
    )
    ldd = script(tmp_path / "tools" / "ldd", f"cat {shlex.quote(str(listing))}\n")
    engine = script(tmp_path / "engine" / "llama-server", "echo 'version: 6500 (abc1234)' >&2\n")
    config = node(tmp_path, engines={"llama.cpp": engine})
    config.tools["ldd"] = ldd
    (check,) = doctor.engine_checks(config, {})
    assert check.status == "fail"
    assert "libgomp.so.1" in check.detail and "libcudart.so.12" in check.detail
    assert "apt-get install libgomp1" in check.fix
    assert "CUDA runtime archive for this build" in check.fix


@pytest.mark.parametrize(
    ("library", "expected"),
    [
        ("libgomp.so.1", "install libgomp1: apt-get install libgomp1"),
        ("libvulkan.so.1", "apt-get install libvulkan1"),
        ("libssl.so.3", "apt-get install libssl3"),
        ("libcrypto.so.3", "apt-get install libssl3"),
        ("libstdc++.so.6", "apt-get install libstdc++6"),
        ("libcuda.so.1", "the NVIDIA driver"),
        ("libcudart.so.12", "the CUDA runtime archive for this build"),
        ("libcudart.so.13", "the CUDA runtime archive for this build"),
        ("libcublas.so.12", "the CUDA runtime archive for this build"),
        ("libcublasLt.so.13", "the CUDA runtime archive for this build"),
        ("libsomething.so.7", "find the package that ships libsomething.so.7"),
    ],
)
def test_library_fixes(library: str, expected: str) -> None:
    assert expected in doctor.library_fix([library])


def test_one_package_is_named_once() -> None:
    assert doctor.library_fix(["libssl.so.3", "libcrypto.so.3"]) == "install libssl3: apt-get install libssl3"


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (
            "echo 'version: 6500 (abc1234)' >&2\necho 'built with GNU 12.2.0 for Linux x86_64' >&2\n",
            "pass",
            "build 6500",
        ),
        ("echo 'version: 0.3.0-dev (build 10807, commit 163a4079)' >&2\n", "pass", "0.3.0-dev build 10807"),
        ("echo 'INFO loading'\necho '0.6.3.post1'\n", "pass", "version 0.6.3.post1"),
        ("echo 'usage: llama-server [options]'\n", "warn", "printed no version"),
        ("echo 'error: unknown argument: --version' >&2\nexit 1\n", "fail", "status 1: error: unknown argument"),
        ("exit 2\n", "fail", "status 2 and printed nothing"),
    ],
)
def test_engine_version_answers(tmp_path: Path, body: str, status: str, fragment: str) -> None:
    engine = script(tmp_path / "engine" / "llama-server", body)
    (check,) = doctor.engine_checks(node(tmp_path, engines={"llama.cpp": engine}), {})
    assert check.status == status, check
    assert fragment in check.detail
    if status == "pass":
        assert "static binary" in check.detail  # a script is no dynamic executable: ldd passes it
    else:
        assert check.fix


def test_an_engine_that_hangs_on_version_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "VERSION_TIMEOUT_S", 0.5)
    engine = script(tmp_path / "engine" / "llama-server", "sleep 30\n")
    (check,) = doctor.engine_checks(node(tmp_path, engines={"llama.cpp": engine}), {})
    assert check.status == "fail"
    assert "did not answer within 0.5 s" in check.detail


def test_engine_files_that_cannot_run(tmp_path: Path) -> None:
    plain = tmp_path / "engine" / "not-executable"
    plain.parent.mkdir()
    plain.write_text("#!/bin/sh\n")
    engines = {
        "gone": str(tmp_path / "engine" / "gone"),
        "plain": str(plain),
        "directory": str(tmp_path / "engine"),
        "nameless": "llmgw-no-such-engine-binary",
    }
    found = by_name(doctor.engine_checks(node(tmp_path, engines=engines), {}))
    assert found["engine gone"].status == "fail" and "does not exist" in found["engine gone"].detail
    assert found["engine plain"].status == "fail" and found["engine plain"].fix == f"chmod +x {plain}"
    assert found["engine directory"].status == "fail" and "not a file" in found["engine directory"].detail
    assert "not found on PATH" in found["engine nameless"].detail


def test_a_fresh_node_has_no_engine_yet(tmp_path: Path) -> None:
    assert doctor.engine_checks(node(tmp_path)) == [
        Check(
            "engines",
            "warn",
            "none installed yet",
            "the agent installs one when the control plane places a model here; "
            "or name a binary under engines: in agent.yaml",
        )
    ]


def test_the_manifest_is_read_from_the_state_dir(tmp_path: Path) -> None:
    engine = script(
        tmp_path / "engines" / "llama.cpp" / "b6400" / "llama-server", "echo 'version: 6500 (abc1234)' >&2\n"
    )
    other = script(tmp_path / "opt" / "llama-server", "echo 'version: 6600 (def5678)' >&2\n")
    config = node(tmp_path, engines={"llama.cpp": other})
    manifest = config.state_dir / "engines" / "installed.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(
        json.dumps(
            {"llama.cpp": {"version": "b6400", "build": "cpu-x64", "path": engine, "dir": os.path.dirname(engine)}}
        )
    )
    found = by_name(doctor.engine_checks(config))
    # the binary was swapped under the manifest: it reports 6500, the record says b6400
    assert found["engine llama.cpp"].status == "warn"
    assert "records b6400" in found["engine llama.cpp"].detail and "build 6500" in found["engine llama.cpp"].detail
    # agent.yaml names another binary for the same engine: checked under its own name
    assert found["engine llama.cpp (agent.yaml)"].status == "pass"
    assert "build 6600" in found["engine llama.cpp (agent.yaml)"].detail


def test_an_unreadable_manifest_is_a_warning(tmp_path: Path) -> None:
    config = node(tmp_path)
    manifest = config.state_dir / "engines" / "installed.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{not json")
    found = by_name(doctor.engine_checks(config))
    assert found["engines manifest"].status == "warn" and "not valid JSON" in found["engines manifest"].detail
    assert found["engines"].detail == "none installed yet"
    manifest.write_text('{"llama.cpp": {"version": "b1"}}')
    found = by_name(doctor.engine_checks(config))
    assert found["engine llama.cpp"].status == "warn" and "no binary path" in found["engine llama.cpp"].detail


# --------------------------------------------------------------------------- GPUs


def test_a_cpu_node_has_no_gpu_and_that_is_fine(tmp_path: Path) -> None:
    assert doctor.gpu_checks(node(tmp_path)) == [Check("gpu driver", "pass", "no NVIDIA GPU (CPU node)")]


def test_a_loaded_driver_without_nvidia_smi_fails(tmp_path: Path) -> None:
    config = node(tmp_path)
    proc_driver = Path(config.root) / "proc" / "driver" / "nvidia"
    proc_driver.mkdir(parents=True)
    (proc_driver / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
    )
    (check,) = doctor.gpu_checks(config)
    assert check.status == "fail"
    assert "kernel module 550.54.15" in check.detail and "nvidia-smi" in check.detail


def test_nvidia_smi_that_cannot_reach_the_driver_fails_with_its_message(tmp_path: Path) -> None:
    tool = script(
        tmp_path / "bin" / "nvidia-smi",
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
        'Make sure that the latest NVIDIA driver is installed and running."\nexit 9\n',
    )
    config = node(tmp_path)
    config.tools["nvidia-smi"] = tool
    (check,) = doctor.gpu_checks(config)
    assert check.status == "fail"
    assert "couldn't communicate with the NVIDIA driver" in check.detail
    assert check.fix


@pytest.mark.parametrize("path", fixture_files("nvidia-smi-q") + fixture_files("nvidia-smi-q-xml"))
def test_on_captured_gpu_hardware(tmp_path: Path, path: Path) -> None:
    """nvidia-smi answers with a real capture; the doctor prints what the probe parser reads from it."""
    text = read_text(path)
    report = parse_nvidia_smi_xml(text) if path.suffix == ".xml" else parse_nvidia_smi_text(text)
    config = node(tmp_path)
    config.tools["nvidia-smi"] = script(tmp_path / "bin" / "nvidia-smi", f"cat {shlex.quote(str(path))}\n")
    found = by_name(doctor.gpu_checks(config))
    driver, devices = found["gpu driver"], found["gpu devices"]
    assert report.driver_version is not None
    assert f"driver {report.driver_version}" in driver.detail
    assert driver.status == ("warn" if int(report.driver_version.split(".")[0]) < 570 else "pass")
    assert re.search(rf"\b{len(report.gpus)} GPUs?: ", devices.detail), devices.detail
    for gpu in report.gpus:
        assert (gpu.name or "unnamed GPU") in devices.detail
    mig = any((gpu.mig_mode or "").lower() == "enabled" for gpu in report.gpus)
    assert ("MIG enabled" in devices.detail) == mig
    troubled = mig or report.warnings or any(g.remapped_rows_pending or g.ecc_uncorrected_volatile for g in report.gpus)
    assert devices.status == ("warn" if troubled else "pass")
    # Whether vLLM can be installed here: CUDA 13 from driver 580, CUDA 12.9 from 525, Turing or newer.
    vllm = found["vllm"]
    major = int(report.driver_version.split(".")[0])
    ccs = [compute_capability({"name": g.name, "architecture": g.architecture}) for g in report.gpus]
    old = [cc for cc in ccs if cc is not None and cc < (7, 5)]
    if old:
        assert vllm.status == "warn" and "needs compute capability 7.5 or newer" in vllm.detail, vllm
    else:
        installable = vllm.detail.split(";")[0] if vllm.detail.startswith("can be installed: ") else ""
        assert ("CUDA 13.0 (cu130)" in installable) == (major >= 580), vllm
        assert ("CUDA 12.9 (cu129)" in installable) == (major >= 525), vllm
        assert vllm.status == ("pass" if major >= 525 and shutil.which("gcc") else "warn"), vllm
        if major < 525:
            assert f"needs NVIDIA driver 525 or newer, this node has {major}" in vllm.detail, vllm


# --------------------------------------------------------------------------- CPU

X86_NO_AVX2 = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 15
model\t\t: 6
model name\t: Common KVM processor
flags\t\t: {flags}

""".format(
    flags="fpu de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ht syscall nx "
    "lm constant_tsc nopl xtopology cpuid tsc_known_freq pni cx16 x2apic hypervisor lahf_lm cpuid_fault pti"
)

ARM64 = """processor\t: 0
BogoMIPS\t: 50.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1

"""


def cpu_node(tmp_path: Path, cpuinfo: str | bytes) -> AgentConfig:
    config = node(tmp_path)
    target = Path(config.root) / "proc" / "cpuinfo"
    if isinstance(cpuinfo, bytes):
        target.write_bytes(cpuinfo)
    else:
        target.write_text(cpuinfo)
    return config


@pytest.mark.parametrize("path", fixture_files("proc-cpuinfo"))
def test_avx2_on_captured_cpus(tmp_path: Path, path: Path) -> None:
    cpu = parse_cpuinfo(read_text(path))
    (check,) = doctor.cpu_checks(cpu_node(tmp_path, path.read_bytes()))
    assert check.name == "avx2"
    if cpu.has_avx2:
        assert check.status == "pass"
        assert check.detail.startswith("AVX2")
        assert ("AVX-512" in check.detail) == bool(cpu.has_avx512)
    else:
        assert check.status == "warn"
        assert "no AVX2" in check.detail and "host-passthrough" in check.detail


def test_a_vm_cpu_type_that_hides_avx2_is_a_warning(tmp_path: Path) -> None:
    (check,) = doctor.cpu_checks(cpu_node(tmp_path, X86_NO_AVX2))
    assert check.status == "warn"
    assert check.detail.startswith("this CPU has no AVX2 (Common KVM processor): llama.cpp's CPU build runs about 5×")
    assert "host-passthrough" in check.fix


def test_arm_needs_no_avx2(tmp_path: Path) -> None:
    assert doctor.cpu_checks(cpu_node(tmp_path, ARM64)) == [Check("avx2", "pass", "arm64: NEON, dotprod")]


def test_an_unreadable_cpuinfo_is_unknown_not_fine(tmp_path: Path) -> None:
    (check,) = doctor.cpu_checks(node(tmp_path))
    assert check.status == "warn" and "cannot read" in check.detail and "unknown" in check.detail


# --------------------------------------------------------------------------- model directories


def with_mounts(tmp_path: Path, *lines: str, **changes: Any) -> AgentConfig:
    config = node(tmp_path, **changes)
    mountinfo = Path(config.root) / "proc" / "self" / "mountinfo"
    mountinfo.parent.mkdir(parents=True, exist_ok=True)
    mountinfo.write_text("22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n" + "".join(lines))
    return config


def test_model_dirs_show_their_file_system_and_free_space(tmp_path: Path) -> None:
    local, filer = tmp_path / "models", tmp_path / "filer" / "models"
    local.mkdir()
    filer.mkdir(parents=True)
    config = with_mounts(
        tmp_path,
        f"40 22 0:52 / {tmp_path / 'filer'} rw,relatime - nfs4 filer:/export rw\n",
        model_dirs=[str(local), str(filer), str(tmp_path / "missing"), str(tmp_path / "state.txt")],
    )
    (tmp_path / "state.txt").write_text("")
    found = by_name(doctor.model_dir_checks(config))
    assert found[f"model dir {local}"].status == "pass"
    assert re.match(r"ext4 on /; \S+ \S+ free of \S+ \S+ \(\d+%\)$", found[f"model dir {local}"].detail)
    assert found[f"model dir {filer}"].detail.startswith(f"nfs4 on {tmp_path / 'filer'}, shared; ")
    assert found[f"model dir {tmp_path / 'missing'}"] == Check(
        f"model dir {tmp_path / 'missing'}",
        "fail",
        "does not exist",
        f"create it (mkdir -p {tmp_path / 'missing'}), mount the filer, or remove it from model_dirs",
    )
    assert found[f"model dir {tmp_path / 'state.txt'}"].detail == "is not a directory"


def test_a_nearly_full_model_dir_is_a_warning(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    config = with_mounts(tmp_path, model_dirs=[str(tmp_path / "models")])

    def full(path: str) -> SimpleNamespace:
        return SimpleNamespace(f_blocks=1_000_000, f_frsize=4096, f_bavail=20_000)

    (check,) = doctor.model_dir_checks(config, statvfs=full)
    assert check.status == "warn"
    assert "nearly full: 78.1 MiB free of 3.8 GiB (2%)" in check.detail


def test_free_space_that_cannot_be_read_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    config = with_mounts(tmp_path, model_dirs=[str(tmp_path / "models")])

    def broken(path: str) -> Any:
        raise OSError(5, "Input/output error")

    (check,) = doctor.model_dir_checks(config, statvfs=broken)
    assert check.status == "warn" and "free space unknown" in check.detail


def test_a_hung_filer_fails_instead_of_hanging(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    config = with_mounts(tmp_path, model_dirs=[str(tmp_path / "models")])
    release = threading.Event()

    def hung(path: str) -> Any:
        release.wait(10)
        raise OSError(110, "Connection timed out")

    try:
        (check,) = doctor.model_dir_checks(config, timeout=0.2, statvfs=hung)
    finally:
        release.set()
    assert check.status == "fail" and "did not finish within 0.2 s" in check.detail


def test_an_unreadable_model_dir_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.mkdir()
    config = with_mounts(tmp_path, model_dirs=[str(secret)])
    if os.geteuid() == 0:
        # root reads everything: have the permission check answer as it does for another user
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(secret) else real_access(p, mode))
    else:
        secret.chmod(0)
    try:
        (check,) = doctor.model_dir_checks(config)
    finally:
        secret.chmod(0o755)
    assert check.status == "fail" and "not readable" in check.detail


def test_no_model_dirs_is_a_warning(tmp_path: Path) -> None:
    (check,) = doctor.model_dir_checks(node(tmp_path))
    assert (check.name, check.status) == ("model dirs", "warn")
    assert "no model_dirs in agent.yaml" in check.detail


# --------------------------------------------------------------------------- control plane and clock


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    status = 200
    date_offset: float | None = 0.0


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        status = self.server.status if self.path == "/healthz" else 404
        body = b'{"status": "ok"}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def date_time_string(self, timestamp: float | None = None) -> str:
        offset = self.server.date_offset
        return "" if offset is None else formatdate(time.time() + offset, usegmt=True)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(*, status: int = 200, date_offset: float | None = 0.0, tls: ssl.SSLContext | None = None) -> Iterator[int]:
    """A control plane on 127.0.0.1 answering /healthz with `status` and a Date `date_offset` s off."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.status, server.date_offset = status, date_offset
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, Path]]:
    """Self-signed certificates for 127.0.0.1, valid for 90 and for 10 days: {days: (cert, key)}."""
    pytest.importorskip("cryptography", reason="the cryptography package makes the test certificates")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = tmp_path_factory.mktemp("certs")
    made = {}
    for days in (90, 10):
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw doctor test")])
        start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(hours=1)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days, hours=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        cert_path, key_path = folder / f"cert-{days}.pem", folder / f"key-{days}.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        made[days] = (cert_path, key_path)
    return made


def server_tls(cert: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*cert)
    return context


def control_plane(tmp_path: Path, server: str, **kwargs: Any) -> dict[str, Check]:
    return by_name(doctor.control_plane_checks(node(tmp_path, server=server), **kwargs))


def test_a_healthy_control_plane_with_the_same_time_passes(tmp_path: Path) -> None:
    with serving() as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}")
    assert list(found) == ["control plane", "certificate", "clock"]
    assert found["control plane"] == Check("control plane", "pass", f"http://127.0.0.1:{port}: /healthz answered 200")
    assert found["certificate"].status == "pass" and "loopback" in found["certificate"].detail
    assert found["clock"].status == "pass"
    assert doctor.exit_status(list(found.values())) == 0


@pytest.mark.parametrize(
    ("offset", "status", "direction"),
    [(-90, "fail", "ahead of"), (90, "fail", "behind"), (-20, "warn", "ahead of")],
)
def test_a_clock_off_the_control_plane(tmp_path: Path, offset: int, status: str, direction: str) -> None:
    with serving(date_offset=offset) as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}")
    assert found["control plane"].status == "pass"
    clock = found["clock"]
    assert clock.status == status
    match = re.match(rf"this node's clock is (\d+) s {direction} the control plane", clock.detail)
    assert match, clock.detail
    # the Date header has whole seconds: the skew read is within a second of the offset
    assert abs(int(match.group(1)) - abs(offset)) <= 1
    assert "timedatectl" in clock.fix


def test_the_clock_is_compared_with_now_when_given(tmp_path: Path) -> None:
    with serving() as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}", now=time.time() - 3600)
    assert found["clock"].status == "fail" and "behind" in found["clock"].detail


def test_without_a_date_header_the_clock_is_not_claimed_fine(tmp_path: Path) -> None:
    with serving(date_offset=None) as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}")
    assert found["clock"].status == "warn"
    assert found["clock"].detail == "not compared: the control plane's answer has no Date header"


@pytest.mark.parametrize(
    ("status", "path", "answered"), [(503, "", "503 Service Unavailable"), (200, "/elsewhere", "404")]
)
def test_an_unhealthy_answer_is_a_warning_with_its_status(
    tmp_path: Path, status: int, path: str, answered: str
) -> None:
    with serving(status=status) as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}{path}")
    assert found["control plane"].status == "warn"
    assert f"{path}/healthz answered {answered}" in found["control plane"].detail
    assert found["clock"].status == "pass"  # any answer carries the server's time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_closed_port_cannot_be_connected_to(tmp_path: Path) -> None:
    port = free_port()
    found = control_plane(tmp_path, f"http://127.0.0.1:{port}")
    assert found["control plane"].status == "fail"
    assert found["control plane"].detail.startswith(f"cannot connect to 127.0.0.1:{port}: ")
    assert found["clock"] == Check("clock", "warn", "not compared: the control plane did not answer")
    assert doctor.exit_status(list(found.values())) == 1


def test_plain_http_across_the_network_is_a_warning(tmp_path: Path) -> None:
    # 192.0.2.0/24 is reserved for documentation: nothing answers there.
    found = control_plane(tmp_path, "http://192.0.2.1:9", timeout=0.3)
    assert found["certificate"].status == "warn"
    assert found["certificate"].detail == "plain http: the node credential crosses the network unencrypted"
    assert found["control plane"].status == "fail"


def test_a_host_that_does_not_resolve(tmp_path: Path) -> None:
    found = control_plane(tmp_path, "https://llmgw-doctor-test.invalid")
    assert found["control plane"].status == "fail" and "cannot resolve" in found["control plane"].detail
    assert found["clock"].status == "warn"


def test_a_self_signed_certificate_fails_verification(
    tmp_path: Path, certificates: dict[int, tuple[Path, Path]]
) -> None:
    with serving(tls=server_tls(certificates[90])) as port:
        found = control_plane(tmp_path, f"https://127.0.0.1:{port}")
    plane = found["control plane"]
    assert plane.status == "fail"
    assert "certificate verify failed: self" in plane.detail and "signed certificate" in plane.detail
    assert "certificate" not in found  # nothing verified to report on
    # The clock is still read, over a connection it says was not verified: a clock far off is
    # itself a cause of certificates that are "not yet valid".
    assert found["clock"].status == "pass" and "not verified" in found["clock"].detail


def test_a_trusted_certificate_reports_its_expiry(
    tmp_path: Path, certificates: dict[int, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates[90][0]))
    with serving(tls=server_tls(certificates[90])) as port:
        found = control_plane(tmp_path, f"https://127.0.0.1:{port}")
    assert found["control plane"].status == "pass", found["control plane"]
    assert found["certificate"].status == "pass"
    assert re.match(
        r"valid until \d{4}-\d\d-\d\d \((89|90) days\), issued by llmgw doctor test$", found["certificate"].detail
    )
    assert found["clock"].status == "pass"

    monkeypatch.setenv("SSL_CERT_FILE", str(certificates[10][0]))
    with serving(tls=server_tls(certificates[10])) as port:
        found = control_plane(tmp_path, f"https://127.0.0.1:{port}")
    assert found["certificate"].status == "warn" and re.match(r"expires in (9|10) days", found["certificate"].detail)


def test_https_to_a_plain_http_server_and_http_to_a_tls_one(
    tmp_path: Path, certificates: dict[int, tuple[Path, Path]]
) -> None:
    with serving() as port:
        found = control_plane(tmp_path, f"https://127.0.0.1:{port}")
    assert found["control plane"].status == "fail" and "TLS handshake" in found["control plane"].detail
    with serving(tls=server_tls(certificates[90])) as port:
        found = control_plane(tmp_path, f"http://127.0.0.1:{port}")
    assert found["control plane"].status == "fail" and "no HTTP answer" in found["control plane"].detail


# --------------------------------------------------------------------------- the whole run and its output


AVX2_CPU = X86_NO_AVX2.replace("model name\t: Common KVM processor", "model name\t: Test CPU").replace(
    " pti", " avx avx2 fma pti"
)


def test_a_whole_cpu_node(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    engine = script(tmp_path / "engine" / "llama-server", "echo 'version: 6500 (abc1234)' >&2\n")
    with serving() as port:
        config = with_mounts(
            tmp_path,
            server=f"http://127.0.0.1:{port}",
            model_dirs=[str(tmp_path / "models")],
            engines={"llama.cpp": engine},
        )
        (Path(config.root) / "proc" / "cpuinfo").write_text(AVX2_CPU)
        checks = doctor.run_checks(config)
    assert [(c.name, c.status) for c in checks] == [
        ("engine llama.cpp", "pass"),
        ("gpu driver", "pass"),
        ("avx2", "pass"),
        (f"model dir {tmp_path / 'models'}", "pass"),
        ("control plane", "pass"),
        ("certificate", "pass"),
        ("clock", "pass"),
    ]
    assert doctor.exit_status(checks) == 0
    lines = doctor.format_lines(checks).splitlines()
    assert len(lines) == len(checks)
    assert lines[2] == "pass  avx2                 AVX2 and FMA present (Test CPU)"
    assert all(line.split()[0] in STATUSES for line in lines)


def test_a_check_that_breaks_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(config: AgentConfig) -> list[Check]:
        raise RuntimeError("parser bug")

    monkeypatch.setattr(doctor, "gpu_checks", broken)
    checks = doctor.run_checks(node(tmp_path), installed={}, timeout=0.5)
    found = by_name(checks)
    assert found["gpu driver"] == Check("gpu driver", "fail", "the check itself failed: RuntimeError: parser bug")
    assert doctor.exit_status(checks) == 1


def test_format_lines() -> None:
    checks = [
        Check("avx2", "pass", "AVX2 and FMA present"),
        Check("engines", "warn", "none installed yet", "wait for a model"),
        Check("gpu driver", "fail", "nvidia-smi failed:\n  No devices\twere found", "reboot"),
        Check("a very long check name indeed", "pass", "ok"),
    ]
    assert doctor.format_lines(checks) == (
        "pass  avx2                 AVX2 and FMA present\n"
        "warn  engines              none installed yet — wait for a model\n"
        "fail  gpu driver           nvidia-smi failed: No devices were found — reboot\n"
        "pass  a very long check name indeed ok"
    )
    assert doctor.format_lines([]) == ""


def test_exit_status_and_as_dict() -> None:
    passed, warned, failed = Check("a", "pass", "ok"), Check("b", "warn", "hm", "do x"), Check("c", "fail", "no")
    assert doctor.exit_status([]) == 0
    assert doctor.exit_status([passed, warned]) == 0
    assert doctor.exit_status([passed, warned, failed]) == 1
    assert warned.as_dict() == {"name": "b", "status": "warn", "detail": "hm", "fix": "do x"}
