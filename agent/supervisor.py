"""Starts, watches and stops the engine processes of this node's shards.

Each engine runs in its own session and process group, with stdout and stderr appended to
`<state_dir>/logs/<shard>.log`. Engines outlive the agent: a restarted agent reads
`<state_dir>/engines.json`, adopts every recorded process that still runs (same pid, same
start time in /proc, same process group) and never signals a pid that now belongs to another
process. The supervisor only acts when told: `converge(desired, draining)` starts what is
missing, restarts what changed and stops what is no longer wanted; an engine that dies is
reported failed (exit code and log tail) and stays down until the next `converge` that wants it
— the server decides on retries and backoff.

A shard that leaves the desired list while the server lists it as draining (its replica is being
stopped: no gateway sends it new requests) keeps its engine for the requests in flight: it is
stopped as soon as the engine's own /metrics shows nothing running or waiting (read twice, and
not before `settle`, by when every gateway has stopped routing to it), or when its grace runs out,
whichever is first. Figures the engine does not give are not taken for idle: such an engine runs
out its grace. Any other running shard that is not desired is stopped at once.

States (the protocol's "report" shape, see `states()`):
    starting  started (or adopted), not answering its health check yet
    ready     answers GET /health with 200 (ranks > 0 of a multi-node replica have no HTTP
              server: they are ready while their process runs)
    draining  no longer desired, running on for the requests in flight (see above)
    failed    exited (exit code and the last 50 log lines), not ready within ready_timeout
              (stopped), or could not be started at all
    stopped   stopped by converge or after draining; reported until the next converge

No Django import; importable on Python 3.11.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.engine_metrics import read_context, read_engine_metrics
from agent.engines import ShardSpec, build_command, health_path, parse_shard, serves_http, spec_fingerprint
from agent.messages import ShardFigures
from agent.probes.procfs import process_group_usage
from agent.protocol import DrainingShard

__all__ = [
    "DRAINING",
    "FAILED",
    "READY",
    "STARTING",
    "STOPPED",
    "ProcStat",
    "Supervisor",
    "read_proc_stat",
]

log = logging.getLogger("llmgw.agent.supervisor")

STARTING = "starting"
READY = "ready"
FAILED = "failed"
STOPPED = "stopped"
DRAINING = "draining"
RUNNING = frozenset({STARTING, READY, DRAINING})

LOG_TAIL_LINES = 50
LOG_LINE_MAX = 4000
LOG_TAIL_BYTES = 256 * 1024
LOG_ROTATE_BYTES = 64 * 1024 * 1024
MARK = "==== llmgw-agent "
STATE_FILE = "engines.json"
KILL_WAIT = 5.0
DRAIN_POLL_S = 0.5  # how often a draining engine's /metrics is read
DRAIN_IDLE_READS = 2  # reads in a row that must show it idle before it is stopped
# Left out of an engine's environment: the agent's own settings and credentials.
_PRIVATE_ENV_PREFIXES = ("LLMGW_",)


# --------------------------------------------------------------------------- /proc


@dataclass(frozen=True)
class ProcStat:
    pid: int
    state: str
    ppid: int
    pgrp: int
    start_ticks: int  # field 22: start time after boot, in clock ticks

    @property
    def dead(self) -> bool:
        return self.state in ("Z", "X", "x")


def parse_stat_line(text: str) -> ProcStat | None:
    """Parse one `/proc/<pid>/stat` (the command name may hold spaces and parentheses)."""
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        return None
    rest = text[close_paren + 1 :].split()  # rest[0] is field 3
    if len(rest) < 20:
        return None
    try:
        return ProcStat(
            pid=int(text[:open_paren]), state=rest[0], ppid=int(rest[1]), pgrp=int(rest[2]), start_ticks=int(rest[19])
        )
    except ValueError:
        return None


def read_proc_stat(pid: int, proc: str = "/proc") -> ProcStat | None:
    """The process `pid` as /proc shows it now, or None when there is none."""
    try:
        with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            return parse_stat_line(handle.read())
    except OSError:
        return None


def _all_stats(proc: str = "/proc") -> list[ProcStat]:
    stats: list[ProcStat] = []
    try:
        names = os.listdir(proc)
    except OSError:
        return stats
    for name in names:
        if name.isdigit():
            stat = read_proc_stat(int(name), proc)
            if stat is not None:
                stats.append(stat)
    return stats


def _group_members(pgid: int, min_ticks: int | None = None) -> list[ProcStat]:
    """Live (non-zombie) processes of group `pgid`, started no earlier than `min_ticks`."""
    return [
        s for s in _all_stats() if s.pgrp == pgid and not s.dead and (min_ticks is None or s.start_ticks >= min_ticks)
    ]


def _reap(pid: int, ticks: int | None) -> tuple[bool, int | None]:
    """Collect the exit status of `pid` when it is a zombie child of this process started at `ticks`.

    Checks /proc first, so that a pid number reused by another child of the agent (a probe's
    nvidia-smi) is never waited for here. (exited, exit code); exit code None when not ours.
    """
    stat = read_proc_stat(pid)
    if stat is None:
        return True, None
    if ticks and stat.start_ticks != ticks:
        return True, None
    if not stat.dead:
        return False, None
    if stat.ppid != os.getpid():
        return True, None  # a zombie waiting for its own parent (init, or a subreaper)
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True, None
    if done == 0:
        return False, None
    return True, os.waitstatus_to_exitcode(status)


# --------------------------------------------------------------------------- bookkeeping


@dataclass
class _Entry:
    shard: str
    spec: ShardSpec | None
    fingerprint: str
    state: str
    pid: int | None = None
    pgid: int | None = None
    start_ticks: int | None = None
    started_at: float | None = None
    exit_code: int | None = None
    message: str | None = None
    log_tail: list[str] | None = None
    adopted: bool = False
    deadline: float = 0.0
    task: asyncio.Task[None] | None = None
    drain_task: asyncio.Task[None] | None = None
    spec_dict: dict[str, Any] | None = None
    # The tokens one request may hold, as the engine says once it is ready (None: not said).
    context_tokens: int | None = None

    @property
    def running(self) -> bool:
        return self.state in RUNNING and self.pid is not None

    def record(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "pgid": self.pgid,
            "start_ticks": self.start_ticks,
            "port": self.spec.port if self.spec else (self.spec_dict or {}).get("port"),
            "fingerprint": self.fingerprint,
            "spec": self.spec.to_dict() if self.spec else self.spec_dict,
            "started_at": self.started_at,
        }


def _requests(held: tuple[int, int]) -> str:
    running, waiting = held
    return f"{running} request{'s' if running != 1 else ''} running, {waiting} waiting"


def _drain_note(grace: float, held: tuple[int, int] | None) -> str:
    """What a draining shard's report says: whether it still holds requests, and when it stops. In
    words, not counts: each change is a report (a write, and a reload of every gateway's tables)."""
    if held is None:
        return f"draining: its engine does not say what it holds; stopped when its drain grace of {grace:g} s runs out"
    if held == (0, 0):
        return "draining: idle; stopped once every gateway has stopped routing to it"
    return f"draining: requests in flight; stopped once idle, or when its drain grace of {grace:g} s runs out"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _probe_host(host: str) -> str:
    if host in ("0.0.0.0", ""):  # noqa: S104 - a wildcard bind is answered on loopback
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _exit_message(code: int | None) -> str:
    if code is None:
        return "the engine exited while this agent was not its parent; its exit code is unknown"
    if code < 0:
        return f"the engine was killed by {_signal_name(code)}"
    return f"the engine exited with code {code}"


async def http_status(host: str, port: int, path: str, timeout: float = 2.0) -> int | None:
    """The status code of GET http://host:port/path, or None when nothing answers."""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: {_url_host(host)}:{port}\r\n"
            "Connection: close\r\nAccept: application/json\r\n\r\n".encode()
        )
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def _port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (a running engine would hide a failed start)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        return exc.errno == 98  # EADDRINUSE; anything else (unknown host...) is left to the engine
    finally:
        sock.close()
    return False


# --------------------------------------------------------------------------- the supervisor


class Supervisor:
    """Keeps this node's engine processes in line with the server's desired shard list."""

    def __init__(
        self,
        state_dir: Path,
        engines: dict[str, str],
        *,
        ready_timeout: float = 120,
        stop_grace: float = 10,
        poll_interval: float = 0.25,
        advertise_host: str | None = None,
        on_change: Callable[[], Any] | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.log_dir = self.state_dir / "logs"
        self.state_file = self.state_dir / STATE_FILE
        self.engines = dict(engines)
        self.ready_timeout = float(ready_timeout)
        self.stop_grace = float(stop_grace)
        self.poll_interval = float(poll_interval)
        #: The address other machines reach this node's engines at, for engines bound to 0.0.0.0.
        self.advertise_host = advertise_host
        self.on_change = on_change
        self._entries: dict[str, _Entry] = {}
        self._lock = asyncio.Lock()
        self._watching = False
        self._usage: dict[str, tuple[float, float]] = {}
        self._clk_tck = os.sysconf("SC_CLK_TCK")
        self._page_size = os.sysconf("SC_PAGE_SIZE")
        self._load()

    # ------------------------------------------------------------------ public

    async def adopt(self) -> list[dict[str, Any]]:
        """Start watching the engines found in engines.json (converge does this by itself). Idempotent."""
        if not self._watching:
            self._watching = True
            for entry in self._entries.values():
                if entry.running and entry.task is None:
                    entry.task = asyncio.create_task(self._watch(entry), name=f"watch {entry.shard}")
        return self.states()

    async def converge(self, desired: Iterable[ShardSpec], draining: Iterable[DrainingShard] = ()) -> None:
        """Start each desired shard that does not run (or whose fingerprint changed: stop, then start);
        drain each running shard that is not desired but listed in `draining` (see the module's
        docstring); stop every other running shard that is not desired. Returns once starts are under
        way and stops are done; readiness and drains are watched in the background (`wait_settled`)."""
        wanted: dict[str, ShardSpec] = {}
        for spec in desired:
            if spec.shard in wanted:
                raise ValueError(f"shard {spec.shard!r} is listed twice in the desired list")
            wanted[spec.shard] = spec
        drains = {item.shard: item for item in draining if item.shard not in wanted}
        await self.adopt()
        async with self._lock:
            stopping: list[_Entry] = []
            starting: list[ShardSpec] = []
            for shard, entry in list(self._entries.items()):
                if shard in wanted:
                    continue
                if entry.running:
                    if not self._keeps_draining(entry, drains.get(shard)):
                        stopping.append(entry)
                else:
                    del self._entries[shard]  # failed or stopped, reported once already: forget it
                    self._usage.pop(shard, None)
            for shard, spec in wanted.items():
                current = self._entries.get(shard)
                if current is not None and current.state == DRAINING:
                    self._cancel_drain(current)  # wanted again: it serves on
                    self._set(current, READY, message=None)
                if current is not None and current.running:
                    if current.fingerprint == spec_fingerprint(spec):
                        if current.spec != spec:  # a change that needs no restart (model name, memory claim)
                            current.spec = spec
                            self._save()
                        continue
                    log.info("shard %s changed; restarting it", shard)
                    stopping.append(current)
                starting.append(spec)
            if stopping:
                await asyncio.gather(*(self._stop(entry) for entry in stopping))
            for entry in stopping:
                if entry.shard not in wanted:
                    self._set(entry, STOPPED, message="stopped: no longer desired on this node")
            for spec in starting:
                self._start(spec)
            self._save()

    def states(self) -> list[dict[str, Any]]:
        """One dict per shard in the protocol's report shape."""
        out = []
        for shard in sorted(self._entries):
            entry = self._entries[shard]
            out.append(
                {
                    "shard": shard,
                    "state": entry.state,
                    "pid": entry.pid if entry.running else None,
                    "exit_code": entry.exit_code,
                    "log_tail": list(entry.log_tail) if entry.log_tail is not None else None,
                    "endpoint": self.endpoint(entry.spec) if entry.spec is not None else None,
                    "message": entry.message,
                    "generation": entry.spec.generation if entry.spec is not None else None,
                    "context_tokens": entry.context_tokens if entry.state == READY else None,
                }
            )
        return out

    def state(self, shard: str) -> dict[str, Any] | None:
        for item in self.states():
            if item["shard"] == shard:
                return item
        return None

    def endpoint(self, spec: ShardSpec) -> str:
        host = spec.host
        if host in ("0.0.0.0", "::", ""):  # noqa: S104
            host = self.advertise_host or socket.gethostname()
        return f"http://{_url_host(host)}:{spec.port}"

    def managed_pids(self) -> set[int]:
        """Every live process in the process groups of the engines this supervisor runs."""
        groups: dict[int, int] = {}
        for entry in self._entries.values():
            if entry.running and entry.pgid is not None and entry.start_ticks is not None:
                groups[entry.pgid] = entry.start_ticks
        if not groups:
            return set()
        return {s.pid for s in _all_stats() if s.pgrp in groups and not s.dead and s.start_ticks >= groups[s.pgrp]}

    def process_usage(self) -> list[ShardFigures]:
        """CPU time and resident memory of each running engine's process group; "cpu_cores" (cores
        used since the previous call) is absent on the first call for a shard."""
        out = []
        now = time.monotonic()
        for shard in sorted(self._entries):
            entry = self._entries[shard]
            if not entry.running or entry.pgid is None:
                continue
            usage = process_group_usage("/", entry.pgid, self._clk_tck, self._page_size)
            if usage is None or usage.processes == 0:
                continue
            item: ShardFigures = {
                "shard": shard,
                "pid": entry.pid,
                "processes": usage.processes,
                "memory_bytes": usage.rss_bytes,
            }
            if usage.cpu_seconds is not None:
                item["cpu_seconds"] = usage.cpu_seconds
                previous = self._usage.get(shard)
                if previous is not None and now > previous[0]:
                    item["cpu_cores"] = max(0.0, (usage.cpu_seconds - previous[1]) / (now - previous[0]))
                self._usage[shard] = (now, usage.cpu_seconds)
            out.append(item)
        return out

    async def engine_metrics(self, timeout: float = 2.0) -> dict[str, dict[str, Any]]:
        """The figures of each ready engine that answers HTTP (rank 0 of a replica), read at once:
        one request per engine. An engine that does not answer in `timeout` is left out."""
        targets: list[tuple[str, ShardSpec]] = []
        for shard in sorted(self._entries):
            entry = self._entries[shard]
            if entry.state not in (READY, DRAINING) or entry.spec is None:
                continue
            try:
                if not serves_http(entry.spec):
                    continue
            except ValueError:
                continue
            targets.append((shard, entry.spec))
        if not targets:
            return {}
        results = await asyncio.gather(
            *(
                read_engine_metrics(spec.engine, _probe_host(spec.host), spec.port, spec.api_key, timeout)
                for _, spec in targets
            ),
            return_exceptions=True,
        )
        out: dict[str, dict[str, Any]] = {}
        for (shard, _spec), result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.debug("reading the metrics of shard %s failed", shard, exc_info=result)
            elif result is not None:
                out[shard] = result
        return out

    async def wait_settled(self, timeout: float | None = None) -> bool:
        """Wait until no shard is starting; False when `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(e.state == STARTING for e in self._entries.values()):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(0.05, self.poll_interval))
        return True

    async def close(self) -> None:
        """Stop watching (the agent is exiting). The engines keep running, to be adopted later (and
        drained again, for what the server's list then gives them of their grace)."""
        tasks = [t for e in self._entries.values() for t in (e.task, e.drain_task) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for entry in self._entries.values():
            entry.task = entry.drain_task = None
        self._watching = False

    def log_path(self, shard: str) -> Path:
        return self.log_dir / f"{shard}.log"

    # ------------------------------------------------------------------ engines.json

    def _load(self) -> None:
        try:
            data = json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s: %s; no engines adopted", self.state_file, exc)
            return
        if not isinstance(data, dict):
            log.warning("%s is not a JSON object; no engines adopted", self.state_file)
            return
        for shard, record in data.items():
            if isinstance(record, dict):
                self._classify(str(shard), record)
        self._save()

    def _classify(self, shard: str, record: dict[str, Any]) -> None:
        spec: ShardSpec | None = None
        spec_dict = record.get("spec") if isinstance(record.get("spec"), dict) else None
        problem = None
        try:
            spec = parse_shard(spec_dict)
        except ValueError as exc:
            problem = str(exc)
        entry = _Entry(
            shard=shard,
            spec=spec,
            fingerprint=str(record.get("fingerprint") or ""),
            state=FAILED,
            spec_dict=spec_dict,
            adopted=True,
            started_at=record.get("started_at"),
        )
        self._entries[shard] = entry
        numbers = [record.get("pid"), record.get("pgid"), record.get("start_ticks")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in numbers):
            entry.message = "engines.json holds no usable pid, process group and start time for this shard"
            return
        pid, pgid, ticks = (int(v or 0) for v in numbers)
        stat = read_proc_stat(pid)
        if stat is None or (stat.dead and stat.start_ticks == ticks):
            _, entry.exit_code = _reap(pid, ticks)
            if entry.exit_code is None:
                entry.message = "the engine exited while the agent was away; its exit code is unknown"
            else:
                entry.message = _exit_message(entry.exit_code) + " while the agent was away"
            leftovers = [s.pid for s in _group_members(pgid, ticks)] if stat is None else []
            if leftovers:
                entry.message += (
                    f"; processes {leftovers} of its process group {pgid} still run and were "
                    "not signalled (after an agent restart they cannot be proven to be its own)"
                )
            entry.log_tail = self._tail(shard)
            return
        if stat.start_ticks != ticks:
            entry.message = (
                f"pid {pid} now belongs to another process (start time {stat.start_ticks}, "
                f"recorded {ticks}); it was not touched"
            )
            return
        if stat.pgrp != pgid:
            entry.message = (
                f"pid {pid} left its process group {pgid} (now in {stat.pgrp}); not adopted and not signalled"
            )
            return
        entry.pid, entry.pgid, entry.start_ticks = pid, pgid, ticks
        entry.state = STARTING
        entry.deadline = time.monotonic() + self.ready_timeout
        entry.message = "adopted from a previous agent; checking its health"
        if problem:
            entry.message += f" (its recorded spec is unreadable: {problem})"
        log.info("adopted shard %s (pid %s)", shard, pid)

    def _save(self) -> None:
        records = {shard: e.record() for shard, e in sorted(self._entries.items()) if e.running}
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # specs hold the shards' API keys
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(records, handle, indent=1, sort_keys=True)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.state_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # ------------------------------------------------------------------ states

    def _set(
        self,
        entry: _Entry,
        state: str,
        *,
        message: str | None = None,
        exit_code: int | None = None,
        log_tail: list[str] | None = None,
    ) -> None:
        changed = (entry.state, entry.message) != (state, message)
        entry.state = state
        entry.message = message
        entry.exit_code = exit_code
        entry.log_tail = log_tail
        if state not in RUNNING:
            entry.pid = entry.pgid = entry.start_ticks = None
        if changed:
            log.info("shard %s: %s%s", entry.shard, state, f" ({message})" if message else "")
            if self.on_change is not None:
                try:
                    self.on_change()
                except Exception:
                    log.exception("on_change callback failed")

    def _fail(self, entry: _Entry, message: str, exit_code: int | None = None) -> None:
        self._set(entry, FAILED, message=message, exit_code=exit_code, log_tail=self._tail(entry.shard))

    # ------------------------------------------------------------------ start

    def _start(self, spec: ShardSpec) -> None:
        entry = _Entry(shard=spec.shard, spec=spec, fingerprint=spec_fingerprint(spec), state=STARTING)
        self._entries[spec.shard] = entry
        self._usage.pop(spec.shard, None)
        binary = self.engines.get(spec.engine)
        if not binary:
            self._set(
                entry,
                FAILED,
                message=f"no {spec.engine} binary is configured on this node "
                f"(agent.yaml engines: has {sorted(self.engines) or 'none'})",
            )
            return
        try:
            argv, extra_env = build_command(spec, binary)
        except ValueError as exc:
            self._set(entry, FAILED, message=f"cannot build the {spec.engine} command: {exc}")
            return
        if serves_http(spec) and _port_in_use(spec.host, spec.port):
            self._set(
                entry,
                FAILED,
                message=f"port {spec.port} on {spec.host} is already in use by another "
                "process; the engine was not started",
            )
            return
        env = {k: v for k, v in os.environ.items() if not k.startswith(_PRIVATE_ENV_PREFIXES)}
        env.update(extra_env)
        try:
            pid = self._spawn(spec, argv, env)
        except OSError as exc:
            self._write_log(spec.shard, f"{MARK}could not start {argv[0]}: {exc}\n")
            self._fail(entry, f"could not start {argv[0]}: {exc.strerror or exc}")
            return
        stat = read_proc_stat(pid)
        entry.pid = entry.pgid = pid
        # A child stays in /proc (a zombie at worst) until we reap it, so its start time is there to read.
        entry.start_ticks = stat.start_ticks if stat is not None else 0
        entry.started_at = time.time()
        entry.deadline = time.monotonic() + self.ready_timeout
        entry.message = f"started; waiting up to {self.ready_timeout:g} s for it to answer"
        log.info("started shard %s (%s, pid %s)", spec.shard, spec.engine, pid)
        if self._watching:
            entry.task = asyncio.create_task(self._watch(entry), name=f"watch {spec.shard}")
        if self.on_change is not None:
            with contextlib.suppress(Exception):
                self.on_change()

    def _spawn(self, spec: ShardSpec, argv: list[str], env: dict[str, str]) -> int:
        """Start argv in a new session (its own process group), output appended to the shard's log."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_path(spec.shard)
        with contextlib.suppress(OSError):
            if path.stat().st_size > LOG_ROTATE_BYTES:
                os.replace(path, path.with_name(path.name + ".1"))
        shown = " ".join(a.replace(spec.api_key, "<api key>") for a in argv)
        self._write_log(
            spec.shard,
            f"{MARK}{time.strftime('%Y-%m-%dT%H:%M:%S%z')} starting shard {spec.shard} "
            f"(generation {spec.generation}): {shown}\n",
        )
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        try:
            executable = argv[0]
            if os.sep not in executable:
                found = shutil.which(executable, path=env.get("PATH"))
                if found is None:
                    raise FileNotFoundError(2, "not found on PATH", executable)
                executable = found
            return os.posix_spawn(
                executable,
                argv,
                env,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, fd, 1),
                    (os.POSIX_SPAWN_DUP2, fd, 2),
                ],
                setsid=True,
                setsigmask=(),
                setsigdef=tuple(s for s in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)) if s is not None),
            )
        finally:
            os.close(fd)

    def _write_log(self, shard: str, text: str) -> None:
        with contextlib.suppress(OSError):
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(shard), "a", encoding="utf-8") as handle:
                handle.write(text)

    def _tail(self, shard: str) -> list[str]:
        """The last lines the engine wrote since its latest start (at most 50)."""
        try:
            with open(self.log_path(shard), "rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - LOG_TAIL_BYTES))
                text = handle.read().decode("utf-8", errors="replace")
        except OSError:
            return []
        mark = text.rfind(MARK)
        if mark >= 0:
            newline = text.find("\n", mark)
            text = text[newline + 1 :] if newline >= 0 else ""
        lines = [line.rstrip("\r")[:LOG_LINE_MAX] for line in text.splitlines()]
        lines = [line for line in lines if line.strip()]
        return lines[-LOG_TAIL_LINES:]

    # ------------------------------------------------------------------ watch

    def _exited(self, entry: _Entry) -> tuple[bool, int | None]:
        """Whether the engine's main process is gone, and its exit code when this agent is its parent."""
        assert entry.pid is not None
        return _reap(entry.pid, entry.start_ticks)

    async def _watch(self, entry: _Entry) -> None:
        try:
            await self._watch_loop(entry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave the shard reported as starting for ever
            log.exception("watching shard %s failed", entry.shard)
            if entry.running:
                self._set(entry, entry.state, message=f"the agent stopped watching this engine: {exc!r}")

    async def _watch_loop(self, entry: _Entry) -> None:
        spec = entry.spec
        http = spec is not None and serves_http(spec)
        path = health_path(spec) if spec is not None else "/health"
        while entry.running:
            exited, code = self._exited(entry)
            if exited:
                self._on_exit(entry, code)
                return
            if entry.state == STARTING:
                if spec is None:
                    self._set(entry, READY, message="running (its recorded spec is unreadable: health not checked)")
                elif not http:
                    self._set(
                        entry,
                        READY,
                        message=f"running (rank {spec.rank} of {spec.nodes_per_replica}: "
                        "no HTTP endpoint on this rank)",
                    )
                else:
                    status = await http_status(_probe_host(spec.host), spec.port, path)
                    if status == 200:
                        entry.context_tokens = await read_context(_probe_host(spec.host), spec.port, spec.api_key)
                        self._set(entry, READY, message=None)
                        continue
                    if time.monotonic() >= entry.deadline:
                        exited, code = self._exited(entry)
                        if exited:
                            self._on_exit(entry, code)
                            return
                        tail = self._tail(entry.shard)
                        await self._terminate(entry)
                        self._set(
                            entry,
                            FAILED,
                            message=f"not ready within {self.ready_timeout:g} s "
                            f"(last health check: {status or 'no answer'}); stopped",
                            log_tail=tail,
                        )
                        self._save()
                        return
            await asyncio.sleep(self.poll_interval)

    def _on_exit(self, entry: _Entry, code: int | None) -> None:
        pgid, ticks = entry.pgid, entry.start_ticks
        was = entry.state
        if was == DRAINING:  # no longer desired: its end is a stop, whatever ended it
            self._set(
                entry,
                STOPPED,
                message=f"stopped: {_exit_message(code)} while draining",
                exit_code=code,
                log_tail=self._tail(entry.shard),
            )
        else:
            self._fail(entry, _exit_message(code) + (" before it was ready" if was == STARTING else ""), exit_code=code)
        if pgid is not None:
            # Its children (vLLM/SGLang workers) would keep holding GPUs; the group id cannot have been
            # reused while they live, and we saw the leader go just now.
            for member in _group_members(pgid, ticks):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(member.pid, signal.SIGKILL)
        self._save()

    # ------------------------------------------------------------------ drain

    def _keeps_draining(self, entry: _Entry, drain: DrainingShard | None) -> bool:
        """Whether a running shard that is no longer desired keeps its engine for the requests in
        flight: listed as draining with grace left, and able to hold requests (it answers HTTP and is
        ready, or was adopted running). One draining already keeps its own deadline."""
        if drain is None or drain.left <= 0:
            return False
        if entry.state == DRAINING:
            return True
        spec = entry.spec
        if spec is None or not (entry.state == READY or entry.adopted):
            return False
        try:
            if not serves_http(spec):
                return False
        except ValueError:
            return False
        self._set(
            entry,
            DRAINING,
            message=f"draining: stopped once idle, or when its drain grace of {drain.grace:g} s runs out",
        )
        entry.drain_task = asyncio.create_task(self._drain(entry, drain), name=f"drain {entry.shard}")
        return True

    def _cancel_drain(self, entry: _Entry) -> None:
        if entry.drain_task is not None:
            entry.drain_task.cancel()
            entry.drain_task = None

    async def _held(self, spec: ShardSpec) -> tuple[int, int] | None:
        """(requests running, requests waiting) by the engine's own /metrics; None when it does not say."""
        figures = await read_engine_metrics(spec.engine, _probe_host(spec.host), spec.port, spec.api_key, 2.0)
        if not figures or ("requests_running" not in figures and "requests_waiting" not in figures):
            return None
        return int(figures.get("requests_running", 0)), int(figures.get("requests_waiting", 0))

    async def _drain(self, entry: _Entry, drain: DrainingShard) -> None:
        """Wait while the engine holds requests (`_wait_idle`); then stop it, under the lock as converge
        stops. A failure while waiting is logged and ends the wait: the engine is stopped then."""
        started = time.monotonic()
        try:
            idle, held = await self._wait_idle(entry, drain)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("draining shard %s failed; stopping it", entry.shard)
            idle, held = False, None
        async with self._lock:
            if not entry.running or entry.state != DRAINING:
                return  # it exited meanwhile, or converge stopped it or wants it again
            await self._stop(entry)
            if idle:
                message = f"stopped: idle after draining for {time.monotonic() - started:.1f} s"
            else:
                still = "what it held is unknown" if held is None else _requests(held)
                message = f"stopped: its drain grace of {drain.grace:g} s ran out ({still})"
            self._set(entry, STOPPED, message=message)
            self._save()

    async def _wait_idle(self, entry: _Entry, drain: DrainingShard) -> tuple[bool, tuple[int, int] | None]:
        """(idle, what it held last) once the engine is idle or its grace is over:

        1. until `settle` has passed a gateway may still send it a request: it is not idle yet;
        2. then it is idle once DRAIN_IDLE_READS reads in a row show nothing running or waiting;
        3. whatever it holds, the wait ends when `left` seconds have passed.
        """
        assert entry.spec is not None
        started = time.monotonic()
        deadline = started + drain.left
        quiet_from = started + min(drain.settle, drain.left)
        idle_reads = 0
        held: tuple[int, int] | None = None
        while entry.running and entry.state == DRAINING and time.monotonic() < deadline:
            held = await self._held(entry.spec)
            idle_reads = idle_reads + 1 if held == (0, 0) and time.monotonic() >= quiet_from else 0
            if idle_reads >= DRAIN_IDLE_READS:
                return True, held
            note = _drain_note(drain.grace, held)
            if entry.running and entry.state == DRAINING and entry.message != note:
                self._set(entry, DRAINING, message=note)
            await asyncio.sleep(max(0.0, min(DRAIN_POLL_S, deadline - time.monotonic())))
        return False, held

    # ------------------------------------------------------------------ stop

    def _owns(self, entry: _Entry) -> bool:
        """True while the recorded leader is the process we started (same start time, same group)."""
        if entry.pid is None or entry.pgid is None:
            return False
        stat = read_proc_stat(entry.pid)
        if stat is None:
            return False
        return stat.start_ticks == entry.start_ticks and stat.pgrp == entry.pgid

    async def _stop(self, entry: _Entry) -> None:
        for task in (entry.task, entry.drain_task):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        entry.task = entry.drain_task = None
        await self._terminate(entry)
        entry.pid = entry.pgid = entry.start_ticks = None
        self._usage.pop(entry.shard, None)

    async def _terminate(self, entry: _Entry) -> None:
        """SIGTERM the engine's process group, SIGKILL it after stop_grace; wait until it is gone."""
        pid, pgid, ticks = entry.pid, entry.pgid, entry.start_ticks
        if pid is None or pgid is None:
            return
        if not self._owns(entry):
            # The leader is gone (or is not ours any more). Only members started after our leader and
            # still in its group are ours; a pid that now belongs to someone else is never signalled.
            _reap(pid, ticks)
            if read_proc_stat(pid) is None:
                for member in _group_members(pgid, ticks):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(member.pid, signal.SIGKILL)
            return
        # The server's grace for this shard (LLMGW_ENGINE_STOP_GRACE_SECONDS), else the agent's own.
        grace = (
            entry.spec.stop_grace if entry.spec is not None and entry.spec.stop_grace is not None else self.stop_grace
        )
        self._killpg(pgid, signal.SIGTERM)
        if await self._wait_gone(pid, pgid, ticks, grace):
            return
        log.warning("shard %s did not stop within %g s of SIGTERM; sending SIGKILL", entry.shard, grace)
        self._killpg(pgid, signal.SIGKILL)
        if not await self._wait_gone(pid, pgid, ticks, KILL_WAIT):
            log.error("shard %s: process group %s still has members after SIGKILL", entry.shard, pgid)

    @staticmethod
    def _killpg(pgid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    async def _wait_gone(self, pid: int, pgid: int, ticks: int | None, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            _reap(pid, ticks)
            if not _group_members(pgid, ticks):
                _reap(pid, ticks)
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
