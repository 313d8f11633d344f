"""The Batches page, /api/v1/batches and the metrics: who sees which batches, cancel, downloads, and
the page redrawing itself while a batch runs."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership, User
from apps.batches import storage
from apps.batches.models import Batch, BatchFile, BatchLine
from tests.batches.harness import Tenant, make_batch, make_tenant
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def tenants(settings: Any, tmp_path: Path) -> tuple[Tenant, Tenant]:
    settings.BATCH_STORAGE_DIR = tmp_path
    return make_tenant("ada"), make_tenant("bert")


def output_file(tenant: Tenant, file_id: str, content: bytes) -> BatchFile:
    sink = storage.Sink(max_bytes=2**20)
    sink.write(content)
    sink.commit(file_id)
    return BatchFile.objects.create(
        id=file_id, organization=tenant.org, project=tenant.project, user=tenant.user, purpose="batch_output",
        filename="out.jsonl", bytes=len(content), line_count=1,
    )  # fmt: skip


def signed_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_person_sees_their_projects_batches_with_progress_and_staff_see_all(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    make_batch(a, "batch_a")
    make_batch(b, "batch_b", status="completed")
    page = signed_in(a.user).get("/batches/").content.decode()
    assert 'data-batch="batch_a"' in page and "batch_b" not in page
    assert 'value="50"' in page and "5 of 10" in page  # 4 succeeded + 1 failed of 10
    assert 'hx-trigger="every 2s"' in page  # it redraws itself while a batch runs
    assert 'href="/batches/"' in page  # in the menu
    colleague = make_user("colleague@example.com")
    Membership.objects.create(user=colleague, organization=a.org, role=MembershipRole.MEMBER)
    assert 'data-batch="batch_a"' in signed_in(colleague).get("/batches/").content.decode()
    viewer = make_user("vera@example.com", role=StaffRole.VIEWER)
    both = signed_in(viewer).get("/batches/").content.decode()
    assert 'data-batch="batch_a"' in both and 'data-batch="batch_b"' in both
    assert 'data-action="cancel"' not in both  # a viewer cannot cancel
    assert Client().get("/batches/").status_code == 302  # strangers sign in first


def test_the_table_alone_is_sent_to_htmx_and_stops_polling_once_every_batch_ended(
    tenants: tuple[Tenant, Tenant],
) -> None:
    a, _b = tenants
    make_batch(a, "batch_done", status="completed")
    part = signed_in(a.user).get("/batches/", headers={"HX-Request": "true"}).content.decode().strip()
    assert part.startswith('<div id="batch-table"') and "<html" not in part
    assert "hx-trigger" not in part.split(">", 1)[0]


def test_cancel_from_the_page(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    make_batch(a, "batch_run")
    assert signed_in(b.user).post("/batches/batch_run/cancel").status_code == 404
    answer = signed_in(a.user).post("/batches/batch_run/cancel", headers={"HX-Request": "true"})
    assert answer.status_code == 200 and 'data-status="cancelling"' in answer.content.decode()
    assert Batch.objects.get(pk="batch_run").status == "cancelling"
    assert AuditEvent.objects.filter(action="batch.cancel", target_id="batch_run", actor=a.user).exists()


def test_downloads_are_for_those_who_see_the_batch(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    make_batch(a, "batch_out", status="completed", output_file=output_file(a, "file-out", b'{"custom_id":"x"}\n'))
    answer = signed_in(a.user).get("/batches/batch_out/output.jsonl")
    assert answer.status_code == 200 and b"".join(answer.streaming_content) == b'{"custom_id":"x"}\n'  # type: ignore[attr-defined]
    assert signed_in(b.user).get("/batches/batch_out/output.jsonl").status_code == 404
    assert signed_in(a.user).get("/batches/batch_out/error.jsonl").status_code == 404  # it has none


def test_the_api_lists_every_organisations_batches_for_staff(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    make_batch(a, "batch_a")
    make_batch(b, "batch_b", status="completed")
    viewer = signed_in(make_user("vera@example.com", role=StaffRole.VIEWER))
    rows = viewer.get("/api/v1/batches").json()["results"]
    assert {r["id"] for r in rows} == {"batch_a", "batch_b"}
    row = next(r for r in rows if r["id"] == "batch_a")
    assert row["organization_name"] == "Org ada" and row["owner"] == "ada@example.com" and row["percent"] == 50
    assert [r["id"] for r in viewer.get("/api/v1/batches?status=completed").json()["results"]] == ["batch_b"]
    assert [r["id"] for r in viewer.get(f"/api/v1/batches?organization={a.org.pk}").json()["results"]] == ["batch_a"]
    assert viewer.get("/api/v1/batches?status=nonsense").status_code == 400
    assert viewer.post("/api/v1/batches/batch_a/cancel").status_code == 403
    assert signed_in(a.user).get("/api/v1/batches").status_code == 403  # members use /v1/batches


def test_an_operator_cancels_through_the_api_and_an_ended_batch_is_refused(tenants: tuple[Tenant, Tenant]) -> None:
    a, _b = tenants
    make_batch(a, "batch_a")
    make_batch(a, "batch_old", status="completed")
    operator = signed_in(make_user("olga@example.com", role=StaffRole.OPERATOR))
    answer = operator.post("/api/v1/batches/batch_a/cancel")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelling"
    refused = operator.post("/api/v1/batches/batch_old/cancel")
    assert refused.status_code == 409 and refused.json()["detail"] == "Cannot cancel a batch that is completed."
    assert operator.get("/api/v1/batches/batch_nothing").status_code == 404


def test_metrics_count_batches_by_status(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    make_batch(a, "batch_a")
    make_batch(b, "batch_b")
    make_batch(b, "batch_c", status="failed")
    from llmgw.metrics import database_metrics

    text = database_metrics().decode()
    assert 'llmgw_batches{status="in_progress"} 2.0' in text and 'llmgw_batches{status="failed"} 1.0' in text
    assert 'llmgw_batches{status="completed"}' not in text  # a status no batch has is absent
    assert "llmgw_batch_lines_held{" not in text  # no line is held: absent, not 0


def test_metrics_count_the_lines_held_whichever_process_holds_them(tenants: tuple[Tenant, Tenant]) -> None:
    a, _b = tenants
    batch = make_batch(a, "batch_a")
    soon, gone = timezone.now() + timedelta(seconds=30), timezone.now() - timedelta(seconds=1)
    for number, (state, until) in enumerate([("running", soon), ("running", soon), ("running", gone), ("done", None)]):
        BatchLine.objects.create(
            batch=batch, number=number, custom_id=f"c{number}", model="m", state=state, lease_until=until,
            lease_owner="worker:1" if until else "",
        )  # fmt: skip
    from llmgw.metrics import database_metrics

    text = database_metrics().decode()
    assert 'llmgw_batch_lines_held{model="m"} 2.0' in text  # the lapsed lease is no longer held


def test_a_batchs_own_page_shows_its_counts_files_problems_and_metadata(tenants: tuple[Tenant, Tenant]) -> None:
    a, b = tenants
    problems = [{"code": "duplicate_custom_id", "message": f"custom_id 'x{n}' again", "line": n} for n in range(502)]
    make_batch(
        a,
        "batch_page",
        errors=problems,
        metadata={"run": "nightly"},
        output_file=output_file(a, "file-o", b"{}\n"),
        lines_without_tokens=5,
    )
    page = signed_in(a.user).get("/batches/batch_page/").content.decode()
    assert 'data-status="in_progress"' in page and 'hx-trigger="every 2s"' in page  # redrawn while it runs
    assert "5 of 10 answered (50%)" in page and 'value="50"' in page
    assert 'data-field="prompt-tokens">-<' in page  # no answer had token counts: unknown, not 0
    assert 'href="/batches/batch_page/output.jsonl"' in page and 'data-file="error"' not in page
    assert "written when the batch ends" in page  # its error file, while it runs
    assert page.count('data-error="duplicate_custom_id"') == 500 and "and 2 more problems" in page
    assert "nightly" in page and 'data-action="cancel"' in page
    assert 'href="/batches/batch_page/"' in signed_in(a.user).get("/batches/").content.decode()
    assert signed_in(b.user).get("/batches/batch_page/").status_code == 404  # another organisation's

    part = signed_in(a.user).get("/batches/batch_page/", headers={"HX-Request": "true"}).content.decode().strip()
    assert part.startswith('<div id="batch-card"') and "<html" not in part
    answer = (
        signed_in(a.user)
        .post("/batches/batch_page/cancel", {"from": "detail"}, headers={"HX-Request": "true"})
        .content.decode()
    )
    assert answer.strip().startswith('<div id="batch-card"') and 'data-status="cancelling"' in answer
    assert 'data-action="cancel"' not in answer  # asked once; it is cancelled once what runs has ended
    assert signed_in(a.user).post("/batches/batch_page/cancel", {"from": "detail"}).url == "/batches/batch_page/"


def test_an_ended_batchs_page_stops_redrawing_and_says_why_a_file_is_missing(tenants: tuple[Tenant, Tenant]) -> None:
    a, _b = tenants
    make_batch(a, "batch_end", status="completed", succeeded=10, failed=0, prompt_tokens=70, completion_tokens=30)
    page = signed_in(a.user).get("/batches/batch_end/").content.decode()
    assert "hx-trigger" not in page.split('id="batch-card"', 1)[1].split(">", 1)[0]
    assert 'data-field="prompt-tokens">70<' in page and 'data-field="completion-tokens">30<' in page
    assert "none: no line ended this way" in page and 'data-action="cancel"' not in page
    refused = signed_in(a.user).post("/batches/batch_end/cancel", {"from": "detail"}, headers={"HX-Request": "true"})
    assert "Cannot cancel: Cannot cancel a batch that is completed." in refused.content.decode()
