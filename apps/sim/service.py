"""Reading a scenario and running it in this process, for `llmgw sim` on the operator's own
machine; the documents of what-if questions. Runs from the console and the API go through
apps.sim.runs instead: the worker runs them in a child process with a memory and a time budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils.translation import gettext as _

from apps.sim import run, scenario
from apps.sim.limits import Limits, load_text

__all__ = [
    "WHAT_IF_KINDS",
    "ScenarioError",
    "needs_cluster",
    "read",
    "simulate_text",
    "what_if_document",
    "what_if_title",
]

ScenarioError = scenario.ScenarioError
WHAT_IF_KINDS = ("node", "rack", "pdu", "model")


def needs_cluster(document: Any) -> bool:
    """Whether the scenario starts from the live fleet or names a live node as a type."""
    if not isinstance(document, dict):
        return False
    types = document.get("node_types")
    likes = isinstance(types, dict) and any(isinstance(t, dict) and "like" in t for t in types.values())
    return bool(document.get("from_cluster")) or likes


def read(source: str | dict[str, Any], limits: Limits) -> Any:
    """The document a scenario's text holds (a mapping is its own document); ScenarioError when
    the text is larger than `limits` take or is not YAML."""
    if not isinstance(source, str):
        return source
    try:
        return load_text(source, limits)
    except ValueError as exc:
        raise ScenarioError([str(exc)]) from None


def simulate_text(
    source: str | dict[str, Any], *, base: Path | None = None, limits: Limits | None = None
) -> dict[str, Any]:
    """Parse and run here, in this process (`llmgw sim`); ScenarioError lists what is wrong
    (nothing runs then). `limits`: by default the CLI's, Limits.cli()."""
    limits = limits or Limits.cli()
    document = read(source, limits)
    live = run.live_fleet() if needs_cluster(document) else None
    parsed = scenario.parse(
        document if document is not None else {},
        base=base,
        captures=settings.SIM_CAPTURES_DIR,
        live=live["by_name"] if live is not None else None,
        limits=limits,
    )
    return run.simulate(parsed, live)


def what_if_document(kind: str, name: str, minimum: int | None = None) -> dict[str, Any]:
    """The scenario of a what-if question: the live fleet with one change at once and half an
    hour after: a node, rack or PDU lost, or a model's minimum changed."""
    event: dict[str, Any]
    if kind == "node":
        event = {"lose": {"nodes": [name]}}
    elif kind in ("rack", "pdu"):
        event = {"lose": {kind: name}}
    elif kind == "model":
        event = {"set": {"model": name, "min": int(minimum or 0)}}
    else:
        raise ScenarioError([_("what-if: no such question %(kind)s (node, rack, pdu or model)") % {"kind": kind}])
    document: dict[str, Any] = {
        "from_cluster": True,
        "step": "1m",
        "duration": "30m",
        "events": [{"at": "1m", **event}],
    }
    if kind == "model":
        document["report"] = {"model": name}
    return document


def what_if_title(kind: str, name: str, minimum: int | None = None) -> str:
    """The question, in words."""
    labels = {
        "node": _("What if node %(name)s went away"),
        "rack": _("What if rack %(name)s went away"),
        "pdu": _("What if PDU %(name)s went away"),
        "model": _("What if the minimum of %(name)s were %(min)s"),
    }
    return labels[kind] % {"name": name, "min": minimum}
