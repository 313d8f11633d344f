"""The registry through which the accounts app hears of the apps above it (catalogue, quotas,
guardrails): empty, every slot answers "nothing" and the pages leave those parts out; filled by the
installed apps' ready() (once, however often it runs), a branch's removal counts the models it owns
and takes its limits with it, and the People page shows the limits and usage tabs."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.test import Client

from apps.accounts import key_views, people_views, services
from apps.accounts.extensions import EXTENSIONS, Extensions
from apps.accounts.models import Organization, Team
from apps.quotas.models import RateLimit
from tests.builders import make_model


def test_an_empty_registry_answers_nothing_for_every_slot() -> None:
    empty = Extensions()
    branch = Organization(name="Acme")
    context: dict[str, Any] = {}
    assert empty.dependents(branch) == {}
    empty.remove_with(branch, None, None)  # nothing to remove
    empty.fill_tab("limits", None, None, context)  # type: ignore[arg-type]
    assert context == {}
    assert empty.account_page(None) == {}  # type: ignore[arg-type]
    with pytest.raises(ImproperlyConfigured):
        empty.models()


def test_the_installed_apps_fill_it_once_however_often_ready_runs() -> None:
    before = (len(EXTENSIONS.branch_dependents), len(EXTENSIONS.branch_removals), len(EXTENSIONS.branch_tabs))
    for label in ("catalog", "quotas", "guardrails"):
        apps.get_app_config(label).ready()
    after = (len(EXTENSIONS.branch_dependents), len(EXTENSIONS.branch_removals), len(EXTENSIONS.branch_tabs))
    assert after == before
    assert "models" in EXTENSIONS.branch_dependents
    assert {"limits", "usage"} <= EXTENSIONS.branch_tabs.keys()
    assert "policies" in EXTENSIONS.account_panels
    assert EXTENSIONS.live_models is not None


@pytest.mark.django_db
def test_a_branch_is_refused_for_the_models_it_owns_and_removed_with_its_limits(alice: Any) -> None:
    acme = Organization.objects.create(name="Acme", slug="acme")
    vision = Team.objects.create(organization=acme, name="Vision", slug="vision")
    make_model("llama", team=vision)
    assert services.removal_refusal(vision) == "Team Vision cannot be removed: it still has 1 model."
    empty = Team.objects.create(organization=acme, name="Empty", slug="empty")
    RateLimit.objects.create(team=empty, requests_per_minute=60)
    services.remove_team(empty, actor=alice)
    assert not Team.objects.filter(pk=empty.pk).exists() and not RateLimit.objects.filter(team_id=empty.pk).exists()


@pytest.mark.django_db
def test_without_the_apps_above_it_the_accounts_pages_leave_their_parts_out(
    client: Client, alice: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    acme = Organization.objects.create(name="Acme", slug="acme")
    RateLimit.objects.create(organization=acme, requests_per_minute=60)
    client.force_login(alice)
    with_quotas = client.get(f"/people/limits/?branch=org:{acme.pk}").content.decode()
    assert 'name="requests_per_minute"' in with_quotas
    monkeypatch.setattr(people_views, "EXTENSIONS", Extensions())
    monkeypatch.setattr(services, "EXTENSIONS", Extensions())
    page = client.get(f"/people/limits/?branch=org:{acme.pk}")
    assert page.status_code == 200 and 'name="requests_per_minute"' not in page.content.decode()
    assert client.get(f"/people/usage/?branch=org:{acme.pk}").status_code == 200
    assert services.branch_dependents(acme) == {}
    monkeypatch.setattr(key_views, "EXTENSIONS", Extensions(live_models=EXTENSIONS.live_models))
    assert client.get("/account/").status_code == 200
