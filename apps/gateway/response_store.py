"""Stored Responses API answers: what the API's `store` keeps, continued by previous_response_id.

The Responses API stores an answer unless its request says `store: false` (the reference's
default is true); LLMGW_RESPONSES_STORE=off stores none, for sites that must not keep prompts.
A stored answer (apps.gateway.models.StoredResponse) is kept LLMGW_RESPONSES_RETENTION_DAYS
days (a beat task removes it then; until it does, an expired one is not found) and is reached
only by keys of its organisation (a key with no project: by its user's keys only): any other key
is told it does not exist.

- `ResponseStore.prepare(call, body)`, on the way in: decides whether the answer is stored, and
  for a request with previous_response_id replays the conversation before it: every response of
  its chain, oldest first, its input items then its output items, before the request's own input
  (`instructions` are not carried over, as the reference says). The chain's stored size is
  bounded by the gateway's body limit, as a conversation sent whole would be, and checked before
  any of it is read.
- `ResponseStore.keep(call)`, once the answer is complete (before its last byte goes out, so a
  client that continues at once finds it): writes it; a failure is logged, never the request's.
- `get`, `delete`, `input_items`: what GET/DELETE /v1/responses/{id} and its input_items serve
  (apps.gateway.stored).

The gateway stays out of the ORM on its event loop: every query runs in a worker thread
(asgiref's sync_to_async with thread_sensitive=False), as the tables' reload does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from apps.gateway.errors import Refused

if TYPE_CHECKING:
    from apps.gateway.intake import Call
    from apps.gateway.tables import KeyEntry

__all__ = ["Kept", "Owner", "ResponseStore", "input_items"]

log = logging.getLogger("llmgw.gateway")

#: Responses one conversation may chain, at most (each a turn or a tool call's round).
MAX_CHAIN = 1000
SETTING = "LLMGW_RESPONSES_STORE"


@dataclass(frozen=True, slots=True)
class Owner:
    """Whose stored responses a key reaches: its organisation's, or its user's when it has none."""

    org_id: int | None
    user_id: int

    @classmethod
    def of(cls, entry: KeyEntry) -> Owner:
        return cls(entry.org_id, entry.user_id)


@dataclass(slots=True)
class Kept:
    """What storing one answer needs of its request; `response` is set once the answer is complete."""

    response_id: str
    owner: Owner
    key_id: int
    model: str
    previous: str | None
    thread: str
    depth: int
    input_items: list[Any]
    response: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Link:
    """One stored response as a chain's link: no JSON read yet."""

    id: str
    previous: str | None
    thread: str
    depth: int
    size_bytes: int


class NotStored(Exception):
    """No response by that id reaches this owner (none, another organisation's, or expired)."""


class ChainBroken(Exception):
    """A response of the chain is gone (deleted, or expired) or the chain is too long."""


def input_items(given: Any, response_id: str) -> list[Any]:
    """A request's `input` as the items it stands for, each with an id (those it gave kept): a string
    is one user message; a message's string content is one text part. What is not an item object
    is kept as it is (the translation refuses it, naming it)."""
    base = response_id.removeprefix("resp_")
    if isinstance(given, str):
        given = [{"type": "message", "role": "user", "content": given}]
    if not isinstance(given, list):
        return []
    items: list[Any] = []
    for n, item in enumerate(given):
        if not isinstance(item, dict):
            items.append(item)
            continue
        item = dict(item)
        kind = item.get("type", "message")
        if kind == "message":
            item["type"] = "message"
            content = item.get("content")
            if isinstance(content, str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": content}]
            item.setdefault("status", "completed")
        if not isinstance(item.get("id"), str):
            item["id"] = f"{'msg' if kind == 'message' else 'item'}_{base}_in{n}"
        items.append(item)
    return items


class ResponseStore:
    """Stored responses for the gateway (see the module docstring). `enabled` False stores none."""

    def __init__(self, *, enabled: bool, retention_days: int, most_bytes: int) -> None:
        self.enabled = enabled
        self.retention_days = retention_days
        self.most_bytes = most_bytes

    # The way in ----------------------------------------------------------------------------------

    async def prepare(
        self, call: Call, body: dict[str, Any], check: Callable[[dict[str, Any]], object]
    ) -> dict[str, Any]:
        """The body to translate for a Responses request: the client's, or with previous_response_id
        the conversation it continues and then the client's input. Sets `call.original` (the body
        the answer describes, `store` decided) and `call.kept` when the answer is to be stored.
        `check(body)` translates the client's own body first, so a fault in it is named by its own
        index (the replayed items come before it)."""
        assert call.entry is not None
        response_id = "resp_" + call.request_id[4:]
        store = self.enabled and body.get("store") is not False
        call.original = {**body, "store": store}
        previous = body.get("previous_response_id")
        thread, depth = response_id, 0
        history: list[Any] = []
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise Refused(400, "previous_response_id: expected a response id string.", param="previous_response_id")
            if not self.enabled:
                raise Refused(
                    400,
                    f"previous_response_id cannot be followed: this gateway stores no responses ({SETTING}=off); "
                    "send the whole conversation in input.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            check({k: v for k, v in body.items() if k != "previous_response_id"})
            head, history = await self._replay(Owner.of(call.entry), previous)
            thread, depth = head.thread, head.depth + 1
        own = input_items(body.get("input"), response_id)
        if store:
            call.kept = Kept(
                response_id, Owner.of(call.entry), call.entry.key_id, call.model, previous, thread, depth, own
            )
        if previous is None:
            return body
        expanded = {k: v for k, v in body.items() if k != "previous_response_id"}
        expanded["input"] = [*history, *own]
        return expanded

    async def _replay(self, owner: Owner, previous: str) -> tuple[Link, list[Any]]:
        try:
            return await _in_thread(lambda: _chain(owner, previous, self.most_bytes))
        except NotStored:
            raise Refused(
                400,
                f"Previous response with id '{previous}' not found (none was stored for this organisation, "
                f"or it was deleted or has expired).",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None
        except ChainBroken as exc:
            raise Refused(400, str(exc), param="previous_response_id", code="previous_response_not_found") from None

    # The answer ----------------------------------------------------------------------------------

    async def keep(self, call: Call) -> None:
        """Store the call's complete answer (`call.kept.response`); a failure is logged and the answer
        goes out anyway (it then says store: true of a response that cannot be fetched)."""
        kept = call.kept
        if kept is None or kept.response is None:
            return
        try:
            await _in_thread(lambda: _save(kept, self.retention_days))
        except Exception:
            log.warning("could not store response %s", kept.response_id, exc_info=True)

    # The stored responses' routes ------------------------------------------------------------------

    async def get(self, owner: Owner, response_id: str) -> dict[str, Any] | None:
        return await _in_thread(lambda: _get(owner, response_id))

    async def delete(self, owner: Owner, response_id: str) -> bool:
        return await _in_thread(lambda: _delete(owner, response_id))

    async def input_items(self, owner: Owner, response_id: str) -> list[Any] | None:
        return await _in_thread(lambda: _input_items(owner, response_id))


async def _in_thread[T](func: Callable[[], T]) -> T:
    """func in an executor thread, whose database connection goes back to the pool after (a thread
    of the executor would keep its own otherwise, and a few of them hold a process's whole pool)."""
    from asgiref.sync import sync_to_async

    def run() -> T:
        from django.db import close_old_connections

        try:
            return func()
        finally:
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


# In the worker thread: the ORM ---------------------------------------------------------------------


def _scoped(owner: Owner) -> Any:
    from django.utils import timezone

    from apps.gateway.models import StoredResponse

    rows = StoredResponse.objects.filter(expires_at__gt=timezone.now())
    if owner.org_id is not None:
        return rows.filter(organization_id=owner.org_id)
    return rows.filter(organization__isnull=True, user_id=owner.user_id)


_LINK_FIELDS = ("id", "previous", "thread", "depth", "size_bytes")


def _chain(owner: Owner, last: str, most_bytes: int) -> tuple[Link, list[Any]]:
    """The conversation up to and including `last`: its last link, and every item of the chain
    (inputs then outputs, oldest first). Links are read first (one query for the chain's thread),
    and the JSON only once the chain is whole and within `most_bytes`."""
    found = _scoped(owner).filter(pk=last).values(*_LINK_FIELDS).first()
    if found is None:
        raise NotStored(last)
    head = Link(**found)
    earlier = {
        row["id"]: Link(**row)
        for row in _scoped(owner).filter(thread=head.thread, depth__lt=head.depth).values(*_LINK_FIELDS)
    }
    chain = [head]
    while chain[-1].previous is not None:
        before = earlier.get(chain[-1].previous)
        if before is None:
            raise ChainBroken(
                f"The conversation before '{chain[-1].id}' cannot be replayed: '{chain[-1].previous}' was "
                "deleted or has expired; send the whole conversation in input."
            )
        if len(chain) >= MAX_CHAIN:
            raise ChainBroken(
                f"The conversation up to '{last}' chains more than {MAX_CHAIN} responses; "
                "send it whole in input, or start a new one."
            )
        chain.append(before)
    chain.reverse()
    size = sum(link.size_bytes for link in chain)
    if size > most_bytes:
        raise ChainBroken(
            f"The conversation up to '{last}' holds {size} bytes, more than the {most_bytes} a request may "
            "send; start a new one, or send a shorter one whole in input."
        )
    bodies = {
        row["id"]: row
        for row in _scoped(owner).filter(pk__in=[link.id for link in chain]).values("id", "input_items", "response")
    }
    items: list[Any] = []
    for link in chain:
        row = bodies.get(link.id)
        if row is None:  # deleted between the two reads
            raise ChainBroken(f"'{link.id}' was deleted while its conversation was read; try again.")
        output = row["response"].get("output") if isinstance(row["response"], dict) else None
        items += [*row["input_items"], *(output if isinstance(output, list) else [])]
    return head, items


def _save(kept: Kept, retention_days: int) -> None:
    from django.utils import timezone

    from apps.gateway.models import StoredResponse

    response = kept.response or {}
    size = len(json.dumps(kept.input_items)) + len(json.dumps(response))
    StoredResponse.objects.create(
        id=kept.response_id,
        organization_id=kept.owner.org_id,
        user_id=kept.owner.user_id,
        key_id=kept.key_id,
        model=kept.model[:200],
        status=str(response.get("status") or "")[:20],
        previous=kept.previous,
        thread=kept.thread,
        depth=kept.depth,
        input_items=kept.input_items,
        response=response,
        size_bytes=size,
        expires_at=timezone.now() + timedelta(days=retention_days),
    )


def _get(owner: Owner, response_id: str) -> dict[str, Any] | None:
    row = _scoped(owner).filter(pk=response_id).values("response").first()
    return row["response"] if row is not None else None


def _delete(owner: Owner, response_id: str) -> bool:
    deleted, _kinds = _scoped(owner).filter(pk=response_id).delete()
    return bool(deleted > 0)


def _input_items(owner: Owner, response_id: str) -> list[Any] | None:
    row = _scoped(owner).filter(pk=response_id).values("input_items").first()
    return row["input_items"] if row is not None else None


def delete_expired(batch: int = 1000) -> int:
    """Remove up to `batch` stored responses past their retention (oldest first); how many went."""
    from django.utils import timezone

    from apps.gateway.models import StoredResponse

    ids = list(
        StoredResponse.objects.filter(expires_at__lte=timezone.now())
        .order_by("expires_at")
        .values_list("pk", flat=True)[:batch]
    )
    if not ids:
        return 0
    deleted, _kinds = StoredResponse.objects.filter(pk__in=ids).delete()
    return deleted
