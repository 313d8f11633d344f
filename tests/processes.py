"""The processes the test suite starts, found again by marks in their environment.

A process inherits its parent's environment, and an engine inherits its agent's (minus LLMGW_*),
so a mark set once reaches every process a test starts and every process those start in turn,
also one that left its parent's process group or outlived its parent:

- RUN_MARK, set in the suite's own environment when the session starts (tests/conftest.py), with
  a value of its own per session: at the end, what still runs with it was left behind by a test
  (`leftovers`), and is reported and killed. Another session running beside this one (another
  checkout, another person) has another value and is left alone.
- OWNER_MARK, set by whoever starts an `llmgw up` or an agent (tests/e2e/helpers.py,
  tests/fleet.py), with a value per data directory or agent.yaml (`owner`): what that one started
  can be killed when it is done (`kill_marked`), engines in sessions of their own included,
  while a second `llmgw up` on the same data directory adopts the engines the first left running.

An environment a test builds from nothing (not from os.environ) must add `marks()` to keep them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import uuid
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["OWNER_MARK", "RUN_MARK", "Leftover", "kill_marked", "leftovers", "mark_this_run", "marks", "owner"]

RUN_MARK = "PYTEST_LLMGW_RUN"  # not LLMGW_*: the helpers and the agent drop those from what they pass on
OWNER_MARK = "PYTEST_LLMGW_OWNER"


@dataclass(frozen=True)
class Leftover:
    pid: int
    command: str


def mark_this_run() -> str:
    """Give this process (and so everything it starts) the session's mark, once; its value."""
    return os.environ.setdefault(RUN_MARK, uuid.uuid4().hex)


def marks() -> dict[str, str]:
    """The marks this process carries, for an environment built from nothing."""
    return {name: os.environ[name] for name in (RUN_MARK, OWNER_MARK) if name in os.environ}


def owner(thing: Path | str) -> str:
    """The owner mark's value for a data directory or an agent.yaml, the same every time it is used."""
    return hashlib.sha256(f"{os.environ.get(RUN_MARK, '')}:{Path(thing).resolve()}".encode()).hexdigest()[:16]


def _environment(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    except OSError:
        return "?"


def marked(name: str, value: str) -> list[Leftover]:
    """Live processes (this one aside) whose environment has name=value."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        if _environment(pid).get(name) == value and _alive(pid):
            found.append(Leftover(pid, _command(pid)))
    return found


def leftovers() -> list[Leftover]:
    """What still runs with this session's mark."""
    value = os.environ.get(RUN_MARK)
    return marked(RUN_MARK, value) if value else []


def kill_marked(name: str, value: str) -> list[Leftover]:
    """SIGKILL every live process marked name=value (each in its own group or not); what was killed."""
    found = marked(name, value)
    for process in found:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
    return found
