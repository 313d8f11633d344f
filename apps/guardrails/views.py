"""The Guardrails page: the policies, where each applies, their rules, and what they did lately."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.accounts.access import requires
from apps.guardrails.selectors import guardrails_page

__all__ = ["guardrails"]


@requires("read_everything", methods=["GET"])
def guardrails(request: HttpRequest) -> HttpResponse:
    return render(request, "guardrails/guardrails.html", {"page": guardrails_page()})
