"""Matching long texts in other processes than the web process's (no Django).

A thread does not keep a long match from the event loop: the folding and the checks of candidates
are Python, which holds the interpreter's lock, and a thread that holds it makes the event loop
wait for it each time the loop gives it up (each socket read or write, each thread it starts):
up to the switch interval (5 ms) every time. A megabyte of adversarial prompt is about 100 ms of
such work, a 16 KiB chunk of adversarial answer about 1.3 ms, and four clients sending them kept
the other clients' /healthz waiting 3-4 times as long as alone (bench/guardrails.py --noisy).

So `Offload`, a pool of PROCESSES worker processes (spawned, never forked from the serving
process), each at a lower CPU priority (NICE) so that when the cores are short the event loops of
the web processes run first and the long texts wait, matches:

- a prompt of HEAVY_CHARS characters or more, awaited by the event loop (`check_texts`);
- the texts of ELSEWHERE_CHARS or more a guard's thread matches (a streamed chunk, a whole answer,
  a shorter prompt): the thread waits for the worker without the lock (`elsewhere`,
  `matches_blocking`). An event loop's thread never waits on a worker.

A worker compiles each set of rules once (the rules are the key) and keeps the last few. One that
dies breaks the pool: the text being matched is matched again by the caller itself (see
apps.gateway.guard), and so is every text for RETRY_S, after which a new pool is started. A text
is never let through unchecked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from apps.guardrails.engine import ELSEWHERE, PolicySet, RuleSpec, Verdict, _Matcher

__all__ = ["HEAVY_CHARS", "NICE", "PROCESSES", "Offload", "OffloadFailed", "check_texts", "matches"]

log = logging.getLogger("llmgw.guardrails")

# From this many characters of prompt on, it is matched in a worker process: about 6 ms of matching
# on text made to be the worst, against about 1 ms to send it there and back.
HEAVY_CHARS = 65_536
# Worker processes: half the cores (at most 4), as many as the guard's threads.
PROCESSES = max(1, min(4, (os.cpu_count() or 2) // 2))
NICE = 10  # added to each worker's niceness: the event loops go first when the cores are short
CACHED = 16  # compiled policy sets a worker keeps
# After a worker failed, the texts are matched by their callers for this long before a new pool is
# started: workers that cannot start (a main module that starts the server again when imported)
# are not started again for every long text.
RETRY_S = 30.0

_compiled: OrderedDict[tuple[RuleSpec, ...], PolicySet] = OrderedDict()


def _start_worker() -> None:
    with contextlib.suppress(OSError):  # not allowed here: the worker runs at the web process's priority
        os.nice(NICE)


def _kept[T](
    cache: OrderedDict[tuple[RuleSpec, ...], T], rules: tuple[RuleSpec, ...], make: Callable[[tuple[RuleSpec, ...]], T]
) -> T:
    """What `make(rules)` built for these rules, built once and kept among the CACHED last used."""
    made = cache.get(rules)
    if made is None:
        made = cache[rules] = make(rules)
        while len(cache) > CACHED:
            cache.popitem(last=False)
    else:
        cache.move_to_end(rules)
    return made


def check_texts(rules: tuple[RuleSpec, ...], texts: list[str]) -> tuple[Verdict, list[str] | None]:
    """What PolicySet(rules).check_texts(texts) says, in a worker: the verdict, and the masked texts
    (None when nothing was masked, so the texts do not travel back)."""
    verdict, masked = _kept(_compiled, rules, PolicySet).check_texts(texts)
    return verdict, masked if verdict.redacted else None


_matchers: OrderedDict[tuple[RuleSpec, ...], _Matcher] = OrderedDict()


def matches(rules: tuple[RuleSpec, ...], text: str) -> list[tuple[int, int, int]]:
    """The matches of one direction's rules in a text (`_Matcher.matches`), in a worker."""
    return _kept(_matchers, rules, _Matcher).matches_here(text)


class OffloadFailed(Exception):
    """The worker processes could not match the texts (one died, or none could be started)."""


class Offload:
    """The worker processes, started at the first long prompt."""

    def __init__(self, processes: int = PROCESSES) -> None:
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._broke_at = -math.inf  # when the last pool broke (time.monotonic())

    def pool(self) -> ProcessPoolExecutor:
        """The workers; RuntimeError while the last pool that broke is less than RETRY_S old."""
        with self._lock:
            if self._pool is None:
                wait = self._broke_at + RETRY_S - time.monotonic()
                if wait > 0:
                    raise RuntimeError(f"a worker process failed; another is started in {wait:.0f} s")
                self._pool = ProcessPoolExecutor(
                    max_workers=self.processes,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                )
            return self._pool

    def _broken(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self._broke_at = time.monotonic()
        pool.shutdown(wait=False, cancel_futures=True)

    async def check_texts(self, policies: PolicySet, texts: Sequence[str]) -> tuple[Verdict, list[str]]:
        """`policies.check_texts(texts)`, matched in a worker process. Raises OffloadFailed when no
        worker could (the caller then matches them itself)."""
        verdict, masked = await self.run(check_texts, tuple(policies.rules), list(texts))
        return verdict, masked if masked is not None else list(texts)

    async def run[T](self, function: Callable[..., T], *args: object) -> T:
        """`function(*args)` in a worker process (a module-level function that needs no Django, and
        arguments and a result that pickle), awaited. Raises OffloadFailed when no worker could:
        the caller then does the work itself."""
        try:
            pool = self.pool()
        except (OSError, RuntimeError) as exc:
            raise OffloadFailed(f"no worker process could be started: {exc}") from exc
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool, function, *args)
        except (BrokenProcessPool, CancelledError, OSError, RuntimeError) as exc:
            log.warning("a guardrail worker process failed (%s); its work is done again here", exc)
            self._broken(pool)
            raise OffloadFailed(str(exc)) from exc

    def matches_blocking(self, rules: tuple[RuleSpec, ...], text: str) -> list[tuple[int, int, int]] | None:
        """`matches(rules, text)` in a worker, this thread waiting for it (never an event loop's: None
        there, and None when no worker could, so that the caller matches the text itself)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            return None  # an event loop's thread never waits on a worker
        try:
            pool = self.pool()
        except (OSError, RuntimeError) as exc:
            log.warning("no guardrail worker process could be started (%s); the text is matched here", exc)
            return None
        try:
            return pool.submit(matches, rules, text).result()
        except (BrokenProcessPool, CancelledError, OSError, RuntimeError) as exc:  # the pool broke, or was shut down
            log.warning("a guardrail worker process failed (%r); the text is matched here", exc)
            if isinstance(exc, BrokenProcessPool):
                self._broken(pool)
            return None

    @contextlib.contextmanager
    def elsewhere(self) -> Iterator[None]:
        """While it lasts, the long texts this thread matches are matched in a worker (see
        apps.guardrails.engine.ELSEWHERE); for a guard's thread, never an event loop's."""
        ELSEWHERE.matches = self.matches_blocking
        try:
            yield
        finally:
            ELSEWHERE.matches = None

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
