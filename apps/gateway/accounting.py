"""The last stage of every request: its metrics, its token charge, and its usage record.

Each request is accounted for once, whatever ended it. One answered (or refused) in full:
`Accountant.record(call)` right before the last byte of its answer is sent makes its usage record
(in the process's journal then: a kill once the client has its answer loses nothing), and the
`Settle` it returns is called once that byte is out, and also when sending it failed: the token
charge, the metrics and the trace, none of which the answer waits for. The send returns at once
but when the client reads slower than the answer comes; until then the request counts as one in
flight, whose tokens are charged when it ends. One that broke off: `Accountant.finish(call)` does
it all at once. Neither blocks the event loop or raises.

What is charged and recorded:
- an answer the engine reported usage for: that usage;
- a stream the client left mid-way: what was relayed, by the engine's last usage report when
  one came, else output tokens counted from the chunks sent and the prompt counted with the
  engine's tokenizer (apps.gateway.tokens), or estimated from its length where nothing can
  count; the record says `tokens_estimated` when any part is an estimate. A client cannot
  dodge token limits or budgets by hanging up before the end;
- a non-streamed request the client left after it reached the engine: its prompt (the engine
  did that work), counted the same way; nothing was delivered, so no output tokens;
- a request refused by a limit (429): recorded, free of charge;
- anything else refused before reaching an engine: recorded with no tokens.

A line of a batch (apps.batches) is recorded with its batch's id, and charged against the token
limits and budgets at LLMGW_BATCH_PRICE_FACTOR times its tokens (batch work is priced lower); its
record keeps the tokens it really used.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from apps.gateway import metrics, tracing
from apps.gateway.intake import EMBEDDINGS, Call
from apps.gateway.tokens import estimate_prompt_tokens
from apps.quotas.records import UsageRecordDict

__all__ = ["CANCELLED", "Accountant", "Settle", "UsageSink"]

log = logging.getLogger("llmgw.gateway")

CANCELLED = 499  # the status recorded for a request whose client went away (nginx's use of it)
COUNT_TIMEOUT_S = 5.0  # how long a cancelled request's prompt count may take before it is estimated


class UsageSink(Protocol):
    """Where usage records go: apps.quotas.usage.UsageWriter (never blocks, never raises)."""

    def emit(self, record: UsageRecordDict) -> None: ...


class Accountant:
    """Finishes calls: `known_model(name)` says whether a model exists (the rest are counted as "-"),
    `count_prompt(call)` asks the engine for the prompt's tokens (None when it cannot)."""

    def __init__(
        self,
        *,
        usage: UsageSink | None,
        limiter: Any,
        known_model: Callable[[str], bool],
        count_prompt: Callable[[Call], Awaitable[int | None]],
    ) -> None:
        self.usage = usage
        self.limiter = limiter
        self.known_model = known_model
        self.count_prompt = count_prompt
        self._pending: set[asyncio.Task[None]] = set()

    def finish(self, call: Call) -> None:
        """Account for a finished call; one whose tokens still need counting finishes in the background."""
        if call.status == CANCELLED and call.upstream is not None and call.entry is not None:
            self._settle_from_stream(call)
            if call.prompt_tokens is None and call.endpoint is not EMBEDDINGS:
                task = asyncio.get_running_loop().create_task(self._count_then_record(call))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
                return
        self._record(call)

    def record(self, call: Call) -> Settle:
        """The usage record of a call whose answer's last byte goes out next; the rest of its
        accounting is the returned Settle's, called once that byte is out."""
        if call.status == CANCELLED and call.upstream is not None:  # accounted for as one that broke off
            self.finish(call)
            return _SETTLED
        try:
            return self._write(call)
        except Exception:
            log.exception("could not account for request %s", call.request_id)
            return _SETTLED

    async def drain(self) -> None:
        """Wait for records still being counted (at shutdown)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    @staticmethod
    def _settle_from_stream(call: Call) -> None:
        counter = call.counter
        if counter is None or call.completion_tokens is not None:
            return
        usage = counter.usage
        call.completion_tokens = usage.output_tokens
        if usage.input_tokens is not None:
            call.prompt_tokens = usage.input_tokens
        call.tokens_estimated = call.tokens_estimated or usage.estimated

    async def _count_then_record(self, call: Call) -> None:
        try:
            counted = await asyncio.wait_for(self.count_prompt(call), COUNT_TIMEOUT_S)
        except Exception:
            counted = None
        if counted is None:
            counted = estimate_prompt_tokens(call.body)
            call.tokens_estimated = True
        call.prompt_tokens = counted
        self._record(call)

    def _record(self, call: Call) -> None:
        try:
            settle = self._write(call)
        except Exception:
            log.exception("could not account for request %s", call.request_id)
            return
        settle()

    def _model_label(self, call: Call) -> str:
        """What the request is counted under: its model, or "-" for a name no model has (answered 404
        model_not_found), so that a name made up by a caller makes no metric series and no usage group
        of its own. A request an engine took keeps its model's name, even if the model was deleted
        before the request ended."""
        if (call.upstream is not None and call.status != 404) or self.known_model(call.model):
            return call.model
        return "-"

    def _write(self, call: Call) -> Settle:
        """The usage record, emitted now; the token charge, metrics and trace left to the Settle."""
        elapsed = time.perf_counter() - call.started
        first = (call.first_token_at - call.started) if call.first_token_at is not None else None
        label = self._model_label(call)
        # The metrics and the trace from the figures as they are now, whenever they are counted.
        settle = Settle(self.limiter, (label, call.status, elapsed, first, call.prompt_tokens, call.completion_tokens))
        if call.guard:
            settle.actions = [(str(f.get("policy")), str(f.get("action"))) for f in call.guard]
        exporter = tracing.exporter()
        if exporter is not None:
            settle.traced = (exporter, call, label, elapsed, time.time())
        if call.entry is None or self.usage is None:
            return settle
        if call.status == 429:
            call.prompt_tokens = call.completion_tokens = 0  # refused by a limit: recorded, free of charge
        tokens = (call.prompt_tokens or 0) + (call.completion_tokens or 0)
        if call.batch is not None and tokens:
            tokens = math.ceil(tokens * _batch_price_factor())
        if self.limiter is not None and call.entry.limits and tokens:
            settle.charge = (list(call.entry.limits), tokens)
        upstream = call.upstream
        self.usage.emit(
            {
                "request_id": call.request_id,
                "created_at": time.time(),
                "user_id": call.entry.user_id,
                "api_key_id": call.entry.key_id,
                "organization_id": call.entry.org_id,
                "team_id": call.entry.team_id,
                "project_id": call.entry.project_id,
                "model": label[:128],
                "endpoint": call.endpoint.name,
                "replica": f"{upstream.node}/{upstream.id}" if upstream else "",
                "hardware": upstream.hardware if upstream else "",
                "stream": call.stream,
                "prompt_tokens": call.prompt_tokens,
                "completion_tokens": call.completion_tokens,
                "tokens_estimated": call.tokens_estimated,
                "first_token_ms": first * 1000 if first is not None else None,
                "total_ms": elapsed * 1000,
                # None when it never asked for a slot (refused first), 0 when it took a free one.
                "queue_ms": call.queue_ms,
                "status": call.status,
                "error": call.error[:2000],
                "guardrail": call.guard or None,
                "batch": call.batch or "",
            }
        )
        return settle


class Settle:
    """What is left of a request's accounting once its usage record is made: the token charge
    against its limits, and its metrics and trace. Called once; never raises."""

    __slots__ = ("actions", "charge", "limiter", "observed", "traced")

    def __init__(self, limiter: Any, observed: tuple[Any, ...] | None) -> None:
        self.limiter = limiter
        self.observed = observed
        self.actions: list[tuple[str, str]] = []
        self.traced: tuple[Any, ...] | None = None
        self.charge: tuple[list[Any], int] | None = None

    def __call__(self) -> None:
        charge, self.charge = self.charge, None
        if charge is not None:
            _charge(self.limiter, *charge)
        observed, self.observed = self.observed, None
        if observed is not None:
            _observe(observed, self.actions, self.traced)


_SETTLED = Settle(None, None)  # for a call accounted for otherwise: nothing left to do


def _charge(limiter: Any, limits: list[Any], tokens: int) -> None:
    """The tokens added to the limiters' counts. Started at once, in this turn of the loop: the
    limiters add them without waiting (Redis's are written by its next flush), so the task is done
    here and never scheduled."""
    try:
        task = asyncio.Task(
            limiter.record_tokens(limits, tokens, time.time()), loop=asyncio.get_running_loop(), eager_start=True
        )
    except Exception:
        log.exception("could not charge a request's tokens")
        return
    if not task.done():
        task.add_done_callback(_retrieve)
    elif not task.cancelled():
        task.exception()  # a failure is the limiter's to log; retrieved so it is not reported again


def _observe(observed: tuple[Any, ...], actions: list[tuple[str, str]], traced: tuple[Any, ...] | None) -> None:
    try:
        metrics.observe(*observed)
        for policy, action in actions:
            metrics.guardrail_action(policy, action)
        if traced is not None:
            exporter, call, label, elapsed, end = traced
            exporter.add(_spans(call, label, elapsed, end))
    except Exception:
        log.exception("could not count a request in the metrics")


def _retrieve(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()


def _batch_price_factor() -> float:
    """What a batch's token counts against limits and budgets, per token used (LLMGW_BATCH_PRICE_FACTOR)."""
    from django.conf import settings

    return float(getattr(settings, "BATCH_PRICE_FACTOR", 1.0))


def _spans(call: Call, label: str, elapsed: float, end: float) -> list[dict[str, Any]]:
    """The request's spans (apps.gateway.tracing), its perf_counter times put on the wall clock
    (`end`: when it was accounted for)."""
    start = end - elapsed

    def wall(at: float | None) -> float | None:
        return None if at is None else start + (at - call.started)

    queued, leased, first = wall(call.queued_at), wall(call.leased_at), wall(call.first_token_at)
    upstream = call.upstream
    status = "cancelled" if call.status == CANCELLED else call.status
    return tracing.request_spans(
        name=f"llmgw {call.endpoint.name}",
        start=start,
        end=end,
        attributes={
            "llmgw.request_id": call.request_id,
            "gen_ai.request.model": label,
            "gen_ai.usage.input_tokens": call.prompt_tokens,
            "gen_ai.usage.output_tokens": call.completion_tokens,
            "http.response.status_code": call.status if call.status != CANCELLED else None,
            "llmgw.status": str(status),
            "llmgw.stream": call.stream,
            "llmgw.replica": f"{upstream.node}/{upstream.id}" if upstream else None,
            "llmgw.hardware": upstream.hardware if upstream else None,
        },
        error=call.error if call.status == CANCELLED or call.status >= 500 else "",
        queued=(queued, leased) if queued is not None and leased is not None else None,
        upstream=(leased, end) if leased is not None else None,
        first_token=first,
        parent=tracing.parse_traceparent(call.traceparent),
    )
