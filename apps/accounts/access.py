"""Who may do what. Views, the REST API and the CLI ask these functions, nothing else."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from apps.accounts.choices import StaffRole

__all__ = [
    "CanChangeLimits",
    "IsStaffReader",
    "can_change_cluster",
    "can_change_limits",
    "can_read_everything",
    "is_administrator",
]


def _role(user: Any) -> str:
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return "anonymous"
    if user.is_superuser:
        return StaffRole.ADMIN
    return str(user.staff_role or "")


def is_administrator(user: Any) -> bool:
    return _role(user) == StaffRole.ADMIN


def can_change_cluster(user: Any) -> bool:
    """Nodes, models and placement: administrators and operators."""
    return _role(user) in {StaffRole.ADMIN, StaffRole.OPERATOR}


def can_read_everything(user: Any) -> bool:
    return _role(user) in {StaffRole.ADMIN, StaffRole.OPERATOR, StaffRole.VIEWER, StaffRole.BILLING}


def can_change_limits(user: Any) -> bool:
    """Rate limits and token budgets: administrators and billing."""
    return _role(user) in {StaffRole.ADMIN, StaffRole.BILLING}


class IsStaffReader(BasePermission):
    """Staff may read; only administrators may change."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if request.method in SAFE_METHODS:
            return can_read_everything(request.user)
        return is_administrator(request.user)


class IsOperator(BasePermission):
    """Staff may read; administrators and operators may change."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if request.method in SAFE_METHODS:
            return can_read_everything(request.user)
        return can_change_cluster(request.user)


class CanChangeLimits(BasePermission):
    """Staff may read; administrators and billing may change."""

    def has_permission(self, request: Any, view: Any) -> bool:
        if request.method in SAFE_METHODS:
            return can_read_everything(request.user)
        return can_change_limits(request.user)
