"""Simulations asked from the console and the API: the web checks and queues them, the worker
runs them, never the web process.

1. `ask()` (the web) reads the scenario within Limits.web(): past a limit, or wrong, it is
   refused at once with the numbers (ScenarioError) and nothing is queued; a person with
   SIM_MAX_QUEUED_PER_PERSON runs queued or running is refused (TooManyRuns). Otherwise a SimRun
   row is queued and, after the commit, `start_runs()` is called.
2. `start_runs()` marks queued runs running while fewer than SIM_CONCURRENT_RUNS run, and hands
   each to the worker (apps.sim.tasks.run_simulation).
3. `execute()` (the worker) reads the live fleet when the scenario starts from it, runs the
   scenario in a child process held to SIM_MEMORY_MB and SIM_SECONDS (apps.sim.child), and
   records the report, the scenario's problems or why it failed; then starts the next.
4. `sweep()` (beat, every minute) starts what waits, fails a run whose worker stopped before it
   finished, and removes runs asked more than SIM_KEEP_SECONDS ago.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone, translation
from django.utils.translation import gettext as _

from apps.sim import run, scenario
from apps.sim.child import Outcome, run_in_child
from apps.sim.limits import Limits, figure
from apps.sim.models import SimRun
from apps.sim.service import needs_cluster, read, what_if_document, what_if_title
from llmgw.errors import ServiceError

__all__ = ["STALE_GRACE_S", "TooManyRuns", "ask", "ask_what_if", "execute", "run_for", "start_runs", "sweep"]

log = logging.getLogger(__name__)

# A run still marked running this long after its time budget ran out lost its worker.
STALE_GRACE_S = 120
ACTIVE = (SimRun.State.QUEUED, SimRun.State.RUNNING)


class TooManyRuns(ServiceError):
    """The person has as many runs queued or running as one person may have."""

    status = 429
    code = "too_many_runs"


def check(source: str | dict[str, Any], limits: Limits) -> Any:
    """The scenario's document, read and parsed within `limits` (nothing is run); ScenarioError
    with every problem otherwise. A scenario that starts from the live fleet is counted with it."""
    document = read(source, limits)
    live = run.live_nodes() if needs_cluster(document) else None
    scenario.parse(
        document if document is not None else {}, captures=settings.SIM_CAPTURES_DIR, live=live, limits=limits
    )
    if _holds_nul(document):  # PostgreSQL keeps no NUL in text or JSON
        raise scenario.ScenarioError([_("scenario: holds a NUL character, which cannot be kept")])
    return document


def _holds_nul(document: Any) -> bool:
    """Whether a text anywhere in the document (already held to its size) has a NUL character."""
    stack = [document]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return True
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return False


def ask(owner: Any, source: str | dict[str, Any], *, title: str = "") -> SimRun:
    """Queue a simulation of `source` (YAML text or its mapping) for `owner`; refused at once
    (ScenarioError, TooManyRuns) when it cannot be run."""
    check(source, Limits.web())
    with transaction.atomic():
        _hold_place(owner)
        row = SimRun.objects.create(
            owner=owner,
            title=title[:300],
            scenario=source if isinstance(source, str) else "",
            document=None if isinstance(source, str) else source,
            language=translation.get_language() or "",
        )
        transaction.on_commit(start_runs)
    return row


def ask_what_if(owner: Any, kind: str, name: str, minimum: int | None = None) -> SimRun:
    """Queue a what-if question of the live fleet (see service.what_if_document)."""
    return ask(owner, what_if_document(kind, name, minimum), title=what_if_title(kind, name, minimum))


def _hold_place(owner: Any) -> None:
    """Refuse a person who has the most runs queued or running one may have. Their account row
    is locked first, so two requests at once cannot both pass."""
    from django.contrib.auth import get_user_model

    get_user_model().objects.select_for_update().filter(pk=owner.pk).first()
    waiting = SimRun.objects.filter(owner=owner, state__in=ACTIVE).count()
    most = settings.SIM_MAX_QUEUED_PER_PERSON
    if waiting >= most:
        raise TooManyRuns(
            _(
                "You have %(count)s simulations queued or running, the most one person may have"
                " (%(max)s); wait for one to finish."
            )
            % {"count": figure(waiting), "max": figure(most)}
        )


def run_for(user: Any, pk: int) -> SimRun | None:
    """The run of that id if the person may see it: their own, or any for an administrator;
    None otherwise (and for one removed)."""
    from apps.accounts.access import is_administrator

    if pk is None or not getattr(user, "is_authenticated", False):
        return None
    rows = SimRun.objects.filter(pk=pk)
    return (rows if is_administrator(user) else rows.filter(owner_id=user.pk)).first()


def start_runs() -> int:
    """Mark queued runs running while fewer than SIM_CONCURRENT_RUNS run, and hand each to the
    worker; returns how many started. The active rows are locked first, so two callers at once
    cannot both start the last free place."""
    from apps.sim.tasks import run_simulation

    with transaction.atomic():
        active = list(SimRun.objects.select_for_update().filter(state__in=ACTIVE).order_by("created_at", "id"))
        room = settings.SIM_CONCURRENT_RUNS - sum(1 for r in active if r.state == SimRun.State.RUNNING)
        chosen = [r.pk for r in active if r.state == SimRun.State.QUEUED][: max(room, 0)]
        SimRun.objects.filter(pk__in=chosen).update(state=SimRun.State.RUNNING, started_at=timezone.now())
    for pk in chosen:
        try:
            run_simulation.delay(pk)
        except Exception:
            # The broker is away: the run waits in the queue for beat's next sweep.
            log.warning("could not hand simulation %s to the worker; it stays queued", pk, exc_info=True)
            SimRun.objects.filter(pk=pk).update(state=SimRun.State.QUEUED, started_at=None)
    return len(chosen)


def execute(pk: int) -> None:
    """Run one simulation (the worker's task), then start the next queued. Whatever happens, the
    run ends done or failed with the reason; a run that is not this task's to run is left alone."""
    row = SimRun.objects.filter(pk=pk, state=SimRun.State.RUNNING).first()
    if row is not None:
        with translation.override(row.language or settings.LANGUAGE_CODE):
            try:
                outcome = _simulate(row)
            except Exception as exc:  # a run ends failed with the reason, never a crashed worker
                log.exception("simulation %s failed", pk)
                outcome = Outcome(error=_("the simulation failed: %(why)s") % {"why": exc})
        if outcome.error:
            log.warning("simulation %s: %s %s", pk, outcome.error, outcome.stderr[-500:])
        done = outcome.report is not None and not outcome.problems and not outcome.error
        SimRun.objects.filter(pk=pk, state=SimRun.State.RUNNING).update(
            state=SimRun.State.DONE if done else SimRun.State.FAILED,
            report=outcome.report if done else None,
            problems=outcome.problems,
            error=outcome.error,
            finished_at=timezone.now(),
        )
    start_runs()


def _simulate(row: SimRun) -> Outcome:
    """Read the live fleet here when the scenario starts from it; run the rest in a child."""
    limits = Limits.web()
    source: Any = row.document if row.document is not None else row.scenario
    try:
        document = read(source, limits)
    except scenario.ScenarioError as exc:
        return Outcome(problems=exc.problems)
    payload = {
        "document": document,
        "live": run.live_fleet() if needs_cluster(document) else None,
        "captures": str(settings.SIM_CAPTURES_DIR),
        "limits": limits,
        "language": row.language,
    }
    return run_in_child(payload, memory_mb=settings.SIM_MEMORY_MB, seconds=settings.SIM_SECONDS)


def sweep() -> None:
    """Beat's pass: fail runs whose worker stopped, remove old runs, start what waits."""
    now = timezone.now()
    stale = now - timedelta(seconds=settings.SIM_SECONDS + STALE_GRACE_S)
    for row in SimRun.objects.filter(state=SimRun.State.RUNNING, started_at__lt=stale):
        with translation.override(row.language or settings.LANGUAGE_CODE):
            error = _("the worker running the simulation stopped before it finished (started %(ago)s s ago)") % {
                "ago": figure(int((now - row.started_at).total_seconds())) if row.started_at else "-"
            }
        SimRun.objects.filter(pk=row.pk, state=SimRun.State.RUNNING).update(
            state=SimRun.State.FAILED, error=error, finished_at=now
        )
    SimRun.objects.filter(created_at__lt=now - timedelta(seconds=settings.SIM_KEEP_SECONDS)).delete()
    start_runs()
