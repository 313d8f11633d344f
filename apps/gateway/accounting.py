"""The last stage of every request: its metrics, its token charge, and its usage record.

`Accountant.finish(call)` runs once per request, whatever ended it: before the last byte of its
answer (or its refusal) is sent, or once it broke off. The usage record and the token charge are
made then; the metrics and the trace in the next turn of the loop, once the last byte is out. It
never blocks the event loop and never raises.

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

__all__ = ["CANCELLED", "Accountant", "UsageSink"]

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
            self._write(call)
        except Exception:
            log.exception("could not account for request %s", call.request_id)

    def _model_label(self, call: Call) -> str:
        """What the request is counted under: its model, or "-" for a name no model has (answered 404
        model_not_found), so that a name made up by a caller makes no metric series and no usage group
        of its own. A request an engine took keeps its model's name, even if the model was deleted
        before the request ended."""
        if (call.upstream is not None and call.status != 404) or self.known_model(call.model):
            return call.model
        return "-"

    def _write(self, call: Call) -> None:
        elapsed = time.perf_counter() - call.started
        first = (call.first_token_at - call.started) if call.first_token_at is not None else None
        label = self._model_label(call)
        # The metrics and the trace are made once the answer's last byte is out, in the next turn of
        # the loop (nothing waits on them, and no request reads them before then); from the figures
        # as they are now.
        observed = (label, call.status, elapsed, first, call.prompt_tokens, call.completion_tokens)
        actions = [(str(f.get("policy")), str(f.get("action"))) for f in call.guard]
        exporter = tracing.exporter()
        traced = (exporter, call, label, elapsed, time.time()) if exporter is not None else None
        try:
            asyncio.get_running_loop().call_soon(_observe, observed, actions, traced)
        except RuntimeError:  # no loop runs (a test's direct call): at once
            _observe(observed, actions, traced)
        if call.entry is None or self.usage is None:
            return
        if call.status == 429:
            call.prompt_tokens = call.completion_tokens = 0  # refused by a limit: recorded, free of charge
        tokens = (call.prompt_tokens or 0) + (call.completion_tokens or 0)
        if call.batch is not None and tokens:
            tokens = math.ceil(tokens * _batch_price_factor())
        if self.limiter is not None and call.entry.limits and tokens:
            # Started at once, in this turn of the loop: the limiters add the tokens without waiting
            # (Redis's are written by its next flush), so the task is done here and never scheduled.
            task = asyncio.Task(
                self.limiter.record_tokens(list(call.entry.limits), tokens, time.time()),
                loop=asyncio.get_running_loop(),
                eager_start=True,
            )
            if not task.done():
                task.add_done_callback(_retrieve)
            elif not task.cancelled():
                task.exception()  # a failure is the limiter's to log; retrieved so it is not reported again
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
