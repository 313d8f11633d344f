"""The stored responses' routes, as the Responses API reference has them:

- GET /v1/responses/{id}: the Response object as it was answered (`stream=true` is refused);
- DELETE /v1/responses/{id}: `{"id", "object": "response", "deleted": true}`;
- GET /v1/responses/{id}/input_items: the items the request itself sent (a string input as one
  user message), each with its id, a page at a time (`limit` 1 to 100, default 20; `order` asc or
  desc, default desc; `after` an item id), as `{"object": "list", "data", "first_id", "last_id",
  "has_more"}`;
- POST /v1/responses/{id}/cancel: only a background response can be cancelled, and this gateway
  answers none in the background: a 400 saying so.

Each takes the caller's API key; a response another organisation stored, an expired one or one
that never was are all "not found" (404), so nothing tells one from the other. With
LLMGW_RESPONSES_STORE=off the 404 says that nothing is stored.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs

from apps.gateway.errors import Refused
from apps.gateway.response_store import SETTING, Owner, ResponseStore
from apps.gateway.tables import KeyEntry

__all__ = ["PREFIX", "StoredRoutes"]

PREFIX = "/v1/responses/"
Authenticate = Callable[[dict[str, Any]], Awaitable[KeyEntry]]


class StoredRoutes:
    """Answers the stored responses' routes with `store`, after `authenticate(scope)`."""

    def __init__(self, store: ResponseStore, authenticate: Authenticate) -> None:
        self.store = store
        self.authenticate = authenticate

    @staticmethod
    def route(method: str, path: str) -> tuple[str, str] | None:
        """(response id, what: "get", "delete", "input_items" or "cancel") for a stored response's
        route, None for any other path (answered elsewhere: "No route")."""
        if not path.startswith(PREFIX):
            return None
        parts = path[len(PREFIX) :].split("/")
        if not parts[0]:
            return None
        if len(parts) == 1 and method in ("GET", "DELETE"):
            return parts[0], method.lower()
        if len(parts) == 2 and (method, parts[1]) in (("GET", "input_items"), ("POST", "cancel")):
            return parts[0], parts[1]
        return None

    async def answer(self, scope: dict[str, Any], response_id: str, what: str) -> dict[str, Any]:
        """The answer's JSON; Refused with why when there is none."""
        entry = await self.authenticate(scope)
        owner = Owner.of(entry)
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if what == "get":
            if _one(query, "stream") in ("true", "1"):
                raise Refused(400, "stream=true is not supported here: GET the response whole.", param="stream")
            found = await self.store.get(owner, response_id)
            if found is None:
                raise self._not_found(response_id)
            return found
        if what == "delete":
            if not await self.store.delete(owner, response_id):
                raise self._not_found(response_id)
            return {"id": response_id, "object": "response", "deleted": True}
        if what == "cancel":
            if await self.store.get(owner, response_id) is None:
                raise self._not_found(response_id)
            raise Refused(
                400,
                f"Only responses created with background=true can be cancelled, and '{response_id}' was not: "
                "this gateway answers every response at once.",
                code="not_cancellable",
            )
        items = await self.store.input_items(owner, response_id)
        if items is None:
            raise self._not_found(response_id)
        return page(items, query)

    def _not_found(self, response_id: str) -> Refused:
        why = "" if self.store.enabled else f" (this gateway stores no responses: {SETTING}=off)"
        return Refused(
            404, f"No response with id '{response_id}' found{why}.", kind="not_found_error", code="not_found"
        )


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    return values[-1] if values else None


def page(items: list[Any], query: dict[str, list[str]]) -> dict[str, Any]:
    """One page of a response's input items, as the list endpoint's query asks for it."""
    raw_limit = _one(query, "limit") or "20"
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise Refused(400, f"limit: expected a whole number from 1 to 100, got {raw_limit!r}.", param="limit")
    order = _one(query, "order") or "desc"
    if order not in ("asc", "desc"):
        raise Refused(400, f"order: expected asc or desc, got {order!r}.", param="order")
    ordered = [item for item in (items if order == "asc" else reversed(items)) if isinstance(item, dict)]
    after = _one(query, "after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise Refused(400, f"after: '{after}' is not an item of this response.", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    chosen = ordered[: int(raw_limit)]
    return {
        "object": "list",
        "data": chosen,
        "first_id": chosen[0].get("id") if chosen else None,
        "last_id": chosen[-1].get("id") if chosen else None,
        "has_more": len(ordered) > len(chosen),
    }
