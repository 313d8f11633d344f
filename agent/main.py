"""`llmgw agent`: hold one websocket to the control plane, register, heartbeat, converge.

1. Load agent.yaml. Without a credential in state_dir, trade the enrollment token for one.
2. Connect to /ws/agent/ with the credential; register with the node's hardware, and each
   engine's version as its `--version` says it (read once per binary; null when unreadable).
3. Send a heartbeat every interval with a fresh sample (taken at most every 10 s).
4. On any disconnect, reconnect with exponential backoff (at most twice the heartbeat interval,
   so a node is back within a heartbeat or two of the control plane) and full jitter, for ever.
5. Unless the server refused the node itself (its credential unknown or revoked: close codes
   4401, 4403): then the agent stops every engine it runs, sets the useless credential aside,
   and waits for a new enrollment token in agent.yaml instead of knocking again.
A bad message from the server is answered with an error and logged; it never ends the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from typing import Any

from agent import protocol, requests
from agent.config import AgentConfig, ConfigError, load_config
from agent.engines import parse_shard
from agent.install.builds import NodeFacts
from agent.install.manager import Installer, has_cuda_runtime, parse_desired_engines
from agent.sampler import Sampler
from agent.supervisor import Supervisor

__all__ = ["AGENT_VERSION", "Agent", "engine_version", "parse_engine_version", "run"]

AGENT_VERSION = "0.1.0"
FEATURES = ["heartbeat.v1", "engines.v1", "fabrics.v1", *requests.FEATURES]
REPORT_EVERY = 6  # heartbeats between full reports (besides one on every change)
REFUSED = frozenset({protocol.CLOSE_BAD_CREDENTIAL, protocol.CLOSE_REVOKED})
NEW_TOKEN_CHECK_S = 30.0  # how often a refused node looks for a new enrollment token
VERSION_TIMEOUT_S = 15.0  # for an engine's `--version` (vLLM's imports torch first)
log = logging.getLogger("llmgw.agent")


class EnrollmentError(Exception):
    pass


def enroll(config: AgentConfig) -> str:
    """Trade the one-time token for a node credential and keep it in state_dir (mode 0600)."""
    if not config.token:
        raise EnrollmentError(
            f"no node credential in {config.credential_file} and no enrollment token in agent.yaml; "
            "make one with `llmgw ctl node add NAME`"
        )
    body = json.dumps({"token": config.token}).encode()
    request = urllib.request.Request(
        config.server.rstrip("/") + "/api/v1/agent/enroll",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - the operator's server URL
            answer = json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            detail = json.load(exc).get("detail")
        except ValueError:
            detail = exc.reason
        raise EnrollmentError(f"enrollment refused ({exc.code}): {detail}") from None
    except urllib.error.URLError as exc:
        raise EnrollmentError(f"cannot reach {config.server}: {exc.reason}") from None
    credential = str(answer["credential"])
    config.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(config.credential_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(credential)
    log.info("enrolled as node %s", answer.get("node"))
    return credential


_VERSION_LINE = re.compile(r"^\s*version:\s*(\S.*?)\s*$", re.IGNORECASE | re.MULTILINE)
_BARE_VERSION = re.compile(r"^\s*v?(\d+(?:\.\d+)+\S*)\s*$", re.MULTILINE)
#: (real path, mtime in ns) -> version: an engine's `--version` runs once per binary, not at every reconnect.
_versions: dict[tuple[str, int], str | None] = {}


def parse_engine_version(text: str) -> str | None:
    """The version in what an engine's `--version` printed: from llama.cpp's "version: 6500 (abc123)"
    line, "6500 (abc123)"; else the last line that is only a version ("0.6.3.post1", as vLLM prints
    it). None when there is neither: an unknown version is not version zero."""
    match = _VERSION_LINE.search(text)
    if match:
        return match.group(1)[:200]
    bare = _BARE_VERSION.findall(text)
    return bare[-1][:200] if bare else None


def engine_version(path: str, timeout: float = VERSION_TIMEOUT_S) -> str | None:
    """The version `path --version` prints, or None when it cannot be read. Read once per binary:
    the result is kept for its real path and modification time, so a replaced binary is read again."""
    command = shutil.which(path) or path
    try:
        real = os.path.realpath(command)
        key = (real, os.stat(real).st_mtime_ns)
    except OSError:
        return None
    if key in _versions:
        return _versions[key]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    version = None
    try:
        process = subprocess.Popen(
            [command, "--version"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # noqa: S603
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    except OSError as exc:
        log.warning("cannot run %s --version: %s", command, exc.strerror or exc)
    else:
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            log.warning("%s --version did not answer within %g s; its version is unknown", command, timeout)
        else:
            version = parse_engine_version(out.decode(errors="replace"))
            if version is None:
                log.warning(
                    "%s --version printed no version (exit code %s); its version is unknown",
                    command,
                    process.returncode,
                )
    _versions[key] = version
    return version


def read_credential(config: AgentConfig) -> str | None:
    try:
        return config.credential_file.read_text().strip() or None
    except OSError:
        return None


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        sampler: Sampler | None = None,
        supervisor: Supervisor | None = None,
        *,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.hardware: dict[str, Any] = {}
        self.installer = Installer(
            config.state_dir,
            facts=self.node_facts,
            configured=config.engines,
            tools=config.tools,
            on_change=self.installer_changed,
            recheck_interval=config.engine_recheck_interval,
            retry_after=config.engine_retry_after,
            server=config.server,
            credential=lambda: read_credential(self.config),
        )
        from agent.mirror import MirrorSync

        self.mirror = MirrorSync(config.state_dir, config.model_dirs, address=self.installer._address)
        self.supervisor = supervisor or Supervisor(
            config.state_dir,
            self.installer.binaries(),
            advertise_host=config.advertise_address,
            on_change=self.engines_changed,
        )
        self.specs: list[Any] | None = None
        # Shards being stopped whose engines run on for the requests in flight (the server's list).
        self.draining: list[protocol.DrainingShard] = []
        self.rechecks: asyncio.Task[None] | None = None
        self.answering: set[asyncio.Task[None]] = set()  # requests being answered in the background
        self.sampler = sampler or Sampler(config, managed_pids=self.supervisor.managed_pids)
        self.ws: Any = None
        self.invalid_shards: list[dict[str, Any]] = []
        self.converging: asyncio.Task[None] | None = None
        self.interval = config.heartbeat_interval
        self.stopping = asyncio.Event()
        self.registered = asyncio.Event()
        self.node_name: str | None = None
        self.last_close: tuple[int | None, str] | None = None

    async def run(self) -> None:
        attempt = 0
        while not self.stopping.is_set():
            credential = read_credential(self.config)
            if credential is None:
                try:
                    credential = await asyncio.to_thread(enroll, self.config)
                except EnrollmentError as exc:
                    log.error("%s", exc)
                    if "refused" in str(exc) or "no enrollment token" in str(exc):
                        raise
            if credential is not None:
                self.last_close = None
                try:
                    if await self.session(credential):
                        attempt = 0
                except Exception as exc:  # connection refused, reset, bad handshake ...
                    log.warning("connection to %s failed: %s", self.config.websocket_url, exc)
                if self.last_close is not None and self.last_close[0] in REFUSED:
                    await self.refused(self.last_close[1])
                    attempt = 0
                    continue
            if self.stopping.is_set():
                break
            attempt += 1
            most = max(10.0, 2 * self.interval)
            delay = random.uniform(0, min(most, 2.0 ** min(attempt, 10)))  # noqa: S311 - jitter, not secrets
            log.info("reconnecting in %.1f s", delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)

    async def refused(self, reason: str) -> None:
        """The control plane does not know this node any more (revoked, deleted, or its credential
        replaced): run nothing for it, and wait for a new enrollment token rather than knock again."""
        used = self.config.token
        where = self.config_path or "agent.yaml"
        log.error(
            "the control plane refused this node (%s): stopping its engines; put a new enrollment token "
            "(`llmgw ctl node add NAME`) in %s to enrol it again",
            reason or "refused",
            where,
        )
        try:
            await self.supervisor.converge([])
        except Exception:
            log.exception("stopping the engines of a refused node failed")
        with contextlib.suppress(OSError):
            self.config.credential_file.replace(self.config.credential_file.with_name("credential.refused"))
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), NEW_TOKEN_CHECK_S)
            if self.config_path is None:
                continue
            try:
                fresh = load_config(self.config_path)
            except ConfigError as exc:
                log.warning("%s", exc)
                continue
            if fresh.token and fresh.token != used:
                self.config = fresh
                log.info("a new enrollment token was found in %s; enrolling again", where)
                return

    async def session(self, credential: str) -> bool:
        """One connection, from handshake to close. True when it got as far as registering."""
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        self.registered.clear()
        if self.rechecks is None or self.rechecks.done():
            self.rechecks = asyncio.create_task(self.installer.run_rechecks())
        versions = await asyncio.to_thread(self.engine_versions)
        async with connect(
            self.config.websocket_url,
            additional_headers={"Authorization": f"Bearer {credential}"},
            max_size=protocol.MAX_MESSAGE_BYTES,
            proxy=None,
            open_timeout=15,
        ) as ws:
            hardware, warnings = await self.sampler.hardware()
            self.hardware = dict(hardware)
            hardware.update(self.engines_report(versions))
            if self.config.advertise_address:
                hardware["advertise_address"] = self.config.advertise_address
            await self.supervisor.adopt()
            sample = await self.sampler.sample(force=True)
            register: dict[str, Any] = {
                "agent_version": AGENT_VERSION,
                "features": FEATURES,
                "labels": self.config.labels,
                "hardware": hardware,
                "sample": sample,
                "warnings": warnings,
            }
            fabrics = self.sampler.fabrics.snapshot()
            if fabrics is not None:
                register["fabrics"] = fabrics
            await ws.send(protocol.encode("register", register))
            self.ws = ws
            heartbeats = asyncio.create_task(self.heartbeats(ws))
            stop = asyncio.create_task(self.stopping.wait())
            try:
                receiver = asyncio.create_task(self.receive(ws))
                done, _ = await asyncio.wait({receiver, stop}, return_when=asyncio.FIRST_COMPLETED)
                if receiver in done and receiver.exception() and not isinstance(receiver.exception(), ConnectionClosed):
                    raise receiver.exception()  # type: ignore[misc]
            finally:
                self.ws = None
                heartbeats.cancel()
                stop.cancel()
            code, reason = ws.close_code, ws.close_reason or ""
            self.last_close = (code, reason)
            if code in {protocol.CLOSE_BAD_CREDENTIAL, protocol.CLOSE_REVOKED}:
                log.error("the server refused this node: %s (%s)", reason, code)
            elif code == protocol.CLOSE_BUSY:
                log.warning("the control plane asked this node to come back later: %s", reason)
            elif code is not None:
                log.info("connection closed: %s %s", code, reason)
        return self.registered.is_set()

    async def receive(self, ws: Any) -> None:
        async for raw in ws:
            try:
                message = protocol.parse_message(raw, expect="server")
            except protocol.ProtocolError as exc:
                log.warning("bad message from the server: %s: %s", exc.code, exc.message)
                await ws.send(protocol.error_message(exc))
                continue
            try:
                await self.handle(ws, message)
            except Exception:
                log.exception("handling %s failed", message.type)

    async def handle(self, ws: Any, message: protocol.Message) -> None:
        if message.type == "registered":
            self.node_name = message.body["node"]
            self.interval = float(message.body["heartbeat_interval"])
            self.registered.set()
            log.info("registered as node %s; heartbeat every %.0f s", self.node_name, self.interval)
        elif message.type == "error":
            log.warning(
                "the server could not use a message: %s: %s", message.body.get("code"), message.body.get("message")
            )
        elif message.type == "replaced":
            log.warning("another agent connected as this node; this connection ends")
        elif message.type == "desired":
            if "engines" in message.body:
                wanted = parse_desired_engines(message.body["engines"])
                asyncio.get_running_loop().create_task(self.install_engines(wanted))
            if "mirror" in message.body:
                await self.mirror.converge(message.body["mirror"])
            await self.desired(message.body["shards"], message.body.get("draining") or [])
        elif message.type == "request" and message.body["kind"] == "doctor":
            from agent import doctor

            checks = await asyncio.to_thread(doctor.run_checks, self.config, installed=self.installer.manifest_copy())
            await ws.send(
                protocol.encode(
                    "response",
                    {
                        "request_id": message.body["request_id"],
                        "ok": True,
                        "result": {"checks": [check.as_dict() for check in checks]},
                    },
                )
            )
        elif message.type == "request" and message.body["kind"] in requests.HANDLERS:
            task = asyncio.get_running_loop().create_task(self.answer(message.body))
            self.answering.add(task)
            task.add_done_callback(self.answering.discard)
        elif message.type == "request":
            await ws.send(
                protocol.encode(
                    "response",
                    {
                        "request_id": message.body["request_id"],
                        "ok": False,
                        "error": f"this agent cannot answer {message.body['kind']!r} requests",
                    },
                )
            )

    async def answer(self, body: dict[str, Any]) -> None:
        """Run one request's handler and send its answer on whichever connection is open then."""
        request_id, kind = body["request_id"], body["kind"]
        try:
            result = await requests.HANDLERS[kind](dict(body.get("params") or {}), self.sampler)
            answer: dict[str, Any] = {"request_id": request_id, "ok": True, "result": result}
        except requests.RequestFailed as exc:
            answer = {"request_id": request_id, "ok": False, "error": str(exc)}
        except Exception as exc:
            log.exception("answering %s %s failed", kind, request_id)
            answer = {"request_id": request_id, "ok": False, "error": f"the agent failed: {exc}"}
        ws = self.ws
        if ws is None:
            log.warning("the answer to %s %s is lost: not connected (the control plane times it out)", kind, request_id)
            return
        await ws.send(protocol.encode("response", answer))

    async def heartbeats(self, ws: Any) -> None:
        await self.registered.wait()
        count = 0
        while True:
            await asyncio.sleep(self.interval)
            sample = (await self.sampler.sample()).copy()  # the sampler keeps its own for the next call
            usage = self.supervisor.process_usage()
            if usage:
                figures = await self.supervisor.engine_metrics()
                for item in usage:
                    if item["shard"] in figures:
                        item["engine"] = figures[item["shard"]]
                sample["shards"] = usage
            mirror = self.mirror.report()  # what it makes of each mirror version it was told to keep
            if mirror:
                sample["mirror"] = mirror
            await ws.send(protocol.encode("heartbeat", {"sample": sample}))
            if self.sampler.layout_changed:
                # An operator changed a card's MIG or partition layout: the heartbeat just sent marks
                # it untrusted, and a new registration gives the control plane the new devices.
                log.warning(
                    "GPU layout changed (%s): registering again", "; ".join(self.sampler.layout_changed.values())
                )
                await ws.close(code=1000, reason="GPU layout changed")
                return
            fabrics = self.sampler.fabrics.due()
            if fabrics is not None:
                await ws.send(protocol.encode("fabrics", fabrics))
            count += 1
            if count % REPORT_EVERY == 0:
                await self.report()

    # Engines -----------------------------------------------------------------------------

    def available_engines(self) -> list[str]:
        """Engines this node can start: installed by the agent and passing their checks, or named
        in agent.yaml on purpose (and executable there). Never whatever happens to be on PATH."""
        return sorted(
            name
            for name, path in self.installer.binaries().items()
            if (name not in self.config.engines and os.access(path, os.X_OK))
            or (name in self.config.engines and (shutil.which(path) is not None or os.access(path, os.X_OK)))
        )

    def engine_versions(self) -> dict[str, str | None]:
        """The version of each engine in `available_engines()`, None where it cannot be read: what
        an installed engine's `--version` said, with its build ("0.5.0-dev (build 1, commit 0c1e570),
        cpu-x64"; Installer.versions), a named one's `--version`."""
        installed = self.installer.versions()
        versions: dict[str, str | None] = {}
        for name in self.available_engines():
            if name in installed:
                versions[name] = installed[name]
            else:
                versions[name] = engine_version(self.config.engines[name])
        return versions

    def engines_report(self, versions: dict[str, str | None] | None = None) -> dict[str, Any]:
        """What the node says of its engines: the usable ones with versions, that it has looked
        (so an empty list means none), and what each install is doing in its own words."""
        state = self.installer.report()
        usable = self.available_engines()
        return {
            "engines": usable,
            "engine_versions": self.engine_versions() if versions is None else versions,
            "engines_probed": state["probed"],
            "engine_status": state["status"],
            # Named in agent.yaml on purpose (the control plane need not fetch it), or installed here.
            "engine_sources": {name: "configured" if name in self.config.engines else "installed" for name in usable},
            # The build of each installed engine: what it can drive (placement refuses the rest).
            "engine_builds": {
                name: str(entry["build"])[:64]
                for name, entry in self.installer.manifest_copy().items()
                if name in usable and name not in self.config.engines and entry.get("build")
            },
        }

    def node_facts(self) -> NodeFacts:
        return NodeFacts.from_hardware(self.hardware, has_cuda_runtime=has_cuda_runtime())

    async def install_engines(self, wanted: list[Any]) -> None:
        try:
            await self.installer.converge(wanted)
        except Exception:
            log.exception("installing the engines failed")

    def installer_changed(self) -> None:
        """An install progressed, finished or failed, or a re-check withdrew an engine: hand the
        supervisor the binaries now usable, start shards that waited for one, and tell the server."""
        binaries = self.installer.binaries()
        grew = set(binaries) - set(self.supervisor.engines) or any(
            self.supervisor.engines.get(k) != v for k, v in binaries.items()
        )
        self.supervisor.engines = binaries
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if grew and self.specs is not None:
            loop.create_task(self.desired_specs(self.specs, self.invalid_shards, self.draining))
        if self.ws is not None:
            loop.create_task(self.report())

    async def desired(self, shards: list[dict[str, Any]], draining: list[dict[str, Any]] | None = None) -> None:
        """Converge on the server's whole shard list, in the background (engines take time). A shard
        of the draining list the agent cannot read is stopped at once, as one in neither list is."""
        drains = []
        for item in draining or []:
            try:
                drains.append(protocol.parse_draining(item))
            except ValueError as exc:
                log.warning("the server's draining entry %r is unusable: %s", str(item)[:200], exc)
        specs, invalid = [], []
        for item in shards:
            try:
                specs.append(parse_shard(item))
            except ValueError as exc:
                invalid.append(
                    {
                        "shard": str(item.get("shard", "?"))[:200],
                        "state": "failed",
                        "message": f"the agent cannot use this shard: {exc}",
                    }
                )
        await self.desired_specs(specs, invalid, drains)

    async def desired_specs(
        self, specs: list[Any], invalid: list[dict[str, Any]], draining: list[protocol.DrainingShard]
    ) -> None:
        self.invalid_shards = invalid
        self.specs = specs
        self.draining = draining
        previous = self.converging

        async def run() -> None:
            if previous is not None and not previous.done():
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await self.supervisor.converge(specs, draining)
            except Exception:
                log.exception("converging on the desired shards failed")
            await self.report()

        self.converging = asyncio.create_task(run())

    def engines_changed(self) -> None:
        if self.ws is not None:
            asyncio.get_running_loop().create_task(self.report())

    async def report(self) -> None:
        ws = self.ws
        if ws is None:
            return
        states = [{k: v for k, v in state.items() if v is not None} for state in self.supervisor.states()]
        engines = await asyncio.to_thread(self.engines_report)
        try:
            await ws.send(protocol.encode("report", {"shards": states + self.invalid_shards, "engines": engines}))
        except Exception:
            log.debug("could not send a report", exc_info=True)


def run(config_path: str) -> int:
    logging.basicConfig(
        level=os.environ.get("LLMGW_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"llmgw agent: {config_path}: {exc}", file=sys.stderr)
        return 2
    agent = Agent(config, config_path=config_path)

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop() -> None:
            agent.stopping.set()
            agent.installer.stop()  # an install under way ends now rather than hold the exit

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop)
        try:
            await agent.run()
        finally:
            agent.installer.stop()
            if agent.rechecks is not None:
                agent.rechecks.cancel()
            await agent.supervisor.close()  # the engines keep running, to be adopted next time

    try:
        asyncio.run(main())
    except EnrollmentError as exc:
        print(f"llmgw agent: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1] if len(sys.argv) > 1 else "agent.yaml"))
