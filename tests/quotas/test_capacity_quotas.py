"""Capacity quotas through the API: billing and administrators change them, every change is audited."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent, Organization, Team
from apps.quotas.models import CapacityQuota
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def acme(db: Any) -> Organization:
    return Organization.objects.create(name="Acme", slug="acme")


def signed_in(role: str) -> APIClient:
    client = APIClient()
    client.force_authenticate(make_user(f"{role or 'member'}@example.com", role=role))
    return client


def test_billing_sets_a_quota_changes_it_and_removes_it(acme) -> None:
    client = signed_in(StaffRole.BILLING)
    created = client.post("/api/v1/quotas", {"organization": acme.pk, "gpus": 8, "replicas": 4}, format="json")
    assert created.status_code == 201, created.json()
    assert created.json()["owner"] == f"org:{acme.pk}"
    pk = created.json()["id"]
    changed = client.patch(f"/api/v1/quotas/{pk}", {"gpus": 16, "organization": 999}, format="json")
    assert changed.status_code == 200
    quota = CapacityQuota.objects.get(pk=pk)
    assert (quota.gpus, quota.replicas, quota.organization_id) == (16, 4, acme.pk)
    assert client.delete(f"/api/v1/quotas/{pk}").status_code == 204
    assert not CapacityQuota.objects.exists()
    actions = list(
        AuditEvent.objects.filter(action__startswith="capacity_quota.").order_by("id").values_list("action", "changes")
    )
    assert actions == [
        ("capacity_quota.create", {"gpus": [None, 8], "replicas": [None, 4], "owner": f"org:{acme.pk}"}),
        ("capacity_quota.update", {"gpus": [8, 16], "owner": f"org:{acme.pk}"}),
        ("capacity_quota.delete", {"gpus": [16, None], "replicas": [4, None], "owner": f"org:{acme.pk}"}),
    ]


def test_a_quota_has_exactly_one_owner(acme) -> None:
    team = Team.objects.create(organization=acme, name="Research", slug="research")
    client = signed_in(StaffRole.ADMIN)
    response = client.post("/api/v1/quotas", {"organization": acme.pk, "team": team.pk, "gpus": 1}, format="json")
    assert response.status_code == 400
    assert "exactly one" in str(response.json())
    assert client.post("/api/v1/quotas", {"gpus": 1}, format="json").status_code == 400
    assert not CapacityQuota.objects.exists()


@pytest.mark.parametrize("role", [StaffRole.OPERATOR, StaffRole.VIEWER, StaffRole.NONE])
def test_only_billing_and_administrators_change_quotas(acme, role: str) -> None:
    quota = CapacityQuota.objects.create(organization=acme, gpus=8)
    client = signed_in(role)
    assert client.post("/api/v1/quotas", {"organization": acme.pk, "gpus": 1}, format="json").status_code == 403
    assert client.patch(f"/api/v1/quotas/{quota.pk}", {"gpus": 1}, format="json").status_code == 403
    assert client.delete(f"/api/v1/quotas/{quota.pk}").status_code == 403
    assert client.get("/api/v1/quotas").status_code == (403 if role == StaffRole.NONE else 200)
    quota.refresh_from_db()
    assert quota.gpus == 8
