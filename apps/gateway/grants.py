"""A batch's line run through this process's gateway: whose it is, and under which request id.

The batch runner (apps.batches.runner) does not call the gateway over HTTP with a key: an API key's
secret is never stored, so there is none to send. It calls the gateway's own ASGI application in the
same process, with a `BatchGrant` under the scope key `GRANT`. Only code in this process can put a
key into an ASGI scope (a client's request arrives with the server's scope, which never holds it),
so the grant needs no signature: it is a credential nobody outside can forge, and it names the
key by the hash the key table is indexed by.

With a grant the request is authenticated as that key (refused, as any request, when the key was
revoked or expired meanwhile), carries the grant's request id (the same for every retry of the same
try of the line, so a usage record is never written twice for it) and is recorded as a line of the
batch. Everything else (limits, guardrails, the batch band of the fair queue, usage) is the gateway's
as for any request.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GRANT", "BatchGrant"]

#: The ASGI scope key that carries a grant.
GRANT = "llmgw.batch_grant"


@dataclass(frozen=True, slots=True)
class BatchGrant:
    """Run this request as the key whose hash is `key_hash`, as a line of batch `batch_id`."""

    key_hash: str
    batch_id: str
    request_id: str
