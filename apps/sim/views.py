"""The simulator in the console: a scenario's report with charts, and what-if questions asked from
the cluster page of the live fleet (nothing of it is changed)."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.conf import settings
from django.http import HttpResponse
from django.shortcuts import render
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.accounts.access import requires
from apps.sim.service import ScenarioError, simulate_text, what_if
from llmgw.http import HtmxHttpRequest

EXAMPLE = """\
step: 1m
duration: 2h
node_types:
  h100:
    gpus: {class: H100-80GB, count: 8}
    cpus: 224
    memory: 2TiB
nodes:
  - type: h100
    count: 16
    rack: {size: 4, pdus: 2}
    fabric: {name: ib-a, per_leaf: 8}
models:
  - name: chat
    min: 4
    max: 8
    class: critical
    profiles: [{accelerator: H100-80GB, gpus: 4}]
events:
  - at: 30m
    lose: {rack: r01}
report:
  model: chat
"""


class ScenarioForm(forms.Form):
    scenario = forms.CharField(
        label=gettext_lazy("Scenario (YAML)"), widget=forms.Textarea(attrs={"rows": 22, "class": "field font-mono"})
    )


def _charts(report: dict[str, Any]) -> dict[str, Any]:
    from apps.cluster.charts import line_chart

    steps = report["steps"]
    seconds = report["scenario"]["step_seconds"]

    def series(key: str) -> list[tuple[float, float | None]]:
        return [(s["at"] * 60, float(s[key])) for s in steps]

    gap = seconds * 2 if seconds else None
    return {
        "ready": line_chart(series("ready"), label=_("Replicas ready"), gap_seconds=gap, reference=series("pending")),
        "free": line_chart(series("gpus_free"), label=_("GPUs free"), gap_seconds=gap),
    }


def _show(request: HtmxHttpRequest, form: ScenarioForm, report: dict[str, Any] | None, **context: Any) -> HttpResponse:
    if report is not None:
        context["charts"] = _charts(report)
        context["report_json"] = json.dumps(report, default=str)
        context["end"] = report["snapshots"][-1]
    return render(request, "sim/sim.html", {"form": form, "report": report, **context})


@requires("read_everything", methods=["GET", "POST"])
def sim(request: HtmxHttpRequest) -> HttpResponse:
    """Paste a scenario, see what the scheduler would do with it."""
    if request.method != "POST":
        return _show(request, ScenarioForm(initial={"scenario": EXAMPLE}), None)
    form = ScenarioForm(request.POST)
    if not form.is_valid():
        return _show(request, form, None)
    try:
        report = simulate_text(form.cleaned_data["scenario"], max_steps=settings.SIM_MAX_WEB_STEPS)
    except ScenarioError as exc:
        return _show(request, form, None, problems=exc.problems)
    return _show(request, form, report)


@requires("read_everything", methods=["GET"])
def sim_what_if(request: HtmxHttpRequest) -> HttpResponse:
    """?node=NAME, ?rack=NAME, ?pdu=NAME, or ?model=NAME&min=N: the live fleet with that change."""
    form = ScenarioForm(initial={"scenario": EXAMPLE})
    question: tuple[str, str] | None = None
    for kind in ("node", "rack", "pdu", "model"):
        if request.GET.get(kind):
            question = (kind, request.GET[kind][:200])
            break
    if question is None:
        return _show(request, form, None, problems=[_("Ask about a node, a rack, a PDU or a model.")])
    minimum = None
    if question[0] == "model":
        try:
            minimum = int(request.GET.get("min", ""))
        except ValueError:
            return _show(request, form, None, problems=[_("Give the model's new minimum as a whole number.")])
        if minimum < 0:
            return _show(request, form, None, problems=[_("Give the model's new minimum as a whole number.")])
    try:
        report = what_if(question[0], question[1], minimum)
    except ScenarioError as exc:
        return _show(request, form, None, problems=exc.problems)
    labels = {
        "node": _("What if node %(name)s went away"),
        "rack": _("What if rack %(name)s went away"),
        "pdu": _("What if PDU %(name)s went away"),
        "model": _("What if the minimum of %(name)s were %(min)s"),
    }
    title = labels[question[0]] % {"name": question[1], "min": minimum}
    return _show(request, form, report, title=title)
