"""Model files a node keeps from the control plane's mirror.

The control plane's desired state names, under "mirror", each held version a model is served
from: a directory (the same path on every node) and its files with size, sha256 and the control
plane's URL for them. The agent fetches each file there with its node credential (Range,
resumable: agent/install/resumable.py), checked against the manifest's sha256 before it is
renamed into place, so only a whole, verified file is ever where a model's source points; the
storage probe then reports it as held and placement can use the node.

A directory outside the agent's `model_dirs` is refused (the probe would never see it, and the
control plane must not write anywhere it likes); so is a file path that leaves its directory, by
symlinks included (agent/safepath.py, as the control plane checks what a Hub names). A redirect
from the control plane is followed only where agent/install/redirects.py allows.
Files that pass are remembered (`mirror.json` in the state directory, by path, size and mtime) so
a file is hashed once, not at every desired message.

What the node makes of each version it was told to keep (`report()`: held, fetching, refused or
failed, with the reason) goes to the control plane with every heartbeat, so that placement does
not put a replica on a node that refused to fetch its weights, and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.install.resumable import FetchFailed, download
from agent.messages import MirrorState
from agent.safepath import UnsafePath, inside, is_inside

__all__ = ["MESSAGE_MAX", "MirrorSync"]

log = logging.getLogger("llmgw.agent.mirror")
STATE = "mirror.json"
MESSAGE_MAX = 2000  # characters of a version's reason kept and reported (one failure per file could be many)


@dataclass
class MirrorSync:
    state_dir: Path
    model_dirs: Sequence[str]
    address: Callable[[str], tuple[str, dict[str, str]]]  # a listed URL -> (absolute URL, headers)

    def __post_init__(self) -> None:
        self.path = Path(self.state_dir) / STATE
        self.verified: dict[str, dict[str, Any]] = self._load()
        # Version -> (state, reason): held, fetching (the file), refused or failed (why); report() sends it.
        self.states: dict[str, tuple[str, str]] = {}
        self.dirs: dict[str, str] = {}  # version -> the directory it is kept in
        self.running: asyncio.Task[None] | None = None
        self.wanted: list[Mapping[str, Any]] = []

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{STATE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.verified, indent=2, sort_keys=True))
        os.replace(tmp, self.path)

    def _allowed(self, directory: Path) -> bool:
        return any(is_inside(directory, base) for base in self.model_dirs)

    def _known_good(self, target: Path, size: int | None, sha256: str | None) -> bool:
        entry = self.verified.get(str(target))
        try:
            stat = target.stat()
        except OSError:
            return False
        return (
            entry is not None
            and entry.get("sha256") == sha256
            and entry.get("size") == stat.st_size
            and entry.get("mtime") == stat.st_mtime
            and (size is None or size == stat.st_size)
        )

    async def converge(self, items: Sequence[Mapping[str, Any]]) -> None:
        """Fetch what is missing, in a thread; one pass at a time (a newer list waits its turn)."""
        self.wanted = list(items)
        if self.running is not None and not self.running.done():
            return  # the pass under way picks up the newest list when it ends
        self.running = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            items = self.wanted
            await asyncio.to_thread(self.converge_sync, items)
            if items is self.wanted:
                return

    @property
    def status(self) -> dict[str, str]:
        """Version -> its state in words: "held", "fetching FILE", "refused: why", "failed: why"."""
        out = {}
        for key, (state, message) in dict(self.states).items():
            out[key] = state if not message else f"fetching {message}" if state == "fetching" else f"{state}: {message}"
        return out

    def report(self) -> list[MirrorState]:
        """Each version the control plane asked for last: its directory, its state (held,
        fetching, refused, failed) and, but for held, the file being fetched or the reason.
        Called on the event loop while a pass may run in its thread: it reads copies."""
        dirs = dict(self.dirs)
        out = []
        for key, (state, message) in sorted(dict(self.states).items()):
            entry: MirrorState = {
                "version": int(key) if key.isdigit() else 0,
                "dir": dirs.get(key, ""),
                "state": state,
            }
            if message:
                entry["message"] = message
            out.append(entry)
        return out

    def _set(self, key: str, state: str, message: str = "") -> bool:
        """Record a version's state; whether it changed (a refusal is logged once, not at every pass)."""
        new = (state, message[:MESSAGE_MAX])
        changed = self.states.get(key) != new
        self.states[key] = new
        return changed

    def converge_sync(self, items: Sequence[Mapping[str, Any]]) -> None:
        keys = {str(item.get("version")) for item in items}
        for gone in set(self.states) - keys:  # no longer asked for: nothing to say of it
            self.states.pop(gone, None)
            self.dirs.pop(gone, None)
        for item in items:
            directory = Path(str(item.get("dir") or ""))
            key = str(item.get("version"))
            self.dirs[key] = str(directory)
            if not directory.is_absolute() or not self._allowed(directory):
                where = ", ".join(str(d) for d in self.model_dirs) or "none"
                reason = (
                    f"{directory} is not inside this node's model_dirs ({where}); add it to model_dirs in the "
                    "node's agent.yaml, or set LLMGW_MIRROR_NODE_DIR on the control plane to a directory inside them"
                )
                if self._set(key, "refused", reason):
                    log.warning("mirror version %s: refused: %s", key, reason)
                continue
            failures = []
            for file in item.get("files") or []:
                relative = str(file.get("path") or "")
                try:
                    target = inside(directory, relative, what="file path")
                except UnsafePath as exc:
                    failures.append(f"{relative[:200]!r}: not a path inside the version ({exc})")
                    continue
                size, sha256 = file.get("size"), file.get("sha256")
                if self._known_good(target, size, sha256):
                    continue
                url, headers = self.address(str(file.get("url") or ""))
                self._set(key, "fetching", relative)
                log.info("mirror: fetching %s into %s", relative, directory)
                try:
                    download(
                        url,
                        target,
                        size=size if isinstance(size, int) else None,
                        sha256=sha256 if isinstance(sha256, str) else None,
                        blob_id=None,
                        headers=headers,
                        authority="the mirror's manifest",
                    )
                except (FetchFailed, OSError) as exc:
                    failures.append(f"{relative}: {exc}")
                    log.warning("mirror: %s: %s", relative, exc)
                    continue
                stat = target.stat()
                self.verified[str(target)] = {"sha256": sha256, "size": stat.st_size, "mtime": stat.st_mtime}
                with contextlib.suppress(OSError):
                    self._save()
            if failures:
                self._set(key, "failed", "; ".join(failures))
            else:
                self._set(key, "held")
