"""The Guardrails page: the policies, where each applies, their rules, and what they did lately; an
administrator sets a policy there as YAML (what the API and `llmgw ctl guardrails apply` take) and
removes one."""

from __future__ import annotations

from typing import Any

import yaml
from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from apps.accounts.access import is_administrator, requires
from apps.guardrails import services
from apps.guardrails.models import Policy
from apps.guardrails.selectors import guardrails_page
from llmgw.http import client_address

__all__ = ["guardrails", "remove_policy", "set_policy"]

EXAMPLE = """name: personal-data
description: No payment cards or national IDs leave the building
# organization: acme   (or team: acme/search, project: acme/search/crawler, model: NAME)
rules:
  - {name: cards, kind: detector, detector: card, action: refuse}
  - {name: national ids, kind: detector, detector: tckn, action: redact}
  - {name: keys out, kind: detector, detector: api_key, action: stop, applies_to: output}
"""


def _page(request: HttpRequest, text: str | None = None, errors: list[str] | None = None, status: int = 200) -> Any:
    editing = request.GET.get("edit", "")
    if text is None:
        policy = Policy.objects.filter(name=editing).first() if editing else None
        text = _yaml(services.policy_dict(policy)) if policy is not None else EXAMPLE
    context = {
        "page": guardrails_page(),
        "can_change": is_administrator(request.user),
        "policy_text": text,
        "errors": errors or [],
        "editing": editing,
    }
    return render(request, "guardrails/guardrails.html", context, status=status)


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, default_flow_style=None, width=100)


@requires("read_everything", methods=["GET"])
def guardrails(request: HttpRequest) -> HttpResponse:
    return _page(request)


@requires("administrator", methods=["POST"])
def set_policy(request: HttpRequest) -> HttpResponse:
    """Set (create or replace) the policy written in the form; what was typed is kept on an error."""
    text = request.POST.get("policy", "")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = _(" (line %(line)s)") % {"line": mark.line + 1} if mark is not None else ""
        return _page(request, text, [_("This is not YAML%(where)s: %(error)s") % {"where": where, "error": exc}], 400)
    try:
        policy = services.set_policy(data, actor=request.user, address=client_address(request))
    except services.PolicyError as exc:
        errors = [
            _("%(field)s: %(message)s") % {"field": where, "message": m} if where else m
            for where, found in exc.errors.items()
            for m in found
        ]
        return _page(request, text, errors, 400)
    count = policy.rules.count()
    messages.success(
        request,
        ngettext(
            "Policy “%(name)s” is set, with %(count)s rule.", "Policy “%(name)s” is set, with %(count)s rules.", count
        )
        % {"name": policy.name, "count": count},
    )
    return HttpResponseRedirect(reverse("guardrails"))


@requires("administrator", methods=["POST"])
def remove_policy(request: HttpRequest) -> HttpResponse:
    name = request.POST.get("name", "")
    try:
        services.delete_policy(name, actor=request.user, address=client_address(request))
    except services.PolicyError:
        messages.error(request, _("There is no policy “%(name)s”.") % {"name": name})
    else:
        messages.success(request, _("Policy “%(name)s” is removed.") % {"name": name})
    return HttpResponseRedirect(reverse("guardrails"))
