"""Staff roles: set through one service that keeps Django admin access in step and audits the change."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.test import Client

from apps.accounts import services
from apps.accounts.access import can_change_cluster, is_administrator
from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent, User

pytestmark = pytest.mark.django_db


def flags(user: User) -> tuple[str, bool, bool]:
    user.refresh_from_db()
    return user.staff_role, user.is_staff, user.is_superuser


def test_only_administrators_get_django_admin_access(alice, bob) -> None:
    services.set_staff_role(bob, StaffRole.OPERATOR, actor=alice)
    assert flags(bob) == ("operator", False, False)
    services.set_staff_role(bob, StaffRole.ADMIN, actor=alice, address="192.0.2.1")
    assert flags(bob) == ("admin", True, True)
    event = AuditEvent.objects.filter(action="user.staff_role").latest("id")
    assert (event.actor_label, event.target_label, event.address) == (
        "alice@example.com",
        "bob@example.com",
        "192.0.2.1",
    )
    assert event.changes == {
        "staff_role": ["operator", "admin"],
        "is_staff": [False, True],
        "is_superuser": [False, True],
    }


def test_a_demoted_administrator_loses_the_admin_and_its_powers(alice, bob) -> None:
    services.set_staff_role(bob, StaffRole.ADMIN, actor=alice)
    services.set_staff_role(bob, StaffRole.VIEWER, actor=alice)
    assert flags(bob) == ("viewer", False, False)
    assert not is_administrator(bob)
    assert not can_change_cluster(bob)


def test_setting_the_same_role_writes_nothing(alice, viola) -> None:
    before = AuditEvent.objects.count()
    services.set_staff_role(viola, StaffRole.VIEWER, actor=alice)
    assert AuditEvent.objects.count() == before


def test_the_last_administrator_keeps_the_role(alice) -> None:
    with pytest.raises(ValidationError, match="only administrator"):
        services.set_staff_role(alice, StaffRole.NONE, actor=alice)
    assert flags(alice) == ("admin", True, True)


def test_an_unknown_role_is_refused(alice, bob) -> None:
    with pytest.raises(ValueError):
        services.set_staff_role(bob, "root", actor=alice)


# Through the Django admin -------------------------------------------------------------------------------


def change_form(user: User, **changes: Any) -> dict[str, Any]:
    data = {
        "email": user.email,
        "name": user.name,
        "staff_role": user.staff_role,
        "is_active": "on",
        "date_joined_0": user.date_joined.strftime("%Y-%m-%d"),
        "date_joined_1": user.date_joined.strftime("%H:%M:%S"),
        "last_login_0": "",
        "last_login_1": "",
    }
    data.update(changes)
    return data


def test_a_role_changed_in_the_django_admin_moves_admin_access_with_it(client: Client, alice, bob) -> None:
    client.force_login(alice)
    url = f"/django-admin/accounts/user/{bob.pk}/change/"
    response = client.post(url, change_form(bob, staff_role="admin"))
    assert response.status_code == 302, response.content.decode()[:2000]
    assert flags(bob) == ("admin", True, True)
    response = client.post(url, change_form(bob, staff_role="billing", is_staff="on", is_superuser="on"))
    assert response.status_code == 302
    # The admin's flags follow the role; ticking them by hand does nothing.
    assert flags(bob) == ("billing", False, False)
    actions = list(
        AuditEvent.objects.filter(action="user.staff_role", target_id=str(bob.pk)).values_list("actor_label", flat=True)
    )
    assert actions == ["alice@example.com", "alice@example.com"]


def test_the_django_admin_refuses_to_demote_the_last_administrator(client: Client, alice) -> None:
    client.force_login(alice)
    response = client.post(
        f"/django-admin/accounts/user/{alice.pk}/change/", change_form(alice, staff_role="viewer"), follow=True
    )
    assert b"the only administrator" in response.content
    assert flags(alice) == ("admin", True, True)


def test_the_django_admin_is_for_administrators_only(client: Client, bob, alice) -> None:
    services.set_staff_role(bob, StaffRole.OPERATOR, actor=alice)
    client.force_login(bob)
    response = client.get("/django-admin/")
    assert response.status_code == 302
    assert response["Location"].startswith("/django-admin/login/")
    assert b"/django-admin/" not in client.get("/").content
