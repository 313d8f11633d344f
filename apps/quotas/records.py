"""The usage record: what the gateway emits once per answered request, declared once.

The gateway (apps.gateway.accounting) builds it; the usage writer (apps.quotas.usage) journals it as
a JSON line, hands it to a worker as JSON (apps.quotas.tasks.write_usage) or writes it itself. A
TypedDict stays a plain dict at runtime, so nothing on the wire or in the journal changes; what
comes back from JSON is read with `from_json`, which checks that it is a mapping at all and leaves
the fields to the writer's cleaning (a missing field takes the column's default there, an unknown
one is ignored).

The keys marked NotRequired came after the first records were journaled: a record queued or
journaled by an older process may lack them.
"""

# No `from __future__ import annotations`: with it, TypedDict cannot see NotRequired in its (then
# string) annotations and counts every key as required in __required_keys__.
from datetime import datetime
from typing import Any, NotRequired, TypedDict, cast

__all__ = ["RECORD_KEYS", "UsageRecordDict", "from_json"]


class UsageRecordDict(TypedDict):
    """One answered (or refused) request, with ids rather than objects; None is "unknown", never 0."""

    request_id: str  # the gateway's id of the request ("req_..."); the record's key, written once
    created_at: float | datetime  # when it was accounted for: epoch seconds (the gateway's), or a datetime
    user_id: int | None  # accounts.User id of the key's owner
    api_key_id: int | None  # accounts.ApiKey id the request was made with
    organization_id: int | None  # accounts.Organization id of the key's project
    team_id: int | None  # accounts.Team id of the key's project
    project_id: int | None  # accounts.Project id of the key
    model: str  # the model's name as counted ("-" for a name no model has), at most 128 characters
    endpoint: str  # the API it came through ("chat.completions", "embeddings", ...)
    replica: str  # "<node>/<replica id>" of the engine that answered, "" when none did
    hardware: str  # that replica's GPU class or "cpu", "" when none answered
    stream: bool  # whether the answer was streamed
    prompt_tokens: int | None  # input tokens; None when unknown
    completion_tokens: int | None  # output tokens; None when unknown
    tokens_estimated: bool  # True when a token count is an estimate (a client that left mid-way)
    first_token_ms: float | None  # milliseconds from arrival to the first token; None when none came
    total_ms: float  # milliseconds from arrival to the end of the answer (or its refusal)
    status: int  # the HTTP status answered (499: the client went away)
    error: str  # why it failed, "" when it did not; at most 2000 characters
    # What guardrail rules matched, each {"policy", "rule", "kind", "action", "detector", "where",
    # "error"} (usage.GUARDRAIL_KEYS); None when none did.
    guardrail: NotRequired[list[dict[str, Any]] | None]
    queue_ms: NotRequired[float | None]  # milliseconds waited for a slot: 0 for a free one, None when it asked none
    batch: NotRequired[str]  # the id of the batch (apps.batches) it was a line of, "" for any other


RECORD_KEYS: frozenset[str] = UsageRecordDict.__required_keys__ | UsageRecordDict.__optional_keys__


def from_json(value: object) -> UsageRecordDict:
    """A record read back from JSON (a journal line, a broker message). Only that it is a mapping is
    checked here: its fields are checked and typed where it is written (usage._clean), as any
    record's. Anything else raises TypeError, as the writer would have failed on it."""
    if not isinstance(value, dict):
        raise TypeError(f"a usage record is a JSON object, not {type(value).__name__}")
    return cast(UsageRecordDict, value)
