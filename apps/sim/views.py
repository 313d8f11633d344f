"""The simulator in the console. Operators and administrators paste a scenario or ask a what-if
question of the live fleet from the cluster page (nothing of it is changed); the run is queued
for the worker and its page polls until the report is there, then draws it with charts. Others
who may read the fleet see the page say who runs simulations."""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.accounts.access import can_change_cluster, requires
from apps.sim import runs
from apps.sim.models import SimRun
from apps.sim.service import WHAT_IF_KINDS, ScenarioError
from llmgw.http import HtmxHttpRequest, is_fragment

__all__ = ["sim", "sim_run", "sim_runs", "sim_what_if"]

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
RECENT = 10  # the person's own runs listed under the form


class ScenarioForm(forms.Form):
    scenario = forms.CharField(
        label=gettext_lazy("Scenario (YAML)"), widget=forms.Textarea(attrs={"rows": 22, "class": "field font-mono"})
    )


def _charts(report: dict[str, Any]) -> dict[str, Any]:
    from llmgw.console.charts import line_chart

    steps = report["steps"]
    seconds = report["scenario"]["step_seconds"]

    def series(key: str) -> list[tuple[float, float | None]]:
        return [(s["at"] * 60, float(s[key])) for s in steps]

    gap = seconds * 2 if seconds else None
    return {
        "ready": line_chart(series("ready"), label=_("Replicas ready"), gap_seconds=gap, reference=series("pending")),
        "free": line_chart(series("gpus_free"), label=_("GPUs free"), gap_seconds=gap),
    }


def _page(request: HtmxHttpRequest, form: ScenarioForm, status: int = 200, **context: Any) -> HttpResponse:
    """The simulator's page: the form and the person's recent runs (for those who may run
    simulations), or who may (for the others)."""
    user = request.user
    may_run = can_change_cluster(user)
    recent = list(SimRun.objects.filter(owner_id=user.pk).defer("report")[:RECENT]) if may_run else []
    context = {"form": form, "may_run": may_run, "recent": recent, **context}
    return render(request, "sim/sim.html", context, status=status)


@requires("read_everything", methods=["GET"])
def sim(request: HtmxHttpRequest) -> HttpResponse:
    """Paste a scenario, see what the scheduler would do with it."""
    return _page(request, ScenarioForm(initial={"scenario": EXAMPLE}))


@requires("change_cluster", methods=["POST"])
def sim_runs(request: HtmxHttpRequest) -> HttpResponse:
    """Queue the pasted scenario for the worker and go to its run; a scenario that cannot run is
    shown again with every problem (and the limits' numbers)."""
    form = ScenarioForm(request.POST)
    if not form.is_valid():
        return _page(request, form, status=400)
    try:
        row = runs.ask(request.user, form.cleaned_data["scenario"])
    except ScenarioError as exc:
        return _page(request, form, status=400, problems=exc.problems)
    except runs.TooManyRuns as exc:
        return _page(request, form, status=429, problems=[str(exc)])
    return redirect("sim-run", pk=row.pk)


@requires("change_cluster", methods=["POST"])
def sim_what_if(request: HtmxHttpRequest) -> HttpResponse:
    """node=NAME, rack=NAME, pdu=NAME, or model=NAME&min=N (as the cluster page's forms post
    them): the live fleet with that change, queued for the worker."""
    form = ScenarioForm(initial={"scenario": EXAMPLE})
    kind = next((k for k in WHAT_IF_KINDS if request.POST.get(k)), None)
    if kind is None:
        return _page(request, form, status=400, problems=[_("Ask about a node, a rack, a PDU or a model.")])
    name = request.POST[kind][:200]
    minimum = None
    if kind == "model":
        text = request.POST.get("min", "").strip()
        if not (text.isascii() and text.isdigit()):
            return _page(request, form, status=400, problems=[_("Give the model's new minimum as a whole number.")])
        minimum = int(text)
    try:
        row = runs.ask_what_if(request.user, kind, name, minimum)
    except ScenarioError as exc:
        return _page(request, form, status=400, problems=exc.problems)
    except runs.TooManyRuns as exc:
        return _page(request, form, status=429, problems=[str(exc)])
    return redirect("sim-run", pk=row.pk)


@requires("change_cluster", methods=["GET"])
def sim_run(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """One of the person's runs: its state, refreshed every second while it waits or runs, then
    its report (or why it failed)."""
    row = runs.run_for(request.user, pk)
    if row is None:
        raise Http404(_("No simulation %(id)s of yours.") % {"id": pk})
    context: dict[str, Any] = {"run": row}
    if row.report is not None:
        context["report"] = row.report
        context["charts"] = _charts(row.report)
        context["report_json"] = json.dumps(row.report, default=str)
        context["end"] = row.report["snapshots"][-1]
    if row.state == SimRun.State.QUEUED:
        context["ahead"] = SimRun.objects.filter(state=SimRun.State.QUEUED, created_at__lt=row.created_at).count()
    template = "sim/run.html#sim-run" if is_fragment(request) else "sim/run.html"
    return render(request, template, context)
