"""Bounds on the sign-in and sign-up forms: failed sign-ins, POSTs per address, password hashes.

Everything is counted in Django's cache (Redis in production, one process's memory
otherwise), never in the database, so a flood of wrong passwords costs no writes.

1. Failed sign-ins are counted per (client address, email typed) and, more loosely, per
   client address alone. Someone guessing passwords for an account from one address locks
   only that pair; the owner still signs in from their own address.
2. Every POST to /login/ and /signup/ counts against its address, whatever its outcome.
3. A password hash is slow on purpose. At most HASH_SLOTS of them run at once in a process;
   a request waits up to HASH_WAIT seconds for a turn and is then refused with a 429.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from django.core.cache import cache
from django.http import HttpRequest

from llmgw import http

__all__ = [
    "ADDRESS_FAILURES",
    "HASH_SLOTS",
    "HASH_WAIT",
    "PAIR_FAILURES",
    "POSTS",
    "Bound",
    "Busy",
    "Refusal",
    "check_sign_in",
    "client_address",
    "count_failure",
    "count_post",
    "forget_failures",
    "hash_slot",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bound:
    """At most `limit` events in `period` seconds, counted from the first of them."""

    limit: int
    period: int


# Failed sign-ins for one email typed from one address.
PAIR_FAILURES = Bound(limit=10, period=15 * 60)
# Failed sign-ins from one address, whatever the email: a stranger spraying many accounts.
ADDRESS_FAILURES = Bound(limit=50, period=15 * 60)
# POSTs to the sign-in and sign-up forms from one address, together.
POSTS = Bound(limit=30, period=60)
# Password hashes running at once in this process, and how long a request waits for a turn.
HASH_SLOTS = 4
HASH_WAIT = 10.0

_slots = threading.BoundedSemaphore(HASH_SLOTS)


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused and when the same request may succeed."""

    reason: str  # "pair", "address" or "posts"
    retry_after: int  # seconds

    @property
    def minutes(self) -> int:
        return max(1, math.ceil(self.retry_after / 60))


class Busy(Exception):
    """No password-hash slot came free in time."""


# Client address ------------------------------------------------------------------------


def client_address(request: HttpRequest) -> str:
    """The address a request came from (llmgw.http.client_address, which the audit log records
    too), or one shared bucket for a request without a usable one (a test client, a unix socket)."""
    return http.client_address(request) or "0.0.0.0"


# Counters ------------------------------------------------------------------------------


def _key(kind: str, *parts: str) -> str:
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]
    return f"llmgw:signin:{kind}:{digest}"


def _count(key: str) -> int:
    return int(cache.get(key) or 0)


def _bump(key: str, bound: Bound) -> int:
    """Add one to a counter whose window starts at its first event; returns the new count."""
    now = time.time()
    if cache.add(key, 0, timeout=bound.period):
        cache.set(f"{key}:until", now + bound.period, timeout=bound.period)
    try:
        return int(cache.incr(key))
    except ValueError:  # the window ended between add and incr
        cache.set(key, 1, timeout=bound.period)
        cache.set(f"{key}:until", now + bound.period, timeout=bound.period)
        return 1


def _retry_after(key: str, bound: Bound) -> int:
    until = cache.get(f"{key}:until")
    left = float(until) - time.time() if until is not None else float(bound.period)
    return max(1, math.ceil(left))


def _normalise(email: str) -> str:
    return email.strip().lower()


def check_sign_in(address: str, email: str) -> Refusal | None:
    """Refuse a sign-in before any password is checked when either failure bound is reached.

    The answer depends only on what was typed and where from, never on whether the
    account exists.
    """
    pair = _key("pair", address, _normalise(email))
    if _count(pair) >= PAIR_FAILURES.limit:
        return Refusal("pair", _retry_after(pair, PAIR_FAILURES))
    alone = _key("address", address)
    if _count(alone) >= ADDRESS_FAILURES.limit:
        return Refusal("address", _retry_after(alone, ADDRESS_FAILURES))
    return None


def count_failure(address: str, email: str) -> None:
    """Count one failed sign-in; the one that reaches a bound is logged as a lockout."""
    pair = _bump(_key("pair", address, _normalise(email)), PAIR_FAILURES)
    alone = _bump(_key("address", address), ADDRESS_FAILURES)
    if pair == PAIR_FAILURES.limit:
        logger.warning(
            "sign-in locked for %r from %s: %d failures in %d s", _normalise(email), address, pair, PAIR_FAILURES.period
        )
    if alone == ADDRESS_FAILURES.limit:
        logger.warning(
            "sign-in locked for every account from %s: %d failures in %d s", address, alone, ADDRESS_FAILURES.period
        )


def forget_failures(address: str, email: str) -> None:
    """After a good password, the pair starts afresh; the address's own count stays."""
    key = _key("pair", address, _normalise(email))
    cache.delete_many([key, f"{key}:until"])


def count_post(address: str) -> Refusal | None:
    """Count one POST to a sign-in or sign-up form; refuse it past the bound."""
    key = _key("posts", address)
    if _bump(key, POSTS) > POSTS.limit:
        return Refusal("posts", _retry_after(key, POSTS))
    return None


# Password hashes -----------------------------------------------------------------------


@contextlib.contextmanager
def hash_slot() -> Iterator[None]:
    """Hold one of the process's password-hash slots; raise Busy after HASH_WAIT seconds."""
    if not _slots.acquire(timeout=HASH_WAIT):
        logger.warning("no password-hash slot free after %.0f s: a sign-in or sign-up was refused", HASH_WAIT)
        raise Busy
    try:
        yield
    finally:
        _slots.release()
