"""A simulation's report as text, for `llmgw sim` (the JSON report is the same figures whole)."""

from __future__ import annotations

from typing import Any

from django.utils.translation import gettext as _

__all__ = ["as_text"]


def _figure(value: Any) -> str:
    return "-" if value is None else str(value)


def as_text(report: dict[str, Any]) -> str:
    fleet = report["scenario"]
    lines = [
        _("%(nodes)s nodes, %(gpus)s GPUs, %(models)s models; %(steps)s steps of %(step)s s, %(events)s events")
        % {
            "nodes": fleet["nodes"],
            "gpus": fleet["gpus"],
            "models": fleet["models"],
            "steps": fleet["steps"] + 1,
            "step": int(fleet["step_seconds"]),
            "events": fleet["events"],
        },
        "",
    ]
    header = [_("minute"), _("what"), _("ready"), _("pending"), _("failed"), _("stranded"), _("more fit")]
    rows = []
    for snap in report["snapshots"]:
        room = snap.get("headroom")
        more = "-" if not room else f"{'≥' if room['at_least'] else ''}{room['more_replicas']}"
        rows.append(
            [
                f"{snap['at']:g}",
                snap["label"],
                str(snap["replicas"]["ready"]),
                str(snap["replicas"]["pending"]),
                str(snap["replicas"]["failed"]),
                str(snap["gpus_stranded"]),
                more,
            ]
        )
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    end = report["snapshots"][-1]
    if end["pending"]:
        lines += ["", _("Pending at the end:")]
        for row in end["pending"]:
            reasons = "; ".join(f"{r['code']} ({r['nodes']}): {r['example']}" for r in row["reasons"])
            lines.append(f"  {row['replica']} [{row['class']}] {row['message']} {reasons}".rstrip())
        if end["pending_unlisted"]:
            lines.append("  " + _("and %(count)s more") % {"count": end["pending_unlisted"]})
    if end["power"]:
        lines += ["", _("Power at the end (W):")]
        for domain, row in end["power"].items():
            drawn, room = _figure(row["drawn_w"]), _figure(row["headroom_w"])
            headroom = _("headroom")  # outside the f-string, where makemessages finds it
            lines.append(f"  {domain}: {drawn} / {row['cap_w']:g}, {headroom} {room}")
    if report["preemptions"]:
        lines += ["", _("Preempted: %(count)s replicas") % {"count": len(report["preemptions"])}]
    timing = report["timing"]
    lines += [
        "",
        _("Ran in %(seconds)s s: %(step)s ms a step, %(placement)s ms a placement")
        % {
            "seconds": timing["seconds"],
            "step": timing["per_step_ms"],
            "placement": _figure(timing["per_placement_ms"]),
        },
    ]
    return "\n".join(lines)
