"""Running a scenario from the CLI, the API and the console: read it, start from the live fleet
where it asks to, and run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from django.conf import settings
from django.utils.translation import gettext as _

from apps.sim import run, scenario

__all__ = ["ScenarioError", "needs_cluster", "simulate_text", "what_if"]

ScenarioError = scenario.ScenarioError


def needs_cluster(document: Any) -> bool:
    """Whether the scenario starts from the live fleet or names a live node as a type."""
    if not isinstance(document, dict):
        return False
    types = document.get("node_types")
    likes = isinstance(types, dict) and any(isinstance(t, dict) and "like" in t for t in types.values())
    return bool(document.get("from_cluster")) or likes


def simulate_text(
    source: str | dict[str, Any], *, base: Path | None = None, max_steps: int | None = None
) -> dict[str, Any]:
    """Parse and run; ScenarioError lists what is wrong (nothing runs then)."""
    document: Any = source
    if isinstance(source, str):
        try:
            document = yaml.safe_load(source)
        except yaml.YAMLError as exc:
            raise ScenarioError([_("not valid YAML: %(why)s") % {"why": str(exc).splitlines()[0]}]) from None
    live = run.live_fleet() if needs_cluster(document) else None
    parsed = scenario.parse(
        document if document is not None else {},
        base=base,
        captures=settings.SIM_CAPTURES_DIR,
        live=live["by_name"] if live is not None else None,
    )
    if max_steps is not None and parsed.steps + 1 > max_steps:
        raise ScenarioError(
            [
                _("scenario.duration: %(steps)s steps is more than the %(max)s a run here may take")
                % {"steps": parsed.steps + 1, "max": max_steps}
            ]
        )
    return run.simulate(parsed, live)


def what_if(kind: str, name: str, minimum: int | None = None) -> dict[str, Any]:
    """The live fleet with one change at once and half an hour after: a node, rack or PDU lost,
    or a model's minimum changed. Nothing of the real fleet is changed."""
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
    return simulate_text(document)
