"""Operations endpoints: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import os

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from apps.accounts.access import public
from llmgw import readiness

__all__ = ["healthz", "metrics", "readyz"]


@public
@never_cache
@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@public
@never_cache
@require_GET
def readyz(request: HttpRequest) -> HttpResponse:
    checks = readiness.run_checks()
    ready = all(value == "ok" for value in checks.values())
    return JsonResponse({"ready": ready, **checks, "scheduler": readiness.scheduler()}, status=200 if ready else 503)


@public
@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from llmgw.metrics import database_metrics

    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several web processes: sum what each wrote to the shared directory.
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    else:
        from prometheus_client import REGISTRY

        registry = REGISTRY
    body = generate_latest(registry)
    # Figures read from the database at scrape time are the same whichever process answers.
    body += database_metrics()
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
