"""Usage records kept on local disk before an answer's last byte is sent.

A web process holds its usage records in memory for up to half a second before they are written
or handed to a worker (apps/quotas/usage.py); `kill -9` lost those. So each record is first
appended to a journal of the process's own: one `write()` of one JSON line to the current
segment file, opened with O_APPEND. Once `write()` returns, the line is the kernel's: it survives
the process being killed at any instant after (not a machine losing power; see `sync`).

    <data dir>/usage-journal/<host>-<pid>-<start>.lock        held (flock) while the process lives
    <data dir>/usage-journal/<host>-<pid>-<start>.<n>.jsonl   segments, a new one every `segment_s`

A closed segment is settled once its records had time to be written the usual way: its lines are
read back and those not stored are written (`write_missing`, idempotent by request id), then it is
deleted. A process's own segments are settled by its writer; those of a process that died (its
lock file can be locked: the kernel released the dead one's lock) by the next process that starts
on this host, and by a worker's periodic task. Nothing here blocks the event loop for more than
one small write, and nothing raises into the request path: a journal that cannot be written is
logged and counted, and the record still goes the usual way.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter

from apps.quotas.records import UsageRecordDict, from_json

__all__ = ["JOURNAL_FAILURES", "Journal", "settle_orphans"]

log = logging.getLogger(__name__)

JOURNAL_FAILURES = Counter(
    "llmgw_usage_journal_failures", "Usage records that could not be appended to the local journal"
)

Settle = Callable[[list[UsageRecordDict]], int]

# json.dumps(record, separators=(",", ":"), default=str), with one encoder kept: given any option,
# json.dumps builds a new one for every call, and a record is appended on every request's path.
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


def _lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive lock on `path` (created), or None when another
    living process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def read_segment(path: Path) -> list[UsageRecordDict]:
    """The records of a segment; a line that cannot be read (a machine that lost power mid-line)
    is skipped."""
    records: list[UsageRecordDict] = []
    with path.open("rb") as handle:
        for line in handle:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(from_json(record))
    return records


class Journal:
    """This process's journal in `folder`; `segment_s`: how long a segment takes appends."""

    def __init__(self, folder: Path, *, segment_s: float = 10.0) -> None:
        self.folder = Path(folder)
        self.segment_s = segment_s
        self.prefix = f"{socket.gethostname()[:60]}-{os.getpid()}-{int(time.time() * 1000)}"
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._number = 0
        self._opened_at = 0.0
        self._closed: list[tuple[float, Path]] = []  # (closed at, segment) not settled yet

    def open(self) -> None:
        """Create the folder and take this process's lock; appends open segments as needed. The lock
        file is locked before it gets its name, so no other process ever takes it for a dead one's."""
        self.folder.mkdir(parents=True, exist_ok=True)
        hidden = self.folder / f".{self.prefix}.lock.new"
        fd = _lock(hidden)
        if fd is None:  # nobody else knows this name
            raise OSError(f"cannot lock {hidden}")
        os.rename(hidden, self.folder / f"{self.prefix}.lock")
        self._lock_fd = fd

    def append(self, record: UsageRecordDict) -> bool:
        """One write of one line; False (logged, counted) when it could not be done."""
        try:
            line = _encode(record).encode() + b"\n"
            if self._fd is None or time.monotonic() - self._opened_at >= self.segment_s:
                self._roll()
            assert self._fd is not None
            os.write(self._fd, line)
        except Exception as exc:  # the request path must not fail for the journal
            JOURNAL_FAILURES.inc()
            log.warning("usage journal: could not append a record: %s", exc)
            return False
        return True

    def _roll(self) -> None:
        if self._lock_fd is None:
            self.open()
        if self._fd is not None:
            os.close(self._fd)
            self._closed.append((time.monotonic(), self._segment(self._number)))
        self._number += 1
        self._fd = os.open(self._segment(self._number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._opened_at = time.monotonic()

    def _segment(self, number: int) -> Path:
        return self.folder / f"{self.prefix}.{number}.jsonl"

    def sync(self) -> None:
        """fsync the open segment: what was appended survives a machine that loses power too."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._fd)

    def settle(self, write_missing: Settle, *, older_than_s: float, everything: bool = False) -> int:
        """Settle closed segments closed at least `older_than_s` ago (with `everything`, the open one
        too: a clean stop). Returns how many records had to be written here; a segment whose
        settling fails is kept for the next time."""
        if everything and self._fd is not None:
            os.close(self._fd)
            self._closed.append((0.0, self._segment(self._number)))
            self._fd = None
        written = 0
        keep = []
        for closed_at, path in self._closed:
            if not everything and time.monotonic() - closed_at < older_than_s:
                keep.append((closed_at, path))
                continue
            try:
                written += _settle_file(path, write_missing)
            except Exception as exc:
                log.warning("usage journal: could not settle %s, keeping it: %s", path.name, exc)
                keep.append((closed_at, path))
        self._closed = keep
        return written

    def close(self) -> None:
        """Give up the lock (after `settle(everything=True)`); the lock file goes with it."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                (self.folder / f"{self.prefix}.lock").unlink()
            os.close(self._lock_fd)
            self._lock_fd = None


def _settle_file(path: Path, write_missing: Settle) -> int:
    records = read_segment(path) if path.exists() else []
    written = write_missing(records) if records else 0
    path.unlink(missing_ok=True)
    return written


def settle_orphans(folder: Path, write_missing: Settle) -> int:
    """Settle every segment of processes that died (their lock can be taken); how many records
    were not stored and are now. Safe to run from several processes at once."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    written = 0
    for lock_path in sorted(folder.glob("*.lock")):
        fd = _lock(lock_path)
        if fd is None:
            continue  # its process lives
        try:
            prefix = lock_path.name.removesuffix(".lock")
            for segment in sorted(folder.glob(f"{prefix}.*.jsonl")):
                written += _settle_file(segment, write_missing)
            lock_path.unlink(missing_ok=True)
        finally:
            os.close(fd)
    if written:
        log.warning("usage journal: %d record(s) of stopped processes were not stored; written now", written)
    return written
