"""The checks behind ``llmgw doctor``: is this node fit to run engines for the control plane?

Each check reads a file or runs a tool with a timeout and gives one :class:`Check`: ``pass``,
``warn`` or ``fail``, what was found (with numbers), and what to do about it.  Nothing here
raises: a check that meets an error it did not expect reports that error as its finding.
Unknown is not fine: a value that could not be read is reported as a warning, never as a pass.

The probes' parsers are reused (``agent.probes.nvidia`` for nvidia-smi, ``agent.probes.procfs``
for /proc/cpuinfo, ``agent.probes.storage`` for mounts and free space), so the doctor sees the
node the way the agent reports it.

No Django import; importable on Python 3.11.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import json
import os
import platform
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from agent.config import AgentConfig
from agent.install.verify import NOT_FOUND_RE, library_fix, parse_version
from agent.main import parse_engine_version
from agent.probes import amd, nvidia, nvlink, procfs, storage

if TYPE_CHECKING:
    from agent.probes.infiniband import SmInfo

__all__ = [
    "FAIL",
    "PASS",
    "WARN",
    "Check",
    "amd_checks",
    "control_plane_checks",
    "cpu_checks",
    "engine_checks",
    "exit_status",
    "format_lines",
    "gpu_checks",
    "install_checks",
    "library_fix",
    "load_installed",
    "model_dir_checks",
    "run_checks",
]

PASS = "pass"
WARN = "warn"
FAIL = "fail"

#: An engine's ``--version`` (vLLM imports torch before it answers).
VERSION_TIMEOUT_S = 15.0
#: ``nvidia-smi -q`` on an eight-GPU host without persistence mode takes several seconds.
NVIDIA_SMI_TIMEOUT_S = 20.0
#: Drivers below this cannot run CUDA 12.8 builds on GPUs those builds ship only as PTX.
DRIVER_MIN_CUDA_12_8 = 570
#: CUDA 13 builds (llama.cpp, vLLM's cu13 wheels) need this driver branch.
DRIVER_MIN_CUDA_13 = 580
CERT_WARN_DAYS = 14
CLOCK_WARN_S = 5.0
CLOCK_FAIL_S = 60.0
FREE_WARN_FRACTION = 0.05
NAME_WIDTH = 20
# Shared libraries scanned next to an engine binary (llama.cpp loads its GPU backends from there).
_MAX_LIBRARIES = 64

_T = TypeVar("_T")


@dataclass(frozen=True)
class Check:
    """One finding: ``name`` is a short stable id, ``status`` is pass, warn or fail."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


# --------------------------------------------------------------------------- running things


@dataclass(frozen=True)
class _Result:
    returncode: int | None  # None when it could not be started or did not finish in time
    stdout: str
    stderr: str
    problem: str | None = None  # why there is no return code


def _run(argv: Sequence[str], timeout: float) -> _Result:
    """Run a tool in its own process group with the C locale; kill the group on timeout."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LLMGW_")}
    env["LC_ALL"] = "C"
    try:
        process = subprocess.Popen(  # noqa: S603 - the operator's tools and engines
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        return _Result(None, "", "", f"cannot run {argv[0]}: {exc.strerror or exc}")
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.communicate(timeout=2)
        return _Result(None, "", "", f"{argv[0]} did not answer within {timeout:g} s")
    return _Result(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def _in_thread(fn: Callable[[], _T], timeout: float, what: str) -> _T:  # noqa: UP047 - runs on Python 3.11
    """``fn()`` with a time limit, for calls that can hang in the kernel (a dead NFS mount, DNS).

    A call that overruns is left behind in a daemon thread, which does not keep the process alive.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller below
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"doctor: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what} did not finish within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def _read(root: str, relative: str) -> tuple[str | None, str | None]:
    """(text, None), or (None, why it could not be read)."""
    path = os.path.join(root, relative.lstrip("/"))
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read(), None
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror or exc}"


def _one_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _guarded(name: str, produce: Callable[[], list[Check]]) -> list[Check]:
    """The checks ``produce`` gives, or one failed check that says what went wrong."""
    try:
        return produce()
    except Exception as exc:
        return [Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")]


# --------------------------------------------------------------------------- engines

_TAG_RE = re.compile(r"^b(\d+)$")


def _ldd_missing(ldd: str, target: str, timeout: float) -> tuple[list[str] | None, str]:
    """(libraries ldd reports missing, how the binary links); None when ldd could not tell."""
    result = _run([ldd, target], timeout)
    if result.returncode is None:
        return None, f"libraries not checked ({result.problem})"
    text = result.stdout + result.stderr
    if "not a dynamic executable" in text or "statically linked" in text:
        return [], "static binary"
    return sorted(set(NOT_FOUND_RE.findall(text))), "libraries found"


def _neighbour_libraries(directories: Iterable[str]) -> list[str]:
    """Shared libraries that sit in the engine's directories (its backends and bundled runtimes)."""
    found: list[str] = []
    for directory in directories:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            if (name.endswith(".so") or ".so." in name) and os.path.isfile(path) and path not in found:
                found.append(path)
    return found[:_MAX_LIBRARIES]


def _describe_version(version: str) -> str:
    new = re.search(r"\(build (\d+), commit ([0-9A-Za-z]+)\)", version)
    if new:
        release = version[: new.start()].strip()
        prefix = f"{release} " if release else ""
        return f"{prefix}build {new.group(1)} (commit {new.group(2)})"
    old = re.match(r"^(\d+) \(([0-9A-Za-z]+)\)$", version)
    if old:
        return f"build {old.group(1)} (commit {old.group(2)})"
    return f"version {version}"


def _build_number(version: str) -> int | None:
    parsed = parse_version(f"version: {version}")
    return parsed[0] if parsed else None


def _engine_check(
    label: str, binary: str, entry: Mapping[str, Any] | None, config: AgentConfig, timeout: float
) -> Check:
    where = "installed.json" if entry is not None else "agent.yaml engines:"
    path = binary if os.sep in binary else shutil.which(binary)
    if path is None:
        return Check(label, FAIL, f"{binary} not found on PATH", f"give its absolute path in {where}")
    if not os.path.exists(path):
        return Check(label, FAIL, f"{path} does not exist", f"reinstall the engine or correct its path in {where}")
    if not os.path.isfile(path):
        return Check(label, FAIL, f"{path} is not a file", f"correct its path in {where}")
    if not os.access(path, os.X_OK):
        return Check(label, FAIL, f"{path} is not executable", f"chmod +x {path}")

    ldd = config.tools.get("ldd", "ldd")
    missing: list[str] = []
    needed_by: dict[str, str] = {}
    missing_own, linking = _ldd_missing(ldd, path, timeout)
    for library in missing_own or []:
        if library not in missing:
            missing.append(library)
    directories = [os.path.dirname(os.path.abspath(path))]
    if entry is not None and isinstance(entry.get("dir"), str) and entry["dir"] not in directories:
        directories.append(entry["dir"])
    if missing_own is not None:
        for library_path in _neighbour_libraries(directories):
            for library in _ldd_missing(ldd, library_path, timeout)[0] or []:
                if library not in missing:
                    missing.append(library)
                    needed_by[library] = os.path.basename(library_path)
    if missing:
        names = ", ".join(f"{lib} (needed by {needed_by[lib]})" if lib in needed_by else lib for lib in missing)
        return Check(label, FAIL, f"{path}: missing shared libraries: {names}", library_fix(missing))

    result = _run([path, "--version"], VERSION_TIMEOUT_S)
    output = result.stdout + result.stderr
    if result.returncode is None:
        return Check(label, FAIL, f"{path} --version: {result.problem}", "run it by hand to see what it waits for")
    if result.returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        said = f": {_one_line(lines[-1], 200)}" if lines else " and printed nothing"
        return Check(
            label,
            FAIL,
            f"{path} --version exited with status {result.returncode}{said}",
            "run it by hand; reinstall the engine if it is damaged or built for another CPU",
        )

    version = parse_engine_version(output)
    extras = [linking]
    if entry is not None and isinstance(entry.get("build"), str) and entry["build"]:
        extras.insert(0, f"{entry['build']} build")
    if version is None:
        return Check(
            label,
            WARN,
            f"{path} --version ran but printed no version",
            "the control plane will list this engine with an unknown version",
        )
    found = _describe_version(version)
    detail = f"{found}, {', '.join(extras)}, {path}"
    recorded = entry.get("version") if entry is not None else None
    tag = _TAG_RE.match(recorded) if isinstance(recorded, str) else None
    build = _build_number(version)
    if tag and build is not None and int(tag.group(1)) != build:
        return Check(
            label,
            WARN,
            f"{detail}; installed.json records {recorded}",
            "the binary and the record of it disagree: reinstall the engine",
        )
    return Check(label, PASS, detail)


def _python_engine_check(label: str, entry: Mapping[str, Any], timeout: float) -> Check:
    """A vLLM or SGLang environment: its Python runs and the engine's package is there, at its version."""
    from agent.install import pyenv

    name = label.removeprefix("engine ")
    env = str(entry.get("dir") or "")
    package = pyenv.PACKAGES.get(name, name)
    fix = "the agent withdraws it at its next re-check and builds it again; or remove " + env
    try:
        answer = pyenv.run_check(
            Path(env) / "bin" / "python", package, gpu=False, script=pyenv.RECHECK_SCRIPT, timeout=max(timeout, 30.0)
        )
    except pyenv.PythonError as exc:
        return Check(label, FAIL, f"{env}: {exc}", fix)
    torch = f", torch {entry['torch']}" if entry.get("torch") else ""
    cuda = f" (CUDA {entry['cuda']})" if entry.get("cuda") else ""
    build = f" ({entry['build']})" if entry.get("build") else ""
    return Check(label, PASS, f"{package} {answer.get('version')}{build}{torch}{cuda} at {env}")


def _safe_engine_check(
    label: str, binary: str, entry: Mapping[str, Any] | None, config: AgentConfig, timeout: float
) -> Check:
    try:
        if entry is not None and entry.get("kind") == "python":
            return _python_engine_check(label, entry, timeout)
        return _engine_check(label, binary, entry, config, timeout)
    except Exception as exc:
        return Check(label, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}")


def load_installed(config: AgentConfig) -> tuple[dict[str, Any], Check | None]:
    """The installed-engines manifest from ``<state_dir>/engines/installed.json`` ({} when absent),
    and a warning when it exists but cannot be read."""
    path = Path(config.state_dir) / "engines" / "installed.json"
    name = "engines manifest"
    try:
        text = _in_thread(path.read_text, 5.0, f"reading {path}")
    except FileNotFoundError:
        return {}, None
    except PermissionError:
        return {}, Check(name, WARN, f"cannot read {path}: permission denied", "run llmgw doctor as the agent's user")
    except (OSError, TimeoutError) as exc:
        return {}, Check(name, WARN, f"cannot read {path}: {exc}")
    shape = "a JSON object of engine name -> {version, build, path, dir}"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return {}, Check(name, WARN, f"{path} is not valid JSON ({exc})", f"it should hold {shape}")
    if not isinstance(data, dict):
        return {}, Check(name, WARN, f"{path} holds a {type(data).__name__}", f"it should hold {shape}")
    return data, None


def engine_checks(
    config: AgentConfig, installed: Mapping[str, Mapping[str, Any]] | None = None, *, timeout: float = 5.0
) -> list[Check]:
    """One check per engine in the manifest and per engine agent.yaml names (each binary once),
    and one per engine the agent could not install (`install_checks`)."""
    checks: list[Check] = []
    manifest: Mapping[str, Any]
    if installed is None:
        manifest, problem = load_installed(config)
        if problem is not None:
            checks.append(problem)
    else:
        manifest = installed
    seen: dict[str, str] = {}  # real path -> label
    labels: set[str] = set()
    for name, entry in manifest.items():
        label = f"engine {name}"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("path"), str) or not entry["path"]:
            checks.append(Check(label, WARN, "installed.json has no binary path for it", "reinstall the engine"))
            labels.add(label)
            continue
        seen[os.path.realpath(entry["path"])] = label
        labels.add(label)
        checks.append(_safe_engine_check(label, entry["path"], entry, config, timeout))
    for name, binary in config.engines.items():
        label = f"engine {name}"
        resolved = binary if os.sep in binary else shutil.which(binary) or binary
        if os.path.realpath(resolved) in seen:
            continue
        if label in labels:
            label = f"engine {name} (agent.yaml)"
        seen[os.path.realpath(resolved)] = label
        labels.add(label)
        checks.append(_safe_engine_check(label, binary, None, config, timeout))
    # A failed re-check is about the installed engine, which its own check above already tests.
    checks += [
        c
        for c in install_checks(config)
        if not (c.name.removeprefix("install ") in manifest and c.detail.startswith("failed: re-check"))
    ]
    if not any(c.name.startswith(("engine ", "install ")) for c in checks):
        checks.append(
            Check(
                "engines",
                WARN,
                "none installed yet",
                "the agent installs one when the control plane places a model here; "
                "or name a binary under engines: in agent.yaml",
            )
        )
    return checks


#: What the agent's installer says of an engine it cannot install (agent.install.manager's
#: status.json): how bad each state is for this node.
_INSTALL_STATES = {"waiting:": WARN, "failed:": FAIL, "refused:": FAIL}


def install_checks(config: AgentConfig) -> list[Check]:
    """One check per engine the agent is waiting for, failed to install or refused an archive of
    (``<state_dir>/engines/status.json``), with the control plane's fix where it sent one: the
    command that gives this node an archive."""
    path = Path(config.state_dir) / "engines" / "status.json"
    try:
        data = json.loads(_in_thread(path.read_text, 5.0, f"reading {path}"))
    except FileNotFoundError:
        return []
    except (OSError, TimeoutError, ValueError) as exc:
        return [Check("engine installs", WARN, f"cannot read {path}: {exc}")]
    checks = []
    for name, state in sorted(data.items() if isinstance(data, dict) else []):
        status = state.get("status") if isinstance(state, Mapping) else None
        severity = next(
            (v for k, v in _INSTALL_STATES.items() if isinstance(status, str) and status.startswith(k)), None
        )
        if severity is None:
            continue
        fix = state.get("fix") if isinstance(state.get("fix"), str) else ""
        checks.append(Check(f"install {name}", severity, str(status), fix or _install_fix(str(status))))
    return checks


def _install_fix(status: str) -> str:
    if status.startswith("refused:"):
        return (
            "the archive offered is not the one published, or unsafe: give the control plane a good copy "
            "(llmgw engine-files fetch TAG, or llmgw engine-files add FILE)"
        )
    if status.startswith("waiting:"):
        return "the control plane has no archive for this node yet: see its engines on the cluster page"
    return "see the agent's log; the install is tried again every minute"


# --------------------------------------------------------------------------- GPUs

_NO_NVIDIA = "no NVIDIA GPU (CPU node)"
_KERNEL_MODULE_RE = re.compile(r"Kernel Module\b.*?\s(\d{3}\.\d+(?:\.\d+)?)\s")


def _gpu_summary(gpus: Sequence[nvidia.GpuInfo]) -> str:
    counts: dict[str, int] = {}
    for gpu in gpus:
        counts[gpu.name or "unnamed GPU"] = counts.get(gpu.name or "unnamed GPU", 0) + 1
    return ", ".join(f"{name} ×{count}" if count > 1 else name for name, count in counts.items())


def _gpu_report(tool: str) -> tuple[nvidia.GpuReport | None, str]:
    """The parsed ``nvidia-smi -q -x`` (else ``-q``) report, and what the tool said when it failed."""
    said: list[str] = []
    report: nvidia.GpuReport | None = None
    xml = _run([tool, "-q", "-x"], NVIDIA_SMI_TIMEOUT_S)
    if xml.returncode == 0 and xml.stdout.strip():
        report = nvidia.parse_nvidia_smi_xml(xml.stdout)
    else:
        said.append(xml.problem or xml.stdout.strip() or xml.stderr.strip() or f"exit status {xml.returncode}")
    if report is None or (not report.gpus and report.warnings):
        text = _run([tool, "-q"], NVIDIA_SMI_TIMEOUT_S)
        if text.returncode == 0 and text.stdout.strip():
            report = nvidia.parse_nvidia_smi_text(text.stdout)
        else:
            said.append(text.problem or text.stdout.strip() or text.stderr.strip() or f"exit status {text.returncode}")
    message = next((s for s in said if s), "no output")
    return report, _one_line(message, 300)


def _gpu_problems(gpus: Sequence[nvidia.GpuInfo]) -> tuple[list[str], list[str]]:
    """What is wrong with the GPUs (MIG, memory errors), and what to do about it."""
    problems: list[str] = []
    fixes: list[str] = []

    def advise(fix: str) -> None:
        if fix not in fixes:
            fixes.append(fix)

    mig = [gpu.index for gpu in gpus if (gpu.mig_mode or "").lower() == "enabled"]
    for gpu in gpus:
        where = f"GPU {gpu.index}" + (f" ({gpu.pci_bus_id})" if gpu.pci_bus_id else "")
        if gpu.index in mig:
            problems.append(f"{where}: MIG enabled, engines see its MIG instances, not the whole GPU")
        if gpu.remapped_rows_failure:
            problems.append(f"{where}: row remapping failed")
            advise("a GPU whose row remapping failed needs service")
        if gpu.remapped_rows_pending or gpu.retired_pages_pending:
            problems.append(f"{where}: memory {'rows to remap' if gpu.remapped_rows_pending else 'pages to retire'}")
            advise("reset the GPU (or reboot) to apply pending row remaps and page retirements")
        if gpu.ecc_uncorrected_volatile:
            problems.append(f"{where}: {gpu.ecc_uncorrected_volatile} uncorrected ECC errors since the last reset")
            advise("look at dmesg for Xid 48/63/94 and drain the GPU if errors keep coming")
    if mig:
        indices = ",".join(str(index) for index in mig)
        fixes.insert(
            0, f"where the whole GPU should serve, turn MIG off: nvidia-smi -i {indices} -mig 0, then reset it"
        )
    return problems, fixes


def gpu_checks(config: AgentConfig) -> list[Check]:
    """The checks "gpu driver" and "gpu devices", or one pass line on a node without an NVIDIA driver."""
    tool = config.tools.get("nvidia-smi", "nvidia-smi")
    found = shutil.which(tool)
    proc_driver = os.path.join(config.root, "proc", "driver", "nvidia")
    if found is None:
        if not os.path.isdir(proc_driver):
            return [Check("gpu driver", PASS, _NO_NVIDIA)]
        text, _ = _read(config.root, "proc/driver/nvidia/version")
        match = _KERNEL_MODULE_RE.search(text or "")
        module = f" (kernel module {match.group(1)})" if match else ""
        return [
            Check(
                "gpu driver",
                FAIL,
                f"the NVIDIA kernel driver is loaded{module} but {tool} is not found",
                "install the driver's utilities (nvidia-utils), or set tools: {nvidia-smi: /path} in agent.yaml",
            )
        ]
    report, message = _gpu_report(found)
    if report is None or (not report.gpus and report.driver_version is None):
        return [
            Check(
                "gpu driver",
                FAIL,
                f"nvidia-smi failed: {message}",
                "load or reinstall the NVIDIA driver (a kernel update without a DKMS rebuild often causes this); "
                "dmesg shows why it did not load",
            )
        ]
    checks: list[Check] = []
    driver = report.driver_version
    cuda = f", CUDA {report.cuda_version}" if report.cuda_version else ""
    if driver is None:
        checks.append(Check("gpu driver", WARN, f"nvidia-smi did not report a driver version{cuda}"))
    else:
        try:
            major: int | None = int(driver.split(".")[0])
        except ValueError:
            major = None
        if major is not None and major < DRIVER_MIN_CUDA_12_8:
            checks.append(
                Check(
                    "gpu driver",
                    WARN,
                    f"driver {driver}{cuda}: below {DRIVER_MIN_CUDA_12_8}",
                    f"upgrade the driver: CUDA 12.8 llama.cpp builds need driver ≥ {DRIVER_MIN_CUDA_12_8} for GPUs "
                    f"they ship only as PTX; CUDA 13 builds and vLLM's cu13 wheels need ≥ {DRIVER_MIN_CUDA_13}",
                )
            )
        elif major is not None and major < DRIVER_MIN_CUDA_13:
            checks.append(
                Check("gpu driver", PASS, f"driver {driver}{cuda} (CUDA 13 builds need ≥ {DRIVER_MIN_CUDA_13})")
            )
        else:
            checks.append(Check("gpu driver", PASS, f"driver {driver}{cuda}"))
    if not report.gpus:
        checks.append(Check("gpu devices", FAIL, "nvidia-smi lists no GPUs", "dmesg shows whether a GPU fell off"))
        return checks
    count = len(report.gpus)
    listing = f"{count} GPU{'s' if count != 1 else ''}: {_gpu_summary(report.gpus)}"
    problems, fixes = _gpu_problems(report.gpus)
    problems += [w if w.startswith("nvidia-smi") else f"nvidia-smi: {w}" for w in report.warnings]
    if problems:
        checks.append(Check("gpu devices", WARN, f"{listing}; " + "; ".join(problems), "; ".join(fixes)))
    else:
        checks.append(Check("gpu devices", PASS, listing))
    checks.append(_vllm_check(driver, report.gpus))
    return checks


def _vllm_check(driver: str | None, gpus: Sequence[nvidia.GpuInfo]) -> Check:
    """Whether this node can run vLLM's builds (CUDA 13 and the package index's CUDA 12.9), and
    whether Triton will find the C compiler it needs at the first model load."""
    from agent.install import pyenv
    from agent.install.builds import NodeFacts

    facts = NodeFacts(
        driver_version=driver or "0",
        gpus=tuple({"name": g.name, "architecture": g.architecture} for g in gpus),
    )
    variants = [pyenv.Variant("cu130", 13), pyenv.Variant("cu129", 12)]
    chosen, skipped = pyenv.choose_variants(facts, variants, pyenv.PythonEngine())
    gcc = shutil.which("gcc") is not None
    if not chosen:
        return Check(
            "vllm",
            WARN,
            "cannot be installed: " + "; ".join(skipped),
            "upgrade the NVIDIA driver, or run llama.cpp here",
        )
    detail = "can be installed: " + ", ".join(v.label for v in chosen)
    if skipped:
        detail += "; " + "; ".join(skipped)
    if not gcc:
        return Check(
            "vllm", WARN, detail + "; no gcc", "install gcc: Triton compiles its launcher at the first model load"
        )
    return Check("vllm", PASS, detail)


# --------------------------------------------------------------------------- AMD GPUs

_AMD_VENDOR = "0x1002"
#: PCI classes of an AMD GPU: display controllers (0x03….) and processing accelerators (0x12…., Instinct).
_GPU_CLASSES = ("0x03", "0x12")
_MAX_PCI_DEVICES = 4096
ROCMINFO_TIMEOUT_S = 20.0
_ROCM_VERSION_RE = re.compile(r"^(\d+\.\d+)(?:\.\d+)?(?:-\S*)?$")
Access = Callable[[str, int], bool]


def _amd_pci(root: str) -> list[str]:
    """PCI addresses of the AMD GPUs in ``<root>/sys/bus/pci/devices``, in order."""
    base = os.path.join(root, "sys", "bus", "pci", "devices")
    try:
        names = sorted(os.listdir(base))[:_MAX_PCI_DEVICES]
    except OSError:
        return []
    found = []
    for name in names:
        vendor, _ = _read(root, f"sys/bus/pci/devices/{name}/vendor")
        if (vendor or "").strip().lower() != _AMD_VENDOR:
            continue
        kind, _ = _read(root, f"sys/bus/pci/devices/{name}/class")
        if (kind or "").strip().lower().startswith(_GPU_CLASSES):
            found.append(name)
    return found


def _amdgpu_loaded(root: str) -> tuple[bool | None, str]:
    """Whether the amdgpu driver is loaded (``/sys/module/amdgpu``, which a built-in driver has too,
    or its line in ``/proc/modules``; None where neither can be read), and why not known."""
    if os.path.isdir(os.path.join(root, "sys", "module", "amdgpu")):
        return True, ""
    modules, problem = _read(root, "proc/modules")
    if modules is not None:
        return any(line.split(" ", 1)[0] == "amdgpu" for line in modules.splitlines()), ""
    if os.path.isdir(os.path.join(root, "sys", "module")):
        return False, ""
    return None, problem or "no /sys/module"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError, OSError):
        return f"uid {os.geteuid()}"


def _owner_group(path: str) -> str:
    """``group 'render', crw-rw----`` of a device file; what cannot be read is left out."""
    try:
        info = os.stat(path)
    except OSError:
        return ""
    try:
        import grp

        group = grp.getgrgid(info.st_gid).gr_name
    except (ImportError, KeyError, OSError):
        group = str(info.st_gid)
    return f"group '{group}', {stat.filemode(info.st_mode)}"


def _rocminfo_said(config: AgentConfig) -> tuple[amd.RocmInfo | None, str]:
    """``rocminfo`` parsed where it is installed and answered, and what it said when it did not."""
    tool = shutil.which(config.tools.get("rocminfo", "rocminfo"))
    if tool is None:
        return None, ""
    result = _run([tool], ROCMINFO_TIMEOUT_S)
    text = result.stdout + result.stderr
    if not text.strip():
        return None, f"rocminfo: {result.problem or f'exit status {result.returncode}, no output'}"
    return amd.parse_rocminfo(text), ""


def _amd_driver_check(config: AgentConfig, cards: list[str]) -> Check:
    name = "amd driver"
    loaded, problem = _amdgpu_loaded(config.root)
    on_bus = f"{len(cards)} AMD GPU{'s' if len(cards) != 1 else ''} on the PCI bus"
    if cards:
        on_bus += f" ({', '.join(cards[:4])}{', …' if len(cards) > 4 else ''})"
    if loaded is None:
        return Check(name, WARN, f"{on_bus}; whether the amdgpu driver is loaded is unknown ({problem})")
    if not loaded:
        return Check(
            name,
            FAIL,
            f"{on_bus}, but the amdgpu driver is not loaded",
            "load it (modprobe amdgpu); dmesg | grep -i amdgpu says why it did not load (after a kernel update "
            "amdgpu-dkms must be rebuilt for the new kernel)",
        )
    version, _ = _read(config.root, "sys/module/amdgpu/version")
    driver = f"amdgpu {_one_line(version, 40)}" if version and version.strip() else "amdgpu"
    if not os.path.isdir(os.path.join(config.root, "sys", "class", "kfd", "kfd")):
        return Check(
            name,
            FAIL,
            f"{on_bus}; {driver} is loaded but its compute interface (KFD) is not: /sys/class/kfd/kfd is absent",
            "engines cannot use the cards for compute: dmesg | grep -i kfd says why (a card the driver does not "
            "support for compute, or a kernel built without HSA_AMD)",
        )
    detail = f"{on_bus}; {driver} loaded with its compute interface (KFD)"
    info, said = _rocminfo_said(config)
    if info is None and said:
        return Check(name, WARN, f"{detail}; {said}", "run rocminfo by hand to see why")
    if info is None:  # rocminfo is not installed: what the kernel shows is all there is to say
        return Check(name, PASS, detail)
    if info.kfd_loaded is False:
        return Check(
            name,
            FAIL,
            f"{detail}, but rocminfo says it cannot use it (ROCk module is not loaded, or /dev/kfd cannot be opened)",
            "see the /dev/kfd check below and dmesg | grep -i kfd",
        )
    agents = len(info.gpus)
    names = _gpu_summary_names([g.marketing_name or g.name or "unnamed GPU" for g in info.gpus])
    if not agents:
        return Check(
            name,
            WARN,
            f"{detail}; rocminfo lists no GPU agent",
            "the cards are not usable for ROCm compute: dmesg | grep -i amdgpu shows why",
        )
    return Check(name, PASS, f"{detail}; rocminfo: {agents} GPU agent{'s' if agents != 1 else ''}: {names}")


def _gpu_summary_names(names: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for each in names:
        counts[each] = counts.get(each, 0) + 1
    return ", ".join(f"{each} ×{count}" if count > 1 else each for each, count in counts.items())


_GROUP_FIX = (
    "add the agent's user to the group that owns it (usermod -aG render,video {user}), then restart the agent: "
    "a running process keeps the groups it started with"
)


def _kfd_check(config: AgentConfig, access: Access) -> Check:
    name = "amd /dev/kfd"
    path = os.path.join(config.root, "dev", "kfd")
    if not os.path.exists(path):
        return Check(
            name,
            FAIL,
            "/dev/kfd does not exist: ROCm and vLLM cannot reach the cards",
            "it appears when amdgpu loads with its compute interface: see the amd driver check; in a container, "
            "pass the device in (--device /dev/kfd)",
        )
    user = _user()
    if not access(path, os.R_OK | os.W_OK):
        owner = _owner_group(path)
        return Check(
            name,
            FAIL,
            f"/dev/kfd is not readable and writable by {user}" + (f" ({owner})" if owner else ""),
            _GROUP_FIX.format(user=user),
        )
    return Check(name, PASS, f"/dev/kfd readable and writable by {user}")


def _dri_check(config: AgentConfig, access: Access) -> Check:
    name = "amd /dev/dri"
    directory = os.path.join(config.root, "dev", "dri")
    try:
        entries = sorted(os.listdir(directory))
    except OSError as exc:
        return Check(
            name,
            FAIL,
            f"cannot list /dev/dri: {exc.strerror or exc}: engines cannot reach the cards' render nodes",
            "it appears when amdgpu loads: see the amd driver check; in a container, pass it in (--device /dev/dri)",
        )
    render = sorted((e for e in entries if re.fullmatch(r"renderD\d{1,4}", e)), key=lambda e: int(e[7:]))
    if not render:
        return Check(
            name,
            FAIL,
            "no render node in /dev/dri (renderD128, …): engines cannot reach the cards",
            "the driver made no render node for them: dmesg | grep -i amdgpu says why",
        )
    user = _user()
    shut = [e for e in render if not access(os.path.join(directory, e), os.R_OK | os.W_OK)]
    span = render[0] if len(render) == 1 else f"{render[0]} … {render[-1]}"
    if shut:
        owner = _owner_group(os.path.join(directory, shut[0]))
        listed = ", ".join(shut[:8]) + (", …" if len(shut) > 8 else "")
        return Check(
            name,
            FAIL,
            f"{len(shut)} of {len(render)} render nodes are not readable and writable by {user}: {listed}"
            + (f" ({owner})" if owner else ""),
            _GROUP_FIX.format(user=user),
        )
    count = f"{len(render)} render node{'s' if len(render) != 1 else ''}"
    return Check(name, PASS, f"{count} ({span}) readable and writable by {user}")


def _rocm_check(config: AgentConfig) -> Check:
    name = "rocm"
    text, _ = _read(config.root, "opt/rocm/.info/version")
    without = (
        "llama.cpp runs its Vulkan build here (it needs libvulkan1 and the Mesa Vulkan driver); for its ROCm "
        "build, install ROCm (amdgpu-install --usecase=rocm)"
    )
    if text is None:
        return Check(name, WARN, "no ROCm release installed (/opt/rocm/.info/version absent)", without)
    version = text.strip().split()[0][:32] if text.strip() else ""
    match = _ROCM_VERSION_RE.match(version)
    if match is None:
        return Check(
            name, WARN, f"/opt/rocm/.info/version does not hold a ROCm version: {_one_line(text, 60)!r}", without
        )
    return Check(
        name, PASS, f"ROCm {version} (/opt/rocm): llama.cpp's ROCm builds up to ROCm {match.group(1)} can run here"
    )


def amd_checks(config: AgentConfig, *, access: Access = os.access) -> list[Check]:
    """The checks "amd driver", "amd /dev/kfd", "amd /dev/dri" and "rocm" on a node with an AMD GPU
    on its PCI bus (or the amdgpu driver loaded, or /dev/kfd present); none on a node without one.
    ``access`` is os.access (tests give another, since root may open anything)."""
    cards = _amd_pci(config.root)
    loaded, _ = _amdgpu_loaded(config.root)
    if not cards and not loaded and not os.path.exists(os.path.join(config.root, "dev", "kfd")):
        return []
    return [
        _amd_driver_check(config, cards),
        _kfd_check(config, access),
        _dri_check(config, access),
        _rocm_check(config),
    ]


# --------------------------------------------------------------------------- CPU

_ARM_FEATURES = (("asimd", "NEON"), ("asimddp", "dotprod"), ("i8mm", "i8mm"), ("sve", "SVE"), ("sve2", "SVE2"))
_X86_MACHINES = frozenset({"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"})


def cpu_checks(config: AgentConfig) -> list[Check]:
    """The check "avx2": whether llama.cpp's CPU build gets the vector instructions it is built for."""
    text, problem = _read(config.root, "proc/cpuinfo")
    if text is None:
        return [Check("avx2", WARN, f"{problem}: AVX2 support is unknown")]
    cpu = procfs.parse_cpuinfo(text)
    model = f" ({cpu.model})" if cpu.model else ""
    is_x86 = cpu.is_x86
    machine = cpu.architecture
    if is_x86 is None and config.root == "/":
        machine = platform.machine() or None
        is_x86 = machine.lower() in _X86_MACHINES if machine else None
    if is_x86 is None:
        reason = "; ".join(cpu.warnings) or "no vendor or architecture in it"
        return [Check("avx2", WARN, f"cannot tell the CPU type from /proc/cpuinfo ({reason})")]
    if not is_x86:
        features = [label for flag, label in _ARM_FEATURES if flag in cpu.flags]
        arch = "arm64" if machine in ("aarch64", "arm64") else machine or "not x86"
        shown = ", ".join(features) if features else "no vector features listed"
        return [Check("avx2", PASS, f"{arch}: {shown}{model}")]
    if cpu.has_avx2 is None:
        return [Check("avx2", WARN, f"no CPU flags listed in /proc/cpuinfo{model}: AVX2 support is unknown")]
    if not cpu.has_avx2:
        return [
            Check(
                "avx2",
                WARN,
                f"this CPU has no AVX2{model}: llama.cpp's CPU build runs about 5× slower "
                "(a VM CPU type such as kvm64 hides it; use host-passthrough)",
                "on a VM give the guest the host's CPU model (libvirt <cpu mode='host-passthrough'/>, "
                "Proxmox cpu: host); on old hardware serve CPU models elsewhere",
            )
        ]
    present = ["AVX2", "FMA"] if "fma" in cpu.flags else ["AVX2"]
    if cpu.has_avx512:
        present.append("AVX-512")
    found = ", ".join(present[:-1]) + " and " + present[-1] if len(present) > 1 else present[0]
    missing_fma = "" if "fma" in cpu.flags else " (no FMA)"
    return [Check("avx2", PASS, f"{found} present{missing_fma}{model}")]


# --------------------------------------------------------------------------- model directories


def _size(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"  # unreachable; keeps type checkers content


def _model_dir_check(directory: str, mounts: list[storage.Mount], statvfs: Callable[[str], Any]) -> Check:
    name = f"model dir {directory}"
    if not os.path.exists(directory):
        return Check(
            name,
            FAIL,
            "does not exist",
            f"create it (mkdir -p {directory}), mount the filer, or remove it from model_dirs",
        )
    if not os.path.isdir(directory):
        return Check(name, FAIL, "is not a directory", "point model_dirs at a directory")
    try:
        if not os.access(directory, os.R_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
        os.listdir(directory)
    except OSError as exc:
        return Check(
            name,
            FAIL,
            f"not readable by uid {os.getuid()}: {exc.strerror or exc}",
            "let the agent's user read it (chmod/chown, or the filer's export options)",
        )
    pools = storage.storage_pools([directory], mounts, statvfs=statvfs)
    pool = pools[0] if pools else None
    where = "file system type unknown"
    if pool is not None and pool.fstype:
        where = f"{pool.fstype} on {pool.mount_point}" + (", shared" if pool.shared else "")
    writable = "" if os.access(directory, os.W_OK) else ", read-only for this user"
    if pool is None or pool.free_bytes is None or not pool.total_bytes:
        return Check(name, WARN, f"{where}{writable}; free space unknown (statvfs failed)")
    fraction = pool.free_bytes / pool.total_bytes
    space = f"{_size(pool.free_bytes)} free of {_size(pool.total_bytes)} ({fraction:.0%})"
    if fraction < FREE_WARN_FRACTION:
        return Check(
            name,
            WARN,
            f"{where}{writable}; nearly full: {space}",
            "free space or move model_dirs to a larger file system: downloads fail when it fills",
        )
    return Check(name, PASS, f"{where}{writable}; {space}")


def model_dir_checks(
    config: AgentConfig, *, timeout: float = 5.0, statvfs: Callable[[str], Any] | None = None
) -> list[Check]:
    """One check per directory in model_dirs (each with a time limit: a filer may hang)."""
    if not config.model_dirs:
        return [
            Check(
                "model dirs",
                WARN,
                "no model_dirs in agent.yaml: only absolute paths and downloads can be served",
                "list the directories that hold weights under model_dirs: in agent.yaml",
            )
        ]
    text, _ = _read(config.root, "proc/self/mountinfo")
    mounts = storage.parse_mountinfo(text or "")
    stat = statvfs or os.statvfs
    checks = []
    for directory in config.model_dirs:
        name = f"model dir {directory}"

        def probe(directory: str = directory) -> Check:
            return _model_dir_check(directory, mounts, stat)

        try:
            checks.append(_in_thread(probe, timeout, f"looking at {directory}"))
        except TimeoutError as exc:
            checks.append(
                Check(name, FAIL, str(exc), "a hung network file system: check the mount (umount -l, remount)")
            )
        except Exception as exc:
            checks.append(Check(name, FAIL, f"the check itself failed: {type(exc).__name__}: {exc}"))
    return checks


# --------------------------------------------------------------------------- control plane


@dataclass
class _Answer:
    status: int
    reason: str
    date: str | None
    local_time: float  # this node's clock halfway through the request


def _get(sock: socket.socket, host: str, port: int, default_port: int, path: str, timeout: float) -> _Answer:
    """GET ``path`` over an open (and, for https, already verified) connection."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    connection.sock = sock
    shown_host = f"[{host}]" if ":" in host else host
    if port != default_port:
        shown_host += f":{port}"
    try:
        started = time.time()
        connection.request(
            "GET", path, headers={"Host": shown_host, "User-Agent": "llmgw-doctor", "Connection": "close"}
        )
        response = connection.getresponse()
        answered = time.time()
        response.read(65536)
        return _Answer(response.status, response.reason, response.getheader("Date"), (started + answered) / 2)
    finally:
        connection.close()


def _connect(addresses: list[tuple[Any, ...]], timeout: float) -> tuple[socket.socket | None, list[str]]:
    errors: list[str] = []
    for family, kind, proto, _, sockaddr in addresses:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            reason = "no answer (timed out)" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
            errors.append(reason if len(addresses) == 1 else f"{sockaddr[0]}: {reason}")
            continue
        return sock, errors
    return None, errors


def _clock_check(answer: _Answer | None, why_not: str, now: float | None, note: str = "") -> Check:
    if answer is None:
        return Check("clock", WARN, f"not compared: {why_not}")
    if not answer.date:
        return Check("clock", WARN, "not compared: the control plane's answer has no Date header")
    try:
        server_dt = parsedate_to_datetime(answer.date)
    except (TypeError, ValueError, IndexError):
        return Check("clock", WARN, f"not compared: unreadable Date header {answer.date!r}")
    if server_dt.tzinfo is None:
        server_dt = server_dt.replace(tzinfo=UTC)
    local = now if now is not None else answer.local_time
    # The header has whole seconds: the server's clock was somewhere in the second it names.
    skew = local - (server_dt.timestamp() + 0.5)
    direction = "ahead of" if skew > 0 else "behind"
    said = f"this node's clock is {abs(skew):.0f} s {direction} the control plane{note}"
    fix = "enable time sync: timedatectl set-ntp true (chrony or systemd-timesyncd)"
    if abs(skew) > CLOCK_FAIL_S:
        return Check("clock", FAIL, f"{said}: TLS and token expiry checks break", fix)
    if abs(skew) > CLOCK_WARN_S:
        return Check("clock", WARN, said, fix)
    return Check("clock", PASS, f"within {CLOCK_WARN_S:g} s of the control plane (off by {abs(skew):.0f} s){note}")


def _certificate_check(cert: dict[str, Any], now: float) -> Check:
    not_after = cert.get("notAfter")
    if not isinstance(not_after, str):
        return Check("certificate", WARN, "the server's certificate has no expiry date the doctor could read")
    expires = ssl.cert_time_to_seconds(not_after)
    days = (expires - now) / 86400
    when = datetime.fromtimestamp(expires, tz=UTC).strftime("%Y-%m-%d")
    fields = {key: value for rdn in cert.get("issuer", ()) for key, value in rdn}
    issuer_name = fields.get("commonName") or fields.get("organizationName")
    issuer = f", issued by {issuer_name}" if issuer_name else ""
    fix = "renew the control plane's certificate"
    if days < 0:
        return Check("certificate", FAIL, f"expired {-days:.0f} days ago ({when}){issuer}", fix)
    if days < CERT_WARN_DAYS:
        return Check("certificate", WARN, f"expires in {days:.0f} days ({when}){issuer}", fix)
    return Check("certificate", PASS, f"valid until {when} ({days:.0f} days){issuer}")


@dataclass(frozen=True)
class _Server:
    """The control plane's address as ``server:`` in agent.yaml gives it."""

    url: str  # without its trailing slash, as the findings name it
    scheme: str  # "http" or "https"
    host: str
    port: int
    default_port: int
    path: str  # /healthz under the URL's own path

    @property
    def where(self) -> str:
        """``host:port`` as a finding names it, an IPv6 host in brackets."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _parse_server(server: str) -> _Server | Check:
    """The server URL, or the failed "control plane" check that says why it cannot be used."""
    parts = urlsplit(server)
    scheme = parts.scheme.lower()
    host = parts.hostname
    try:
        port = parts.port
    except ValueError:
        return Check("control plane", FAIL, f"server URL {server} has an invalid port", "fix server: in agent.yaml")
    if scheme not in ("http", "https") or not host:
        return Check("control plane", FAIL, f"server URL {server} is not an http(s) URL with a host")
    default_port = 443 if scheme == "https" else 80
    return _Server(server, scheme, host, port or default_port, default_port, parts.path.rstrip("/") + "/healthz")


def _plain_http_check(addresses: list[tuple[Any, ...]]) -> Check:
    """The "certificate" check of an http:// URL: fine to loopback, a warning across the network."""
    try:
        loopback = all(ipaddress.ip_address(str(a[4][0]).split("%")[0]).is_loopback for a in addresses)
    except ValueError:
        loopback = False
    if loopback:
        return Check("certificate", PASS, "none: plain http to loopback, nothing crosses the network")
    return Check(
        "certificate",
        WARN,
        "plain http: the node credential crosses the network unencrypted",
        "serve the control plane over https and use an https:// server URL in agent.yaml",
    )


def _verify_failed(server: _Server, exc: ssl.SSLCertVerificationError) -> Check:
    """The failed "control plane" check of a certificate this node does not trust."""
    message = exc.verify_message or exc.reason or str(exc)
    return Check(
        "control plane",
        FAIL,
        f"TLS to {server.where}: certificate verify failed: {message}",
        "give the server a certificate from a CA this node trusts, or add its CA to the system store "
        "(update-ca-certificates; SSL_CERT_FILE for a private CA)",
    )


def _handshake_failed(server: _Server, exc: Exception) -> Check:
    """The failed "control plane" check of a TLS handshake that did not finish (not TLS, timed out)."""
    reason = "no answer (timed out)" if isinstance(exc, TimeoutError) else str(exc)
    return Check(
        "control plane",
        FAIL,
        f"TLS handshake with {server.where} failed: {reason}",
        "check the scheme and port in server: (https:// must reach a TLS listener)",
    )


def _healthz_check(server: _Server, answer: _Answer) -> Check:
    """The "control plane" check once /healthz answered: 200 passes, anything else is a warning."""
    if answer.status == 200:
        return Check("control plane", PASS, f"{server.url}: {server.path} answered 200")
    fix = (
        "check that server: in agent.yaml is the llmgw control plane's URL"
        if answer.status == 404
        else "the control plane (or a proxy in front of it) is not healthy: look at its logs"
    )
    return Check(
        "control plane", WARN, f"{server.url}: {server.path} answered {answer.status} {answer.reason}".rstrip(), fix
    )


def control_plane_checks(config: AgentConfig, *, now: float | None = None, timeout: float = 5.0) -> list[Check]:
    """The checks "control plane" (reach it, TLS, /healthz), "certificate" and "clock"."""
    server = _parse_server(config.server.rstrip("/"))
    if isinstance(server, Check):
        return [server]
    checks: dict[str, Check] = {}
    clock = _reach_control_plane(server, checks, now, timeout)
    found = [checks[key] for key in ("control plane", "certificate") if key in checks]
    return [*found, clock or _clock_check(None, "the control plane did not answer", now)]


def _reach_control_plane(server: _Server, checks: dict[str, Check], now: float | None, timeout: float) -> Check | None:
    """Resolve, connect, shake hands (https) and GET /healthz, in that order, stopping at the first
    step that fails.  Puts the "control plane" check (and "certificate", where there is one) into
    ``checks`` and returns the "clock" check, or None where nothing answered to compare against."""
    try:
        addresses = _in_thread(
            lambda: socket.getaddrinfo(server.host, server.port, type=socket.SOCK_STREAM),
            timeout,
            f"resolving {server.host}",
        )
    except (OSError, TimeoutError) as exc:
        checks["control plane"] = Check(
            "control plane",
            FAIL,
            f"cannot resolve {server.host}: {exc}",
            "check server: in agent.yaml and this node's DNS",
        )
        return None
    if server.scheme == "http":
        checks["certificate"] = _plain_http_check(addresses)

    sock, errors = _connect(addresses, timeout)
    if sock is None:
        checks["control plane"] = Check(
            "control plane",
            FAIL,
            f"cannot connect to {server.where}: {'; '.join(errors) or 'no address'}",
            f"check that the control plane is running and that this node may reach {server.where} (firewall, proxy)",
        )
        return None

    local_now = now if now is not None else time.time()
    if server.scheme == "https":
        context = ssl.create_default_context()
        try:
            tls = context.wrap_socket(sock, server_hostname=server.host)
        except ssl.SSLCertVerificationError as exc:
            sock.close()
            checks["control plane"] = _verify_failed(server, exc)
            return _unverified_clock(addresses, server, timeout, now)
        except (ssl.SSLError, OSError) as exc:
            sock.close()
            checks["control plane"] = _handshake_failed(server, exc)
            return None
        checks["certificate"] = _certificate_check(tls.getpeercert() or {}, local_now)
        sock = tls

    try:
        answer = _get(sock, server.host, server.port, server.default_port, server.path, timeout)
    except (OSError, http.client.HTTPException) as exc:
        reason = "no answer (timed out)" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        checks["control plane"] = Check(
            "control plane",
            FAIL,
            f"connected to {server.where}, but GET {server.path} got no HTTP answer: {reason}",
            "check the scheme and port in server: (http:// vs https://)",
        )
        return None
    finally:
        sock.close()
    checks["control plane"] = _healthz_check(server, answer)
    return _clock_check(answer, "", now)


def _unverified_clock(addresses: list[tuple[Any, ...]], server: _Server, timeout: float, now: float | None) -> Check:
    """The clock check over a connection whose certificate is not verified: a clock that is far off
    is itself a reason for "certificate is not yet valid" or "has expired"."""
    sock, errors = _connect(addresses, timeout)
    if sock is None:
        return _clock_check(None, f"cannot connect again: {'; '.join(errors)}", now)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        tls = context.wrap_socket(sock, server_hostname=server.host)
        try:
            answer = _get(tls, server.host, server.port, server.default_port, server.path, timeout)
        finally:
            tls.close()
    except (OSError, http.client.HTTPException) as exc:
        sock.close()
        return _clock_check(None, f"no answer over TLS: {exc}", now)
    return _clock_check(answer, "", now, " (read over a connection whose certificate was not verified)")


# --------------------------------------------------------------------------- all of it


def fabric_checks(config: AgentConfig, *, timeout: float = 5.0) -> list[Check]:
    """Each InfiniBand and RoCE port: its state and rate, the master subnet manager an active IB port
    sees (sminfo), and ports whose link trained below the rest. Nothing on a node without adapters."""
    from agent.probes import infiniband
    from agent.probes.sysfs import SysfsReader

    report = infiniband.read_ports(SysfsReader(config.root))
    if not report.ports:
        return []
    sminfo = config.tools.get("sminfo", "sminfo")
    checks = []
    missing = False
    for port in report.ports:
        name = f"port {port.device}/{port.port}"
        rate = f"{port.rate_gbps:g} Gb/s" if port.rate_gbps is not None else "rate unknown"
        state = f"{port.state_name or port.state} / {port.phys_state_name or port.phys_state}"
        if not infiniband.port_is_up(port):
            if port.state == 2 and port.phys_state == 5:
                checks.append(
                    Check(
                        name,
                        FAIL,
                        f"{state}, {rate}: a link, but no subnet manager brought it up",
                        "check the fabric's subnet manager (sminfo, saquery SMIR)",
                    )
                )
            else:
                checks.append(Check(name, WARN, f"{state}: no link", "check the cable and the switch port"))
            continue
        if port.link_layer != "InfiniBand":
            checks.append(Check(name, PASS, f"RoCE, {state}, {rate}, {port.roce_ip or 'no RoCE v2 IPv4 address'}"))
            continue
        if missing:
            checks.append(Check(name, WARN, f"{state}, {rate}; subnet manager not checked", "install infiniband-diags"))
            continue
        result = _run([sminfo, "-C", port.device, "-P", str(port.port)], timeout)
        info = infiniband.parse_sminfo(result.stdout + "\n" + result.stderr)
        if result.returncode is None and result.problem and "cannot run" in result.problem:
            missing = True
            checks.append(Check(name, WARN, f"{state}, {rate}; sminfo is missing", "install infiniband-diags"))
        elif info is None or info.error is not None:
            checks.append(
                Check(name, FAIL, f"{state}, {rate}; no subnet manager answered", "check the fabric's subnet manager")
            )
        else:
            checks.append(Check(name, PASS, f"{state}, {rate}, master subnet manager {_master(info)}"))
    for port, found, expected in infiniband.expected_rate_mismatch(report.ports):
        checks.append(
            Check(
                f"port {port.device}/{port.port} rate",
                WARN,
                f"{found:g} Gb/s where the node's other ports run at {expected:g}",
                "reseat or replace the cable; check the switch port's speed",
            )
        )
    return checks


def _master(info: SmInfo) -> str:
    """The master as sminfo gave it: its GUID (or its LID and why the GUID is unknown) and priority."""
    who = info.guid or f"at LID {info.lid} ({'; '.join(info.warnings) or 'GUID not given'})"
    return who if info.priority is None else f"{who} (priority {info.priority})"


_FABRIC_MANAGER_FIX = (
    "check nvidia-fabricmanager (systemctl status nvidia-fabricmanager; its log) and, on a multi-node "
    "system, the NVLink switch trays and that the node's partition is active"
)
_IMEX_FIX = (
    "systemctl status nvidia-imex and /var/log/nvidia-imex.log; restart it once every node's fabric is Completed"
)
_IMEX_CONFIG_FIX = (
    "list the IP address of every node of the NVLink domain, one a line, in "
    "/etc/nvidia-imex/nodes_config.cfg (the same file on all of them) and restart nvidia-imex"
)
_IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"


def nvlink_checks(config: AgentConfig, *, timeout: float = 5.0) -> list[Check]:
    """Each GPU's NVLink fabric registration (``nvidia-smi -q`` Fabric block), the node's NVLink
    domain, and on a multi-node NVLink domain (non-zero ClusterUUID) the IMEX daemon, the IMEX
    domain and the IMEX channels.  Nothing on a node without NVSwitch fabric (no Fabric block, or
    State Not Supported / N/A), nor where nvidia-smi fails (the "gpu driver" check says why)."""
    tool = config.tools.get("nvidia-smi", "nvidia-smi")
    result = _run([tool, "-q"], max(timeout, NVIDIA_SMI_TIMEOUT_S))
    if result.returncode != 0 or not result.stdout.strip():
        return []
    report = nvidia.parse_nvidia_smi_text(result.stdout)
    fabrics = [
        (gpu.index, gpu.fabric)
        for gpu in report.gpus
        if gpu.fabric is not None and (gpu.fabric.state or "").lower() not in ("", "not supported", "n/a")
    ]
    if not fabrics:
        return []
    checks = [_fabric_check(index, fabric) for index, fabric in fabrics]
    checks += _nvlink_domain_checks(fabrics)
    if all(nvlink.zero_cluster_uuid(fabric.cluster_uuid) for _, fabric in fabrics):
        return checks  # a single machine's NVSwitch: no IMEX to ask about
    imex = config.tools.get("nvidia-imex-ctl", "nvidia-imex-ctl")
    checks += _imex_checks(imex, timeout)
    checks.append(_imex_channels_check(config.root))
    return checks


def _domain_of(fabric: nvidia.FabricInfo) -> str:
    """``clusteruuid.cliqueid``, or "none" for a GPU in no multi-node NVLink domain."""
    if nvlink.zero_cluster_uuid(fabric.cluster_uuid):
        return "none"
    clique = "?" if fabric.clique_id is None else str(fabric.clique_id)
    return f"{(fabric.cluster_uuid or '').lower()}.{clique}"


def _fabric_check(index: int, fabric: nvidia.FabricInfo) -> Check:
    """One GPU's "NVLink fabric" check: its registration state and status, health and bandwidth."""
    name = f"GPU {index} NVLink fabric"
    state, status = fabric.state or "", fabric.status
    if state.lower() != "completed":
        said = (
            "fabric manager or NVLink switch not done, or the partition not active"
            if state.lower() == "in progress"
            else "not registered with the fabric manager"
        )
        return Check(
            name,
            FAIL,
            f"fabric State {state}: {said}; no NVLink P2P or multi-node NVLink yet",
            _FABRIC_MANAGER_FIX,
        )
    fails: list[str] = []
    warns: list[str] = []
    fixes: list[str] = []
    if status is None:
        warns.append("State Completed but no Status reported")
    elif status.lower() != "success":
        fails.append(f"State Completed with Status {status}")
        fixes.append(_FABRIC_MANAGER_FIX)
    health = fabric.health_summary
    clique = f"CliqueId {fabric.clique_id}" if fabric.clique_id is not None else "no CliqueId"
    if health is not None and health.lower() == "unhealthy":
        fails.append(f"health Summary Unhealthy ({clique} reported, but the fabric is not fit to use)")
        fixes.append("check the NVLink switch trays and nvidia-fabricmanager; drain the node from its NVLink domain")
    elif health is not None and health.lower() == "limited capacity":
        warns.append("health Summary Limited Capacity")
    bandwidth = (fabric.bandwidth or "").strip()
    # Early GB200 drivers print "Not Supported" in every Health row: unknown, not degraded.
    if bandwidth and bandwidth.lower() not in ("not supported", "n/a") and not bandwidth.lower().startswith("full"):
        warns.append(f"Bandwidth {bandwidth} (not Full)")
        fixes.append("look for NVLink errors (nvidia-smi nvlink -e) and degraded links to the NVLink switches")
    if fabric.health_faults:
        warns.append("health reports " + ", ".join(fabric.health_faults))
        fixes.append("check the NVLink switch trays and nvidia-fabricmanager's log for route and configuration faults")
    single = nvlink.zero_cluster_uuid(fabric.cluster_uuid)
    if fails or warns:
        named = "" if single else f"; NVLink domain {_domain_of(fabric)}"
        found = "; ".join([*fails, *warns]) + named
    elif single:
        found = "Completed/Success: a single machine's NVSwitch, no multi-node domain"
    else:
        found = f"Completed/Success, NVLink domain {_domain_of(fabric)}"
    status_word = FAIL if fails else WARN if warns else PASS
    fix = "; ".join(dict.fromkeys(fixes)) or ("" if status_word == PASS else _FABRIC_MANAGER_FIX)
    return Check(name, status_word, found, fix)


def _nvlink_domain_checks(fabrics: Sequence[tuple[int, nvidia.FabricInfo]]) -> list[Check]:
    """The "NVLink domain" check: every GPU of the node in one ClusterUUID.CliqueId pair.  Nothing
    on a single machine's NVSwitch whose GPUs all agree."""
    pairs: dict[str, list[int]] = {}
    for index, fabric in fabrics:
        pairs.setdefault(_domain_of(fabric), []).append(index)
    if len(pairs) > 1:
        listing = "; ".join(
            f"{'no domain' if key == 'none' else key}: GPU {','.join(map(str, indices))}"
            for key, indices in pairs.items()
        )
        return [
            Check(
                "NVLink domain",
                FAIL,
                f"the GPUs report different ClusterUUID.CliqueId pairs ({listing}): a node must be in one domain",
                _FABRIC_MANAGER_FIX,
            )
        ]
    (key,) = pairs
    if key == "none":
        return []
    return [Check("NVLink domain", PASS, f"{len(fabrics)} GPUs in NVLink domain {key}")]


def _imex_checks(imex: str, timeout: float) -> list[Check]:
    """The "IMEX daemon" (``nvidia-imex-ctl -q``) and "IMEX domain" (``-N``) checks."""
    state_result = _run([imex, "-q"], timeout)
    if state_result.returncode is None and (state_result.problem or "").startswith("cannot run"):
        return [
            Check(
                "IMEX daemon",
                FAIL,
                f"{imex} not found: without IMEX the domain's GPUs cannot share memory across nodes",
                "install and start nvidia-imex (systemctl enable --now nvidia-imex), unless DRA ComputeDomains run "
                "their own IMEX daemons on this node",
            )
        ]
    daemon = _imex_daemon_check(imex, state_result)
    return [daemon, _imex_domain_check(imex, _run([imex, "-N"], timeout))]


def _imex_daemon_check(imex: str, result: _Result) -> Check:
    """The "IMEX daemon" check from what ``nvidia-imex-ctl -q`` printed: READY passes."""
    if result.returncode is None:
        return Check("IMEX daemon", FAIL, f"{imex} -q: {result.problem}", _IMEX_FIX)
    output = result.stdout + "\n" + result.stderr
    daemon = nvlink.parse_imex_state(output)
    if daemon == "READY":
        return Check("IMEX daemon", PASS, "READY")
    if daemon is not None:
        return Check("IMEX daemon", FAIL, f"state {daemon}, not READY", _IMEX_FIX)
    said = _one_line(output, 200) or f"nothing (exit status {result.returncode})"
    return Check("IMEX daemon", FAIL, f"{imex} -q gave no state: {said}", _IMEX_FIX)


def _imex_domain_check(imex: str, result: _Result) -> Check:
    """The "IMEX domain" check from what ``nvidia-imex-ctl -N`` printed: the domain's state, with
    the nodes that are not READY and the links that are not connected."""
    if result.returncode is None:
        return Check("IMEX domain", FAIL, f"{imex} -N: {result.problem}", _IMEX_FIX)
    domain = nvlink.parse_imex_nodes(result.stdout + "\n" + result.stderr)
    if not domain.configured:
        return Check(
            "IMEX domain", FAIL, "nvidia-imex-ctl -N: Failed to read node configuration file", _IMEX_CONFIG_FIX
        )
    not_ready = [f"node #{n.index} {n.address} {n.state}" for n in domain.nodes if n.state.upper() != "READY"]
    marks = [
        f"{source}→{target} {mark}"
        for source, row in sorted(domain.connectivity.items())
        for target, mark in sorted(row.items())
        if mark != "C"
    ]
    count = f"{len(domain.nodes)} node{'s' if len(domain.nodes) != 1 else ''}"
    problems = "; ".join(
        part
        for part in (
            f"not READY: {', '.join(not_ready)}" if not_ready else "",
            f"links not connected: {', '.join(marks[:20])}" if marks else "",
        )
        if part
    )
    tail = f"; {problems}" if problems else ""
    if domain.domain_state == "UP":
        return Check("IMEX domain", WARN if problems else PASS, f"UP, {count}{tail}", _IMEX_FIX)
    if domain.domain_state == "DEGRADED":
        return Check("IMEX domain", WARN, f"DEGRADED, {count}{tail}", _IMEX_FIX)
    if domain.domain_state == "DOWN":
        return Check("IMEX domain", FAIL, f"DOWN, {count}{tail}", _IMEX_FIX)
    if domain.domain_state is not None:
        return Check("IMEX domain", WARN, f"domain state {domain.domain_state}, {count}{tail}", _IMEX_FIX)
    said = _one_line(result.stdout + " " + result.stderr, 200) or "nothing"
    return Check("IMEX domain", WARN, f"{imex} -N printed no Domain State: {said}", _IMEX_FIX)


def _imex_channels_check(root: str) -> Check:
    """The "IMEX channels" check: at least one channel device, listed (the first eight of many)."""
    channels = nvlink.imex_channels(root)
    if not channels:
        return Check(
            "IMEX channels",
            FAIL,
            f"no IMEX channel under {_IMEX_CHANNELS}",
            "create channel0 (nvidia-modprobe -i 0:1 or the driver's NVreg_CreateImexChannel0=1)",
        )
    shown = ", ".join(f"channel{n}" for n in channels[:8])
    if len(channels) > 8:
        shown = f"{len(channels)} channels: {shown}, … channel{channels[-1]}"
    return Check("IMEX channels", PASS, f"{shown} under {_IMEX_CHANNELS}")


def run_checks(
    config: AgentConfig,
    *,
    installed: Mapping[str, Mapping[str, Any]] | None = None,
    now: float | None = None,
    timeout: float = 5.0,
) -> list[Check]:
    """Every check, in a fixed order: engines, GPU (NVIDIA, AMD), CPU, model directories, control plane.

    ``installed`` is the installed-engines manifest (engine name -> {version, build, path, dir});
    when None it is read from ``<state_dir>/engines/installed.json``.  ``now`` is this node's
    clock (Unix seconds) for the certificate and clock checks; None means ``time.time()``.
    ``timeout`` bounds each network step and each ldd run.
    """
    checks: list[Check] = []
    checks += _guarded("engines", lambda: engine_checks(config, installed, timeout=timeout))
    nvidia_found = _guarded("gpu driver", lambda: gpu_checks(config))
    amd_found = _guarded("amd driver", lambda: amd_checks(config))
    if amd_found and nvidia_found == [Check("gpu driver", PASS, _NO_NVIDIA)]:
        nvidia_found = []  # an AMD node: "no NVIDIA GPU (CPU node)" would mislead
    checks += nvidia_found + amd_found
    checks += _guarded("avx2", lambda: cpu_checks(config))
    checks += _guarded("model dirs", lambda: model_dir_checks(config, timeout=timeout))
    checks += _guarded("fabric ports", lambda: fabric_checks(config, timeout=timeout))
    checks += _guarded("NVLink fabric", lambda: nvlink_checks(config, timeout=timeout))
    checks += _guarded("control plane", lambda: control_plane_checks(config, now=now, timeout=timeout))
    return checks


def format_lines(checks: Sequence[Check]) -> str:
    """One line per check, ``status  name  detail — fix``, names padded to a fixed column so the
    output lines up and greps the same on every node.  No trailing newline."""
    lines = []
    for check in checks:
        line = f"{check.status:<4}  {check.name:<{NAME_WIDTH}} {_one_line(check.detail, 1000)}"
        if check.fix and check.status != PASS:
            line += f" — {_one_line(check.fix, 1000)}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def exit_status(checks: Sequence[Check]) -> int:
    """0 when no check failed (warnings alone included), else 1."""
    return 1 if any(check.status == FAIL for check in checks) else 0
