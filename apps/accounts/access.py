"""Who may do what. Views, the REST API and the CLI ask these functions, nothing else.

Every console view says who may use it with `@requires(rule, methods=...)` or `@public`, and
every API view lists one of the permission classes below; each names its rules from RULES, so
the whole decision can be listed (tests/accounts/test_access.py walks every URL with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import wraps
from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from apps.accounts.choices import StaffRole

__all__ = [
    "RULES",
    "CanChangeLimits",
    "CanChangeShares",
    "RulePermission",
    "IsOperator",
    "IsSignedIn",
    "IsStaffReader",
    "StaffReadOnly",
    "allows",
    "can_change_cluster",
    "can_change_limits",
    "can_read_everything",
    "is_administrator",
    "is_signed_in",
    "manages_a_branch",
    "manages_branch",
    "public",
    "requires",
]


def _role(user: Any) -> str:
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return "anonymous"
    if user.is_superuser:
        return StaffRole.ADMIN
    return str(user.staff_role or "")


def is_signed_in(user: Any) -> bool:
    """An active account, with or without a staff role."""
    return _role(user) != "anonymous"


def is_administrator(user: Any) -> bool:
    return _role(user) == StaffRole.ADMIN


def can_change_cluster(user: Any) -> bool:
    """Nodes, models and placement: administrators and operators."""
    return _role(user) in {StaffRole.ADMIN, StaffRole.OPERATOR}


def can_read_everything(user: Any) -> bool:
    return _role(user) in {StaffRole.ADMIN, StaffRole.OPERATOR, StaffRole.VIEWER, StaffRole.BILLING}


def can_change_limits(user: Any) -> bool:
    """Rate limits, token budgets and capacity quotas: administrators and billing."""
    return _role(user) in {StaffRole.ADMIN, StaffRole.BILLING}


def manages_a_branch(user: Any) -> bool:
    """A manager of at least one organisation, team or project (staff role or not).

    What they manage is narrowed by the view (apps.accounts.people_selectors.scope_for).
    """
    if not is_signed_in(user):
        return False
    from apps.accounts.choices import MembershipRole
    from apps.accounts.models import Membership

    return Membership.objects.filter(user=user, role=MembershipRole.MANAGER).exists()


def manages_branch(user: Any) -> bool:
    """Members of a branch may be changed by administrators (any branch) and its managers."""
    return is_administrator(user) or manages_a_branch(user)


# Rules: the names views declare ------------------------------------------------------------

RULES: dict[str, Callable[[Any], bool]] = {
    "public": lambda user: True,
    "signed_in": is_signed_in,
    "read_everything": can_read_everything,
    "change_cluster": can_change_cluster,
    "change_limits": can_change_limits,
    "administrator": is_administrator,
    "manages_branch": manages_branch,
    "nobody": lambda user: False,
}


def allows(rule: str, user: Any) -> bool:
    return RULES[rule](user)


ViewFunction = Callable[..., Any]


def requires(rule: str, *, methods: Sequence[str]) -> Callable[[ViewFunction], ViewFunction]:
    """A console view that `rule` must allow, answering only `methods`.

    Strangers are sent to sign in (as with login_required); a signed-in person the rule
    refuses gets 403; a method not listed gets 405. The decision stays on the view as
    `access_rule` and `access_methods`, for tests and for reading.
    """
    if rule not in RULES or rule == "public":
        raise ValueError(f"unknown rule {rule!r}; mark public views with @public")
    allowed = [method.upper() for method in methods]

    def decorator(view: ViewFunction) -> ViewFunction:
        @wraps(view)
        def wrapper(request: Any, *args: Any, **kwargs: Any) -> Any:
            if not RULES[rule](request.user):
                if not is_signed_in(request.user):
                    from django.contrib.auth.views import redirect_to_login

                    return redirect_to_login(request.get_full_path())
                from django.core.exceptions import PermissionDenied

                raise PermissionDenied
            if request.method not in allowed:
                from django.http import HttpResponseNotAllowed

                return HttpResponseNotAllowed(allowed)
            return view(request, *args, **kwargs)

        wrapper.access_rule = rule  # type: ignore[attr-defined]
        wrapper.access_methods = tuple(allowed)  # type: ignore[attr-defined]
        return wrapper

    return decorator


def public[V: ViewFunction](view: V) -> V:
    """A console view anyone may use, signed in or not. The test suite lists each with its reason."""
    view.access_rule = "public"  # type: ignore[attr-defined]
    return view


# The API's permission classes ----------------------------------------------------------------


class RulePermission(BasePermission):
    """Reads (GET, HEAD, OPTIONS) need `read_rule`; every other method needs `write_rule`."""

    read_rule = "nobody"
    write_rule = "nobody"

    def has_permission(self, request: Any, view: Any) -> bool:
        return allows(self.read_rule if request.method in SAFE_METHODS else self.write_rule, request.user)


class IsSignedIn(RulePermission):
    """Anyone signed in; what they see is narrowed to their own by the view."""

    read_rule = write_rule = "signed_in"


class IsStaffReader(RulePermission):
    """Staff may read; only administrators may change."""

    read_rule = "read_everything"
    write_rule = "administrator"


class IsOperator(RulePermission):
    """Staff may read; administrators and operators may change."""

    read_rule = "read_everything"
    write_rule = "change_cluster"


class CanChangeLimits(RulePermission):
    """Staff may read; administrators and billing may change."""

    read_rule = "read_everything"
    write_rule = "change_limits"


class CanChangeShares(RulePermission):
    """Administrators and managers; which weights and bands each may set is the service's
    (apps.accounts.people_services.share_refusal)."""

    read_rule = "manages_branch"
    write_rule = "manages_branch"


class StaffReadOnly(RulePermission):
    """Staff may read; nobody may change (the audit log)."""

    read_rule = "read_everything"
    write_rule = "nobody"
