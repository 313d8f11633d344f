"""The engines this node installs, converged on from the control plane's list and kept working.

The control plane sends, with the node's desired state, the engines and versions the node
should have, each with its release's assets (name, size, sha256, where to fetch it). For each:

1. an engine named in agent.yaml is the operator's word: it is used as named, never replaced;
2. an engine already installed at that version, and still passing its checks, is kept;
3. otherwise the builds this node may run (`builds.choose_builds`) are tried best first: the
   archive (and the CUDA runtime archive where the host has none) is downloaded to disk and
   checked against its sha256 (refused first when it would leave less than `disk_reserve`
   free), unpacked into an empty staging directory (`archive.extract`, bounded by what an engine
   release may unpack to, `archive_limits`, and by the disk's free space less the reserve),
   checked (`verify.check`: ldd, `--version`, and on a GPU build `--list-devices`; a library
   the node's package sources have is installed with apt-get once, when the agent runs as
   root), and only then renamed to `<state_dir>/engines/<engine>/<version>-<build>/` and
   written to `installed.json`. A build that fails gives way to the next; when none works the
   reasons are reported and the engine that worked before stays in use.

What an install the agent did not finish left behind (killed mid-download or mid-unpack: its
`.staging-*` scratch, uv's staging, an install moved aside) is removed, or put back, when the agent
starts (`remove_stale_staging`); the installs themselves are never touched.

Installed engines are checked again every `recheck_interval` seconds (ten minutes): one that
fails (an upgrade removed a library) is withdrawn at once, so placement stops offering it, and
installed again after `retry_after` seconds.

A CPU node compiles llama.cpp from the control plane's source distribution (`source.build`)
only where no archive can be had: the release could not be read and the control plane holds none,
or every download failed. An archive that arrived and was refused (its digest is not the one
published, or it would unpack outside its directory) is a different matter: the node says
"refused: ..." and compiles nothing in its place, unless the control plane allows it
(`LLMGW_ENGINE_SOURCE_AFTER_REFUSAL`, sent as the source's `after_refusal`). Then the refusal stays
in the engine's status beside the compiled build, which is reported as what it is (its own
`--version`, its `source-...` build), and the same refused offer is not fetched again for an hour
unless the control plane offers another (a new digest or address).

`report()` is what the agent tells the control plane: `probed` (so an empty list reads "has
none"), each usable engine with its version and build, and per engine what is happening in the
node's own words ("installing: downloading llama-b10991-bin-ubuntu-x64.tar.gz (16 MB, 40 %)",
"failed: ...", "refused: ..."), followed by the control plane's fix where it sent one (the command
that gives the node an archive). Waiting, failed and refused states are also written to
`<state_dir>/engines/status.json`, where `llmgw doctor` reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.bounded import size_text
from agent.install import pyenv, verify
from agent.install.archive import ENGINE_RELEASE, RESERVE_BYTES, UV_RELEASE, Limits, NoRoom, UnsafeArchive, extract
from agent.install.builds import Asset, Build, NodeFacts, choose_builds, parse_assets
from agent.install.fetch import DigestMismatch, FetchError, download, fetch_text, human_bytes, progress_text
from agent.install.source import SourceBuild, SourceError, index_url, parse_source
from agent.install.source import build as build_from_source

__all__ = ["DesiredEngine", "InstallError", "Installer", "Refused", "has_cuda_runtime", "parse_desired_engines"]

log = logging.getLogger("llmgw.agent.install")

MANIFEST = "installed.json"
#: The states `llmgw doctor` reads: engine -> {"status", "fix"} for waiting, failed and refused ones.
STATUS_FILE = "status.json"
#: Where a compiled llama.cpp keeps its unpacked source and build tree, by the source's digest.
SOURCE_BUILDS = ".source-builds"
#: The longest engine status the protocol carries (agent.protocol.ENGINE_FIELDS).
STATUS_MAX = 2000
RECHECK_INTERVAL_S = 600.0
#: An offer refused (digest, unsafe path) is fetched again after this long, or at once when the
#: control plane offers another file (a new digest or address).
RETRY_REFUSED_S = 3600.0
RETRY_AFTER_S = 60.0
BINARIES = {"llama.cpp": "llama-server"}
#: Engines that are Python environments built by uv (agent/install/pyenv.py).
PYTHON_ENGINES = frozenset(pyenv.PACKAGES)
APT_TIMEOUT_S = 900.0

#: Where a host's CUDA user-space libraries live when it has them (besides ldconfig's cache).
CUDA_LIBRARY_DIRS = ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64")


class InstallError(Exception):
    """No build of an engine could be installed; str() lists each build's reason."""


class Unavailable(InstallError):
    """The node cannot have this engine (no GPU, a driver too old): said, but not a fault."""


class Refused(InstallError):
    """An archive arrived and was refused (its digest, an unsafe path): str() says which and why."""


@dataclass(frozen=True)
class DesiredEngine:
    engine: str
    version: str
    assets: tuple[Asset, ...] = ()
    note: str | None = None  # the control plane's word when it has no asset listing to give
    unreachable: bool = False  # the control plane could not read the release (not merely not yet)
    source: SourceBuild | None = None  # a source distribution to compile a CPU build from, last
    python: pyenv.PythonEngine | None = None  # for vLLM and SGLang: how to build the environment
    listed: bool = False  # the control plane has read (or tried to read) the release
    fix: str | None = None  # the control plane's word on what gives this node an archive


def parse_desired_engines(items: Any) -> list[DesiredEngine]:
    """The `engines` list of a desired message; an item that cannot be read is skipped with a warning."""
    wanted = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, Mapping) or not isinstance(item.get("engine"), str):
            log.warning("the control plane sent an engine entry this agent cannot read: %r", item)
            continue
        engine, version = item["engine"], str(item.get("version") or "")
        if engine not in BINARIES and engine not in PYTHON_ENGINES:
            log.warning("the control plane asked for engine %s, which this agent does not install", engine)
            continue
        wanted.append(
            DesiredEngine(
                engine=engine,
                version=version,
                assets=tuple(parse_assets({"assets": item.get("assets") or []})),
                note=str(item["note"]) if item.get("note") else None,
                unreachable=item.get("unreachable") is True,
                source=parse_source(item.get("source")),
                python=pyenv.parse_python_engine(item) if engine in PYTHON_ENGINES else None,
                listed="assets" in item,
                fix=str(item["fix"]) if item.get("fix") else None,
            )
        )
    return wanted


def has_cuda_runtime(root: str = "/") -> bool:
    """True when the host has libcudart and libcublas (so the cudart archive is not needed)."""
    found: set[str] = set()
    try:
        done = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10, check=False)  # noqa: S607
        listing = done.stdout
    except (OSError, subprocess.TimeoutExpired):
        listing = ""
    for lib in ("libcudart.so", "libcublas.so"):
        if lib in listing:
            found.add(lib)
    for directory in CUDA_LIBRARY_DIRS:
        base = Path(root) / directory.lstrip("/")
        for lib in ("libcudart.so", "libcublas.so"):
            if any(base.glob(lib + "*")):
                found.add(lib)
    return found == {"libcudart.so", "libcublas.so"}


@dataclass
class _State:
    status: str | None = None
    failed_at: float | None = None
    fix: str | None = None  # the control plane's, shown after a waiting, failed or refused status
    # Offers refused (name, sha256, urls) -> (when, why): not fetched again until RETRY_REFUSED_S.
    refused: dict[tuple[str, str | None, tuple[str, ...]], tuple[float, str]] = field(default_factory=dict)


@dataclass
class Installer:
    state_dir: Path
    facts: Callable[[], NodeFacts]
    configured: Mapping[str, str] = field(default_factory=dict)
    tools: Mapping[str, str] = field(default_factory=dict)
    on_change: Callable[[], None] | None = None
    recheck_interval: float = RECHECK_INTERVAL_S
    retry_after: float = RETRY_AFTER_S
    # The control plane: a relative asset URL is its own copy, fetched with the node's credential.
    server: str = ""
    credential: Callable[[], str | None] | None = None
    # What a release archive may unpack to, and what the node's disk keeps free whatever it holds.
    archive_limits: Limits = ENGINE_RELEASE
    disk_reserve: int = RESERVE_BYTES

    def __post_init__(self) -> None:
        self.root = Path(self.state_dir) / "engines"
        self.manifest: dict[str, dict[str, Any]] = self._load()
        self.states: dict[str, _State] = {}
        self.desired: list[DesiredEngine] | None = None
        self.lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.converging: asyncio.Task[None] | None = None
        # Set when the agent stops: an install under way (a download, an 18-minute compile) ends at
        # its next progress report instead of holding the agent's exit.
        self.stopping = threading.Event()
        # The manifest was read: an empty one means this node has no installed engine.
        self.probed = True
        # A new agent process: no install is under way, so what one left behind is stale.
        self.remove_stale_staging()

    # ----------------------------------------------------------------- what the node has

    def binaries(self) -> dict[str, str]:
        """Engine -> binary the supervisor starts: installed engines, and agent.yaml's over them."""
        with self.lock:
            found = {name: entry["path"] for name, entry in self.manifest.items() if entry.get("path")}
        found.update(self.configured)
        return found

    def manifest_copy(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            return {name: dict(entry) for name, entry in self.manifest.items()}

    def versions(self) -> dict[str, str]:
        """Engine -> what runs, for the engines installed here (not those agent.yaml names): what
        the binary's own `--version` said when it was checked (llama.cpp's build number and commit,
        which a build compiled from a source distribution does not share with the release it stands
        in for), with the build installed; the release and build where no such line was read."""
        with self.lock:
            return {
                name: _running_label(entry)
                for name, entry in sorted(self.manifest.items())
                if name not in self.configured and entry.get("path")
            }

    def report(self) -> dict[str, Any]:
        """What is installed (each with what it runs: a compiled build is not the release it stands
        in for) and, per engine, its status with the control plane's fix after a problem."""
        with self.lock:
            installed = [
                {
                    "engine": name,
                    "version": _what_runs(entry),
                    "build": entry.get("build"),
                    "path": entry.get("path"),
                    "devices": entry.get("devices") or [],
                }
                for name, entry in sorted(self.manifest.items())
                if name not in self.configured
            ]
            status = {name: _shown(state) for name, state in sorted(self.states.items()) if state.status}
        return {"probed": self.probed, "installed": installed, "status": status}

    def _changed(self) -> None:
        callback, loop = self.on_change, self.loop
        if callback is None:
            return
        if loop is not None and loop.is_running():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(callback)
        else:
            callback()

    def stop(self) -> None:
        """End any install under way (the agent is exiting); what was installed stays."""
        self.stopping.set()

    def _status(self, engine: str, text: str | None) -> None:
        if self.stopping.is_set() and text and text.startswith("installing:"):
            raise InstallError("stopped: the agent is stopping")
        with self.lock:
            state = self.states.setdefault(engine, _State())
            if state.status == text:
                return
            before, state.status = state.status, text
        if text:
            log.info("engine %s: %s", engine, _shown(state))
        if _lasting(before) or _lasting(text):
            self._save_status()
        self._changed()

    def _save_status(self) -> None:
        """Write the waiting, failed and refused states for `llmgw doctor` (best effort: the
        agent's own report does not depend on it)."""
        with self.lock:
            lasting = {
                name: {"status": state.status, "fix": state.fix}
                for name, state in sorted(self.states.items())
                if _lasting(state.status)
            }
        path = self.root / STATUS_FILE
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{STATUS_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(lasting, indent=2, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    # ----------------------------------------------------------------- staging left behind

    def remove_stale_staging(self) -> list[str]:
        """Remove what a killed install left under the engines folder: scratch directories
        (``.staging-*``: a half-done download, a half-unpacked tree), uv's staging
        (``.tools/.uv-*``) and the manifest's temporary copies. An install moved aside for a new
        one (``<engine>/.old-<name>-*``) is removed once ``<name>`` is in place again, and put back
        when the kill came before the new one was renamed in (it is then the current install).
        Installs themselves, the current one and the one kept for rollback, never start with a
        dot and are never touched; nor are the resolved-requirements locks (``.locks``). Returns
        what was removed or put back, as the log says it."""
        done: list[str] = []
        if not self.root.is_dir():
            return done
        for child in sorted(self.root.iterdir()):
            if child.name.startswith(".staging-") or (
                child.name.startswith((f".{MANIFEST}.", f".{STATUS_FILE}.")) and child.name.endswith(".tmp")
            ):
                done.append(_remove(child))
            elif child.name == ".tools" and child.is_dir() and not child.is_symlink():
                done += [_remove(tool) for tool in sorted(child.iterdir()) if tool.name.startswith(".")]
            elif child.is_dir() and not child.is_symlink() and not child.name.startswith("."):
                # Newest first: the install moved aside last is the one that may have to go back.
                aside = sorted(child.glob(".old-*"), key=lambda p: p.lstat().st_ctime_ns, reverse=True)
                done += [_restore_or_remove(old) for old in aside]
        for line in done:
            log.info("engines: %s, left by an install that did not finish", line)
        return done

    # ----------------------------------------------------------------- manifest

    def _load(self) -> dict[str, dict[str, Any]]:
        path = self.root / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s): installing the engines again", path, exc)
            return {}
        if not isinstance(data, dict):
            return {}
        return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("path"), str)}

    def _save(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        with self.lock:
            text = json.dumps(self.manifest, indent=2, sort_keys=True)
        tmp.write_text(text)
        os.replace(tmp, path)

    # ----------------------------------------------------------------- converging

    async def converge(self, desired: Sequence[DesiredEngine]) -> None:
        """Install what is missing, in a thread; one convergence at a time."""
        self.loop = asyncio.get_running_loop()
        self.desired = list(desired)
        previous = self.converging

        async def run() -> None:
            if previous is not None and not previous.done():
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await previous
            await asyncio.to_thread(self.converge_sync, list(desired))

        self.converging = asyncio.create_task(run())
        await asyncio.shield(self.converging)

    def converge_sync(self, desired: Sequence[DesiredEngine]) -> None:
        wanted = {item.engine for item in desired}
        changed = False
        with self.lock:
            for name in [n for n in self.manifest if n not in wanted]:
                log.info("engine %s is no longer wanted on this node", name)
                del self.manifest[name]
                changed = True
            for name in [n for n in self.states if n not in wanted]:
                del self.states[name]
        if changed:
            self._save()
        for item in desired:
            if self.stopping.is_set():
                break
            if item.engine in self.configured:
                self._status(item.engine, None)
                continue
            with self.lock:
                entry = self.manifest.get(item.engine)
                state = self.states.setdefault(item.engine, _State())
                state.fix = item.fix
            if item.python is not None:
                self._converge_python(item, entry, state)
                continue
            compiled = entry is not None and str(entry.get("build", "")).startswith("source-")
            if entry is not None and entry.get("version") == item.version and not (compiled and item.assets):
                continue  # installed; a compiled stand-in gives way once the release's archives can be had
            if state.failed_at is not None and time.monotonic() - state.failed_at < self.retry_after:
                continue
            if compiled and item.assets and entry is not None and entry.get("version") == item.version:
                self._replace_compiled(item, state)
                continue
            if not item.assets and not (item.unreachable and item.source is not None and _compiles(self.facts())):
                self._status(item.engine, "waiting: " + (item.note or f"no release listing for {item.version} yet"))
                continue
            try:
                self.install(item)
            except InstallError as exc:
                state.failed_at = time.monotonic()
                self._status(item.engine, f"{'refused' if isinstance(exc, Refused) else 'failed'}: {exc}")
                log.warning("engine %s %s: %s", item.engine, item.version, exc)
            else:
                state.failed_at = None
        self._changed()

    def _converge_python(self, item: DesiredEngine, entry: dict[str, Any] | None, state: _State) -> None:
        spec = item.python
        assert spec is not None
        if entry is not None and entry.get("version") == item.version and _build_matches(spec.build, entry):
            return
        if state.failed_at is not None and time.monotonic() - state.failed_at < self.retry_after:
            return
        if not item.listed:
            self._status(item.engine, "waiting: " + (item.note or f"no release listing for {item.version} yet"))
            return
        try:
            self._install_python(item, spec)
        except Unavailable as exc:
            state.failed_at = time.monotonic()
            self._status(item.engine, f"unavailable: {exc}")
        except InstallError as exc:
            state.failed_at = time.monotonic()
            self._status(item.engine, f"failed: {exc}")
            log.warning("engine %s %s: %s", item.engine, item.version, exc)
        else:
            state.failed_at = None

    def _replace_compiled(self, item: DesiredEngine, state: _State) -> None:
        """Try the release's own builds over an engine compiled from source; keep it when none works.
        A refused offer is said (and not fetched again for an hour); otherwise nothing is wrong."""
        refused = None
        for build in choose_builds(self.facts(), item.assets)[0]:
            try:
                self._try_build(item, build, state)
            except Refused as exc:
                said = f"refused: {build.key}: {exc}"
                known = state.status or ""  # the same refusal already said stays as it was said
                refused = known if known.startswith(said) else f"{said}; {_compiled_stays(item)}"
                continue
            except (FetchError, UnsafeArchive, verify.VerifyError, InstallError, OSError, ValueError) as exc:
                log.info(
                    "engine %s %s, build %s, instead of the compiled one: %s", item.engine, item.version, build.key, exc
                )
                continue
            state.failed_at = None
            self._status(item.engine, None)
            return
        state.failed_at = time.monotonic()  # the compiled one stays; try again after retry_after
        # It works: nothing is wrong on the node, unless an archive was refused (that stays said).
        self._status(item.engine, refused)

    def install(self, item: DesiredEngine) -> dict[str, Any]:
        """Install the best build that works; where none does, compile the control plane's source on
        a CPU node, but not in place of a refused archive unless the control plane allows it.
        InstallError says why nothing was installed (Refused when an archive was refused)."""
        facts = self.facts()
        builds, skipped = choose_builds(facts, item.assets)
        # Without a listing, what the control plane said is the reason, not the builds it lacks.
        reasons = list(skipped) if item.assets else [item.note] if item.note else []
        refusals: list[str] = []
        with self.lock:
            state = self.states.setdefault(item.engine, _State())
        for build in builds:
            try:
                entry = self._try_build(item, build, state)
            except Refused as exc:
                refusals.append(f"{build.key}: {exc}")
                log.warning("engine %s %s, build %s refused: %s", item.engine, item.version, build.key, exc)
                continue
            except (FetchError, UnsafeArchive, verify.VerifyError, InstallError, OSError, ValueError) as exc:
                if self.stopping.is_set():
                    raise InstallError("stopped: the agent is stopping") from None
                reasons.append(f"{build.key}: {exc}")
                log.warning("engine %s %s, build %s: %s", item.engine, item.version, build.key, exc)
                continue
            self._status(item.engine, None)
            return entry
        source = item.source if _compiles(facts) and not self.stopping.is_set() else None
        if refusals:
            return self._compile_after_refusal(item, source, "; ".join(refusals + reasons))
        if source is not None:
            # Neither GitHub nor the control plane gave a working archive: compile one.
            try:
                entry = self._install_source(item, source, facts)
            except (SourceError, UnsafeArchive, verify.VerifyError, InstallError, OSError, ValueError) as exc:
                reasons.append(f"{source.key}: {exc}")
            else:
                self._status(item.engine, None)
                return entry
        if not builds and not reasons:
            reasons.append("no build of this release suits this node")
        raise InstallError("; ".join(reasons))

    def _try_build(self, item: DesiredEngine, build: Build, state: _State) -> dict[str, Any]:
        """Install one build; Refused when its archive is refused now, or was within the hour and the
        control plane still offers the same file (it is not fetched again)."""
        key = _offer(build)
        earlier = state.refused.get(key)
        if earlier is not None and time.monotonic() - earlier[0] < RETRY_REFUSED_S:
            raise Refused(earlier[1])
        try:
            return self._install_build(item, build)
        except NoRoom:
            raise  # the node's disk, not the archive
        except (DigestMismatch, UnsafeArchive) as exc:
            state.refused[key] = (time.monotonic(), str(exc))
            raise Refused(str(exc)) from None

    def _compile_after_refusal(self, item: DesiredEngine, source: SourceBuild | None, refused: str) -> dict[str, Any]:
        """After a refused archive: Refused, unless the control plane allows a compiled build in its
        place (then the refusal stays in the status beside it)."""
        if source is None:
            raise Refused(refused)
        if not source.after_refusal:
            raise Refused(
                f"{refused}; not compiled from {source.package} {source.version} in its place: the control "
                "plane allows that only with LLMGW_ENGINE_SOURCE_AFTER_REFUSAL"
            )
        try:
            entry = self._install_source(item, source, self.facts())
        except (SourceError, UnsafeArchive, verify.VerifyError, InstallError, OSError, ValueError) as exc:
            raise Refused(f"{refused}; {source.key}: {exc}") from None
        self._status(
            item.engine,
            f"refused: {refused}; {_compiled_stays(item)}, as the control plane allows "
            "(LLMGW_ENGINE_SOURCE_AFTER_REFUSAL)",
        )
        return entry

    def _install_source(self, item: DesiredEngine, source: SourceBuild, facts: NodeFacts) -> dict[str, Any]:
        scratch = self.root / f".staging-{item.engine}-{secrets.token_hex(4)}"
        try:
            built = build_from_source(
                source,
                scratch / "work",
                tools=self.tools,
                status=lambda text: self._status(item.engine, text),
                cache=self.root / SOURCE_BUILDS,
            )
            tree = scratch / "tree" / f"llama-{source.key}"
            tree.mkdir(parents=True)
            binary = tree / BINARIES[item.engine]
            shutil.copy2(built, binary)
            shutil.rmtree(scratch / "work", ignore_errors=True)
            arch = "arm64" if facts.arch.lower() in ("aarch64", "arm64") else "x64"
            build = Build(key=f"{source.key}-{arch}", asset=Asset(source.key, None, source.sha256, ()), gpu=False)
            return self._place(item, build, scratch / "tree", binary, compiled_from=source)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # ----------------------------------------------------------------- vLLM and SGLang

    def _install_python(self, item: DesiredEngine, spec: pyenv.PythonEngine) -> dict[str, Any]:
        if spec.unsupported:
            raise Unavailable(spec.unsupported)
        facts = self.facts()
        variants = pyenv.parse_variants(item.engine, item.version, item.assets, facts.arch, spec)
        chosen, skipped = pyenv.choose_variants(facts, variants, spec, item.engine)
        if not chosen:
            raise Unavailable("; ".join(skipped) or "no build of this version suits this node")
        self.root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(self.root).free
        if spec.min_free_bytes and free < spec.min_free_bytes:
            raise InstallError(
                f"needs {human_bytes(spec.min_free_bytes)} free in {self.root} while it installs; "
                f"{human_bytes(free)} is free"
            )
        uv = self._ensure_uv(item.engine, spec, facts)
        reasons = list(skipped)
        for variant in chosen:
            try:
                entry = self._install_variant(item, variant, uv)
            except (pyenv.PythonError, FetchError, InstallError, OSError, ValueError) as exc:
                if self.stopping.is_set():
                    raise InstallError("stopped: the agent is stopping") from None
                reasons.append(f"{variant.key}: {exc}")
                log.warning("engine %s %s, build %s: %s", item.engine, item.version, variant.key, exc)
                continue
            self._status(item.engine, self._gcc_warning())
            return entry
        raise InstallError("; ".join(reasons))

    def _ensure_uv(self, engine: str, spec: pyenv.PythonEngine, facts: NodeFacts) -> pyenv.UvTool:
        """uv as agent.yaml names it, as installed before, or installed now: from its release
        (checked against its .sha256 and the digest), else from the node's package index."""
        index = self.tools.get("package-index") or None
        python = self.tools.get("python") or None
        if self.tools.get("uv"):
            return pyenv.UvTool(Path(self.tools["uv"]), self.state_dir, index, python)
        if not spec.uv_version:
            raise InstallError("the control plane named no uv version to build the environment with")
        folder = self.root / ".tools" / f"uv-{spec.uv_version}"
        binary = folder / "uv"
        if binary.is_file() and self._uv_runs(binary, spec.uv_version):
            return pyenv.UvTool(binary, self.state_dir, index, python)
        reasons = []
        archive, sidecar = pyenv.uv_asset(spec.uv_assets, facts.arch)
        scratch = self.root / f".staging-uv-{secrets.token_hex(4)}"
        try:
            if archive is not None:
                try:
                    self._install_uv_release(engine, archive, sidecar, scratch / "release", folder, spec.uv_version)
                    return pyenv.UvTool(binary, self.state_dir, index, python)
                except (pyenv.PythonError, FetchError, UnsafeArchive, InstallError, OSError, ValueError) as exc:
                    reasons.append(f"{archive.name}: {exc}")
            else:
                reasons.append(f"the uv {spec.uv_version} release lists no archive for {facts.arch}")
            try:
                self._install_uv_wheel(engine, spec.uv_version, facts.arch, scratch / "wheel", folder)
                return pyenv.UvTool(binary, self.state_dir, index, python)
            except (pyenv.PythonError, FetchError, InstallError, OSError, ValueError) as exc:
                reasons.append(f"uv from the package index: {exc}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        raise InstallError("cannot install uv: " + "; ".join(reasons))

    def _install_uv_release(
        self, engine: str, archive: Asset, sidecar: Asset | None, scratch: Path, folder: Path, version: str
    ) -> None:
        digest = archive.sha256
        if sidecar is not None:
            url, headers = self._address(sidecar.urls[0]) if sidecar.urls else ("", {})
            if not url:
                raise FetchError(f"no address to fetch {sidecar.name} from")
            published = pyenv.parse_sidecar(
                fetch_text(url, headers=headers, ca_file=self.tools.get("ca-file")), archive.name
            )
            if digest and digest != published:
                raise FetchError(
                    f"{sidecar.name} says sha256 {published[:12]}…, the release's digest says {digest[:12]}…"
                )
            digest = published
        if not digest:
            raise FetchError(f"no sha256 published for {archive.name}: refusing an unchecked download")
        scratch.mkdir(parents=True)
        path = self._fetch(engine, Asset(archive.name, archive.size, digest, archive.urls), scratch)
        self._status(engine, f"installing: unpacking {archive.name}")
        extract(path, scratch / "tree", limits=UV_RELEASE, reserve=self.disk_reserve)
        found = _find_binary(scratch / "tree", "uv")
        self._place_uv(found, folder, version)

    def _install_uv_wheel(self, engine: str, version: str, arch: str, scratch: Path, folder: Path) -> None:
        index = index_url(self.tools)

        def read(url: str) -> str:
            return fetch_text(url, headers={"Accept": "text/html"}, ca_file=self.tools.get("ca-file"))

        wheel = pyenv.find_index_wheel("uv", version, arch, index, opener=read)
        scratch.mkdir(parents=True)
        path = self._fetch(engine, wheel, scratch)
        found = pyenv.binary_from_wheel(path, scratch / "bin" / "uv")
        self._place_uv(found, folder, version)

    def _place_uv(self, found: Path, folder: Path, version: str) -> None:
        if not self._uv_runs(found, version):
            raise InstallError(f"the uv binary does not run or is not version {version}")
        staging = folder.with_name(f".{folder.name}-{secrets.token_hex(4)}")
        staging.mkdir(parents=True)
        shutil.copy2(found, staging / "uv")
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)

    @staticmethod
    def _uv_runs(binary: Path, version: str) -> bool:
        try:
            done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
        except (OSError, subprocess.TimeoutExpired):
            return False
        words = done.stdout.split()
        return done.returncode == 0 and len(words) >= 2 and words[0] == "uv" and words[1] == version

    def _install_variant(self, item: DesiredEngine, variant: pyenv.Variant, uv: pyenv.UvTool) -> dict[str, Any]:
        """Install one build of a Python engine: a new environment in a scratch folder, its packages
        at the hashes locked by the first install of this build (resolved now when there is none),
        checked on the GPU, renamed into place and recorded; the manifest entry."""
        package = pyenv.PACKAGES[item.engine]
        scratch = self.root / f".staging-{item.engine}-{secrets.token_hex(4)}"
        lock = self.root / item.engine / ".locks" / f"{item.version}-{variant.key}.txt"
        try:
            scratch.mkdir(parents=True)
            python = self._build_environment(item, variant, uv, scratch, lock)
            self._status(item.engine, f"installing: checking {item.engine} {item.version} ({variant.key}) on the GPU")
            answer = pyenv.run_check(python, package, gpu=True)
            got = str(answer.get("version") or "")
            if got.split("+", 1)[0] != item.version:
                raise pyenv.PythonError(f"the environment has {package} {got}, not {item.version}")
            final = self.root / item.engine / f"{item.version}-{variant.key}"
            _rename_into_place(scratch / "env", final)
            pyenv.run_check(final / "bin" / "python", package, gpu=False, script=pyenv.RECHECK_SCRIPT)
            lock.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(final / pyenv.REQUIREMENTS, lock)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        entry = {
            "engine": item.engine,
            "kind": "python",
            "version": item.version,
            "build": variant.key,
            "dir": str(final),
            "path": str(pyenv.entry_point(item.engine, final)),
            "gpu": True,
            "package_version": got,
            "torch": answer.get("torch"),
            "cuda": answer.get("cuda"),
            "devices": [str(d) for d in answer.get("devices") or []],
            "installed_at": time.time(),
            "checked_at": time.time(),
        }
        with self.lock:
            previous = self.manifest.get(item.engine)
            self.manifest[item.engine] = entry
        self._save()
        keep = {final, Path(previous["dir"])} if previous and previous.get("dir") else {final}
        self._prune(item.engine, keep=keep)
        log.info("engine %s %s installed: build %s at %s", item.engine, item.version, variant.key, final)
        return entry

    def _build_environment(
        self, item: DesiredEngine, variant: pyenv.Variant, uv: pyenv.UvTool, scratch: Path, lock: Path
    ) -> Path:
        """Create the environment ``<scratch>/env`` with uv and install the engine's packages into it:
        the build's wheel where it has one (fetched and checked first), the requirements from ``lock``
        where an earlier install left them, else resolved now with their hashes.  Its python."""
        package = pyenv.PACKAGES[item.engine]
        env = scratch / "env"
        log_path = scratch / "install.log"
        environ = uv.env()
        say: Callable[[str], None] = lambda text: self._status(item.engine, text)  # noqa: E731
        find_links = None
        if variant.wheel is not None:
            find_links = scratch / "wheels"
            find_links.mkdir()
            self._fetch(item.engine, variant.wheel, find_links)
        pyenv.run_logged(
            [str(uv.binary), "venv", "--relocatable", "--python", uv.python or pyenv.PYTHON_VERSION, str(env)],
            env=environ,
            log=log_path,
            say=say,
            what=f"creating the Python environment for {item.engine} {item.version}",
        )
        python = env / "bin" / "python"
        requirements = env / pyenv.REQUIREMENTS
        indexes = uv.index_args(variant, find_links)
        if lock.is_file():
            shutil.copy2(lock, requirements)  # resolved before: the same packages again
        else:
            wanted = scratch / "requirements.in"
            pin = f"{item.version}+{variant.key}" if variant.wheel is not None else item.version
            wanted.write_text(f"{package}=={pin}\n")
            pyenv.run_logged(
                [
                    str(uv.binary),
                    "pip",
                    "compile",
                    "--quiet",
                    "--generate-hashes",
                    "--python",
                    str(python),
                    *indexes,
                    "-o",
                    str(requirements),
                    str(wanted),
                ],
                env=environ,
                log=log_path,
                say=say,
                what=f"resolving {package} {pin} ({variant.key})",
            )
        pyenv.run_logged(
            [
                str(uv.binary),
                "pip",
                "install",
                "--require-hashes",
                "--python",
                str(python),
                *indexes,
                "-r",
                str(requirements),
            ],
            env=environ,
            log=log_path,
            say=say,
            what=f"installing {package} {item.version} ({variant.key})",
        )
        return python

    def _gcc_warning(self) -> str | None:
        """Triton compiles its launcher with the C compiler at the first model load."""
        if shutil.which(self.tools.get("gcc", "gcc")) or self._install_packages(["gcc"]):
            return None
        return "warning: no gcc on this node: Triton compiles its launcher when a model first loads; install gcc"

    def _fetch(self, engine: str, asset: Asset, folder: Path) -> Path:
        if not asset.sha256:
            raise FetchError(f"no sha256 published for {asset.name}: refusing an unchecked download")
        if not asset.urls:
            raise FetchError(f"no address to fetch {asset.name} from")
        dest = folder / asset.name
        self._check_room(asset, folder)
        failures: list[FetchError] = []
        for listed in asset.urls:
            url, headers = self._address(listed)

            def progress(done: int, total: int | None, name: str = asset.name) -> None:
                self._status(engine, "installing: " + progress_text(name, done, total))

            try:
                download(
                    url,
                    dest,
                    sha256=asset.sha256,
                    size=asset.size,
                    progress=progress,
                    headers=headers,
                    ca_file=self.tools.get("ca-file"),
                )
                return dest
            except FetchError as exc:
                failures.append(exc)
        text = "; ".join(str(exc) for exc in failures)
        # A whole file that is not the one published, from any address, is refused as such.
        raise DigestMismatch(text) if any(isinstance(e, DigestMismatch) for e in failures) else FetchError(text)

    def _check_room(self, asset: Asset, folder: Path) -> None:
        """FetchError when the download would leave less than the reserve free on the node's disk."""
        free = shutil.disk_usage(folder).free
        if asset.size is not None and asset.size > free - self.disk_reserve:
            raise FetchError(
                f"{asset.name} is {asset.size:,} bytes and {folder} has {free:,} bytes free: downloading it "
                f"would leave less than the {size_text(self.disk_reserve)} this node keeps free"
            )

    def _address(self, listed: str) -> tuple[str, dict[str, str]]:
        """A listed URL made absolute; the control plane's own (relative) ones carry the credential."""
        if listed.startswith(("http://", "https://")):
            return listed, {}
        url = urllib.parse.urljoin(self.server.rstrip("/") + "/", listed.lstrip("/"))
        secret = self.credential() if self.credential is not None else None
        return url, ({"Authorization": f"Bearer {secret}"} if secret else {})

    def _install_build(self, item: DesiredEngine, build: Build) -> dict[str, Any]:
        self.root.mkdir(parents=True, exist_ok=True)
        scratch = self.root / f".staging-{item.engine}-{secrets.token_hex(4)}"
        downloads = scratch / "downloads"
        tree = scratch / "tree"
        try:
            downloads.mkdir(parents=True)
            archive = self._fetch(item.engine, build.asset, downloads)
            self._status(item.engine, f"installing: unpacking {build.asset.name}")
            extract(archive, tree, limits=self.archive_limits, reserve=self.disk_reserve)
            archive.unlink()
            binary = _find_binary(tree, BINARIES[item.engine])
            if build.runtime is not None:
                runtime = self._fetch(item.engine, build.runtime, downloads)
                self._status(item.engine, f"installing: unpacking {build.runtime.name}")
                extract(runtime, scratch / "runtime", limits=self.archive_limits, reserve=self.disk_reserve)
                runtime.unlink()
                _merge_libraries(scratch / "runtime", binary.parent)
            return self._place(item, build, tree, binary)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _place(
        self, item: DesiredEngine, build: Build, tree: Path, binary: Path, compiled_from: SourceBuild | None = None
    ) -> dict[str, Any]:
        """Check the unpacked (or built) engine, then rename it into place and record it (a compiled
        one with the source it was built from: `version` stays the release it stands in for)."""
        self._status(item.engine, f"installing: checking {build.key}")
        checked = self._verify(binary, build)
        final = self.root / item.engine / f"{item.version}-{build.key}"
        relative = binary.relative_to(tree)
        _rename_into_place(tree, final)
        entry = {
            "engine": item.engine,
            "version": item.version,
            "build": build.key,
            "dir": str(final),
            "path": str(final / relative),
            "gpu": build.gpu,
            "llama_build": checked.build,
            "commit": checked.commit,
            "version_line": checked.version_line,
            "devices": list(checked.devices),
            "installed_at": time.time(),
            "checked_at": time.time(),
        }
        if compiled_from is not None:
            entry["source"] = f"{compiled_from.package} {compiled_from.version}"
        with self.lock:
            previous = self.manifest.get(item.engine)
            self.manifest[item.engine] = entry
        self._save()
        self._prune(item.engine, keep={final, Path(previous["dir"])} if previous and previous.get("dir") else {final})
        log.info("engine %s %s installed: build %s at %s", item.engine, item.version, build.key, entry["path"])
        return entry

    def _verify(self, binary: Path, build: Build) -> verify.Verified:
        ldd = self.tools.get("ldd", "ldd")
        try:
            return verify.check(binary, gpu=build.gpu, ldd=ldd)
        except verify.VerifyError:
            missing = verify.missing_libraries(binary, ldd=ldd)
            packages = sorted({p for lib in missing if (p := verify.package_for(lib))})
            if not packages or not self._install_packages(packages):
                raise
            return verify.check(binary, gpu=build.gpu, ldd=ldd)

    def _install_packages(self, packages: list[str]) -> bool:
        """Install OS packages from the node's own sources (apt-get, as root); False when it cannot."""
        apt = self.tools.get("apt-get", "apt-get")
        if not apt or not shutil.which(apt) or os.geteuid() != 0:
            return False
        log.info("installing OS packages %s with %s", ", ".join(packages), apt)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            done = subprocess.run(  # noqa: S603 - argv built here
                [apt, "install", "-y", "--no-install-recommends", *packages],
                capture_output=True,
                text=True,
                timeout=APT_TIMEOUT_S,
                env=env,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("%s install %s failed: %s", apt, " ".join(packages), exc)
            return False
        if done.returncode != 0:
            log.warning("%s install %s failed: %s", apt, " ".join(packages), done.stderr.strip()[-500:])
        return done.returncode == 0

    def _prune(self, engine: str, keep: set[Path]) -> None:
        """Remove an engine's older installs (the one before stays: engines may still run from it)."""
        folder = self.root / engine
        for child in folder.iterdir() if folder.is_dir() else ():
            if child not in keep and not child.name.startswith("."):
                shutil.rmtree(child, ignore_errors=True)

    # ----------------------------------------------------------------- re-checks

    def recheck_sync(self) -> list[str]:
        """Check every installed engine again; withdraw those that fail. Returns the withdrawn."""
        with self.lock:
            entries = dict(self.manifest)
        withdrawn = []
        for name, entry in entries.items():
            binary = Path(entry["path"])
            try:
                if entry.get("kind") == "python":
                    _recheck_python(name, entry)
                else:
                    verify.check(binary, gpu=bool(entry.get("gpu")), ldd=self.tools.get("ldd", "ldd"))
            except (verify.VerifyError, pyenv.PythonError) as exc:
                with self.lock:
                    if self.manifest.get(name) is entry:
                        del self.manifest[name]
                    state = self.states.setdefault(name, _State())
                    state.failed_at = time.monotonic()
                withdrawn.append(name)
                self._save()
                self._status(name, f"failed: re-check of {entry.get('version')} ({entry.get('build')}): {exc}")
                log.warning("engine %s failed its re-check and is withdrawn: %s", name, exc)
            else:
                with self.lock:
                    entry["checked_at"] = time.time()
        return withdrawn

    async def run_rechecks(self) -> None:
        """Check the installed engines at once and then every recheck_interval, and converge again
        every retry_after (cheap when nothing is missing; a withdrawn engine is installed again)."""
        self.loop = asyncio.get_running_loop()
        next_check = 0.0
        while True:
            try:
                now = time.monotonic()
                if self.manifest and now >= next_check:
                    await asyncio.to_thread(self.recheck_sync)
                    next_check = now + self.recheck_interval
                if self.desired is not None:
                    await self.converge(self.desired)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("re-checking the installed engines failed")
            await asyncio.sleep(min(self.recheck_interval, self.retry_after))


def _remove(path: Path) -> str:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return f"removed {path}"


def _restore_or_remove(old: Path) -> str:
    """An install _rename_into_place moved aside (``.old-<name>-<8 hex>``): removed when ``<name>``
    is in place, renamed back when it is not (the agent stopped between the two renames)."""
    name = old.name.removeprefix(".old-")[:-9]
    final = old.with_name(name)
    if not name or final.exists() or final.is_symlink():
        return _remove(old)
    old.rename(final)
    return f"put {final} back"


def _running_label(entry: dict[str, Any]) -> str:
    """ "0.5.0-dev (build 1, commit 0c1e570), source-llama-cpp-python-0.3.36-x64" from the version
    line the check read; "b10991 (cpu-x64)" (release and build) for an entry without one, and for
    a compiled one without it the source it was built from, never the release it stands in for."""
    line = str(entry.get("version_line") or "").strip()
    said = line.split(":", 1)[1].strip() if line.lower().startswith("version:") else ""
    label = f"{said}, {entry.get('build')}" if said else f"{_what_runs(entry)} ({entry.get('build')})"
    return label[:200]  # as the protocol carries it


def _what_runs(entry: Mapping[str, Any]) -> str | None:
    """The release an install is, or for a compiled one the source it was built from."""
    if entry.get("source"):
        return f"{entry['source']} source"
    if str(entry.get("build") or "").startswith("source-"):  # compiled by an agent that kept no source
        return str(entry["build"]).removeprefix("source-").rsplit("-", 1)[0] + " source"
    version = entry.get("version")
    return None if version is None else str(version)


def _compiled_stays(item: DesiredEngine) -> str:
    source = item.source
    what = f"{source.package} {source.version}" if source is not None else "source"
    return f"running llama.cpp compiled from {what} in its place"


def _offer(build: Build) -> tuple[str, str | None, tuple[str, ...]]:
    """What identifies the file(s) a build is fetched from: another digest or address is a new offer."""
    assets = (build.asset,) if build.runtime is None else (build.asset, build.runtime)
    return (
        "+".join(a.name for a in assets),
        "+".join(a.sha256 or "-" for a in assets),
        tuple(url for a in assets for url in a.urls),
    )


def _lasting(status: str | None) -> bool:
    """A status that stays until something changes (what `llmgw doctor` reads), not progress."""
    return bool(status) and not str(status).startswith("installing:")


def _shown(state: _State) -> str:
    """The status as reported: the control plane's fix after a waiting, failed or refused one."""
    text = state.status or ""
    if state.fix and text.startswith(("waiting:", "failed:", "refused:")):
        text = f"{text}; {state.fix}"
    return text[:STATUS_MAX]


def _rename_into_place(staged: Path, final: Path) -> None:
    """Put a checked install where it is used: the one there before is moved aside first and
    removed only once the new one is in place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
        final.rename(old)
    staged.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _build_matches(choice: str, entry: Mapping[str, Any]) -> bool:
    """Whether an installed environment's variant is what the node's build choice asks for."""
    build = str(entry.get("build") or "")
    if choice == "cu13":
        return build.startswith("cu13")
    if choice == "cu129":
        return build == "cu129"
    return True


def _recheck_python(engine: str, entry: Mapping[str, Any]) -> None:
    package = pyenv.PACKAGES.get(engine, engine)
    python = Path(entry["dir"]) / "bin" / "python"
    answer = pyenv.run_check(python, package, gpu=False, script=pyenv.RECHECK_SCRIPT, timeout=pyenv.RECHECK_TIMEOUT_S)
    got = str(answer.get("version") or "")
    if got.split("+", 1)[0] != entry.get("version"):
        raise pyenv.PythonError(f"the environment now has {package} {got}, not {entry.get('version')}")
    if not Path(entry["path"]).exists():
        raise pyenv.PythonError(f"{entry['path']} is gone")


def _find_binary(tree: Path, name: str) -> Path:
    found = sorted((p for p in tree.rglob(name) if p.is_file() and not p.is_symlink()), key=lambda p: len(p.parts))
    if not found:
        raise InstallError(f"the archive holds no {name}")
    return found[0]


def _merge_libraries(source: Path, target: Path) -> None:
    """Move the CUDA runtime's shared objects next to the engine (its RUNPATH is $ORIGIN)."""
    for path in sorted(source.rglob("*")):
        if ".so" in path.name and (path.is_file() or path.is_symlink()):
            dest = target / path.name
            if dest.exists() or dest.is_symlink():
                dest.unlink()
            path.rename(dest)


def _compiles(facts: NodeFacts) -> bool:
    """Whether the node may compile an engine from source when no release archive can be had: a
    Linux node without NVIDIA GPUs. A GPU node waits for the release's own CUDA builds instead."""
    return not facts.nvidia and facts.os == "linux"
