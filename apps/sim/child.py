"""One simulation in a process of its own, held to a memory and a time budget.

The worker (apps.sim.runs) never runs a simulation in its own process: `run_in_child()` starts
`python -m apps.sim.child --memory-mb N`, which limits its own address space (RLIMIT_AS) to N MiB
before it imports anything large, reads what to run from stdin (a pickle written by the worker:
the scenario's document, the live fleet when the scenario starts from it, the limits, the
captures folder and the language), parses and runs it, and writes one JSON object to stdout:
{"report": ...} or {"problems": [...]} or {"error": "..."}. The child reads no database.

The parent waits at most the time budget, then kills the child. What comes back is an Outcome:
the report, the scenario's problems, or why the run failed with the numbers ("the simulation
passed its memory budget of 2,048 MiB", "the simulation ran past its 300 s").
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MEMORY_EXIT", "Outcome", "main", "run_in_child"]

MEMORY_EXIT = 86  # the child's exit status when it ran out of its memory budget
STDERR_KEPT = 4000  # characters of the child's stderr kept for the log


@dataclass
class Outcome:
    """What a child run gave: a report, the scenario's problems, or the reason it failed."""

    report: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)
    error: str = ""
    stderr: str = ""


def _root() -> str:
    """The folder `apps` is imported from, for the child's PYTHONPATH."""
    return str(Path(__file__).resolve().parent.parent.parent)


def run_in_child(payload: dict[str, Any], *, memory_mb: int, seconds: float) -> Outcome:
    """Run `payload` (see the module's docstring) in a child process; never raises for what the
    child does: a budget passed, a crash or output that is not a report are Outcomes with an error."""
    from django.utils.translation import gettext as _

    from apps.sim.limits import figure

    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_root(), os.environ.get("PYTHONPATH")) if p)}
    env["MALLOC_ARENA_MAX"] = "2"  # each thread's malloc arena reserves address space the budget counts
    command = [sys.executable, "-m", "apps.sim.child", "--memory-mb", str(memory_mb)]
    child = subprocess.Popen(  # noqa: S603 - our own interpreter and module
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        out, err = child.communicate(data, timeout=seconds)
    except subprocess.TimeoutExpired:
        child.kill()
        _out, err = child.communicate()
        return Outcome(
            error=_("the simulation ran past its %(seconds)s s") % {"seconds": figure(round(seconds))},
            stderr=_tail(err),
        )
    memory = _("the simulation passed its memory budget of %(budget)s MiB") % {"budget": figure(memory_mb)}
    text = _tail(err)
    if child.returncode == MEMORY_EXIT or (child.returncode != 0 and "MemoryError" in text):
        return Outcome(error=memory, stderr=text)
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name if -child.returncode in signal.valid_signals() else ""
        return Outcome(
            error=_("the simulation's process ended with signal %(signal)s") % {"signal": name or -child.returncode},
            stderr=text,
        )
    try:
        answer = json.loads(out)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        return Outcome(
            error=_("the simulation's process ended (exit status %(code)s) without a report")
            % {"code": child.returncode},
            stderr=text,
        )
    return Outcome(
        report=answer.get("report"),
        problems=[str(p) for p in answer.get("problems") or []],
        error=str(answer.get("error") or ""),
        stderr=text,
    )


def _tail(err: bytes | None) -> str:
    return (err or b"")[-STDERR_KEPT:].decode("utf-8", errors="replace")


# The child's side --------------------------------------------------------------------------------


def _limit_memory(megabytes: int) -> None:
    import resource

    budget = megabytes * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (budget, budget))


def _simulate(payload: dict[str, Any]) -> dict[str, Any]:
    from apps.sim import run, scenario

    live = payload.get("live")
    try:
        parsed = scenario.parse(
            payload["document"] if payload["document"] is not None else {},
            captures=Path(payload["captures"]) if payload.get("captures") else None,
            live=live["by_name"] if live is not None else None,
            limits=payload["limits"],
        )
        return {"report": run.simulate(parsed, live)}
    except scenario.ScenarioError as exc:
        return {"problems": exc.problems}


def main(argv: list[str] | None = None) -> int:
    """The child: limit the memory, read the payload, run, answer on stdout."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--memory-mb" or not args[1].isascii() or not args[1].isdigit():
        print("usage: python -m apps.sim.child --memory-mb N < payload", file=sys.stderr)
        return 2
    _limit_memory(int(args[1]))
    answer_to = sys.stdout
    sys.stdout = sys.stderr  # whatever else prints goes to stderr: stdout carries the answer alone
    try:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
        import django

        django.setup()
        from django.utils import translation

        payload = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 - written by our own worker
        translation.activate(payload.get("language") or "en")
        try:
            answer = _simulate(payload)
        except MemoryError:
            raise
        except Exception as exc:  # the parent records it as the run's failure
            answer = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        try:
            text = json.dumps(answer, default=str, allow_nan=False)  # what PostgreSQL's jsonb takes
        except ValueError as exc:
            text = json.dumps({"error": f"the report cannot be written as JSON: {exc}"})
        answer_to.write(text)
        answer_to.flush()
    except MemoryError:
        os._exit(MEMORY_EXIT)  # nothing more is allocated, not even a traceback
    return 0


if __name__ == "__main__":
    sys.exit(main())
