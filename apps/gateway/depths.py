"""How many requests wait in the gateway for each model, for the nodes' history points.

The cluster app asks through its registry (apps.cluster.extensions.EXTENSIONS.waiting), which
GatewayConfig.ready() fills with `queue_depths`; the cluster app never reads the gateway's keys
itself. Read, never changed:

- with Redis, from the waiting sets every gateway process keeps there (apps.gateway.slots): the
  tickets whose expiry has not passed;
- without Redis, from this process's gateway, then the only one;
- otherwise, and when Redis does not answer, unknown: None for the model, never 0.
"""

from __future__ import annotations

import logging
import sys

from django.conf import settings

from apps.gateway.slots import shared_key
from llmgw import redis_client

__all__ = ["QUEUE_SCRIPT", "queue_depths"]

log = logging.getLogger("llmgw.gateway")

# KEYS: the gateway's waiting sets (apps.gateway.slots.SharedSlots). The tickets not yet expired in each.
QUEUE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS do out[i] = redis.call('ZCOUNT', KEYS[i], '(' .. now, '+inf') end
return out
"""


def queue_depths(names: set[str]) -> dict[str, int | None]:
    """Requests waiting in the gateway for each model: from Redis, where every web process counts
    them, or without Redis from this process's gateway (then the only one). None where unknown."""
    client = redis_client.client(timeout=2.0)
    if client is not None:
        ordered = sorted(names)
        keys = [shared_key(settings.REDIS_PREFIX, "waiting", name) for name in ordered]
        try:
            counts = client.eval(QUEUE_SCRIPT, len(keys), *keys)
        except Exception:
            log.warning("could not read the gateway's queues", exc_info=True)
            return dict.fromkeys(names)
        return {name: int(count) for name, count in zip(ordered, counts, strict=True)}
    gateway = sys.modules.get("apps.gateway.asgi")
    if gateway is None:  # no gateway in this process: its queues are not known here
        return dict.fromkeys(names)
    queue = gateway.gateway_app.admission.queue
    return {name: queue.waiting(name) for name in names}
