"""What a single sign-on provider's claims mean here: who the person is, their staff role and memberships.

Pure code (no ORM, no settings), so llmgw/settings.py can check the mapping at start-up and
tests need no database. The mapping comes from LLMGW_OIDC_ROLE_MAP (JSON) or from the YAML
file named by LLMGW_OIDC_MAPPING_FILE:

    roles:                      # group -> staff role; the highest of a person's groups wins
      llm-admins: admin
      llm-ops: operator
    memberships:                # group -> one place in the organisation tree (or a list of them)
      vision-team: {organization: acme, team: vision, role: member}
      detector-leads: {organization: acme, team: vision, project: detector, role: manager}

Organisations, teams and projects are named by slug and must exist; sign-in creates people
and memberships, never parts of the tree.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "MEMBERSHIP_ROLES",
    "STAFF_ROLES",
    "MembershipTarget",
    "RoleMap",
    "SsoIdentity",
    "identity_from_claims",
    "load_role_map",
    "parse_role_map",
]

# Highest first: when several groups give a person a role, the first of these wins. Operators
# change the cluster, billing changes limits, viewers only read.
STAFF_ROLES = ("admin", "operator", "billing", "viewer")
MEMBERSHIP_ROLES = ("manager", "member")

_TARGET_KEYS = {"organization", "team", "project", "role"}


@dataclass(frozen=True, order=True)
class MembershipTarget:
    """One branch of the tree, by slugs: an organisation, a team in it, or a project in that team."""

    organization: str
    team: str = ""
    project: str = ""

    def label(self) -> str:
        return "/".join(part for part in (self.organization, self.team, self.project) if part)


@dataclass(frozen=True)
class RoleMap:
    """Group names to a staff role and to memberships."""

    roles: Mapping[str, str] = field(default_factory=dict)
    memberships: Mapping[str, tuple[tuple[MembershipTarget, str], ...]] = field(default_factory=dict)

    @property
    def manages_roles(self) -> bool:
        return bool(self.roles)

    def staff_role_for(self, groups: Iterable[str]) -> str | None:
        """The highest staff role the groups give; "" for none; None when the map sets no roles at all."""
        if not self.manages_roles:
            return None
        given = {self.roles[group] for group in groups if group in self.roles}
        return next((role for role in STAFF_ROLES if role in given), "")

    def memberships_for(self, groups: Iterable[str]) -> dict[MembershipTarget, str]:
        """Each place the groups give, with the highest role any of them gives there."""
        wanted: dict[MembershipTarget, str] = {}
        for group in sorted(set(groups)):
            for target, role in self.memberships.get(group, ()):
                current = wanted.get(target)
                if current is None or MEMBERSHIP_ROLES.index(role) < MEMBERSHIP_ROLES.index(current):
                    wanted[target] = role
        return wanted


def _fail(source: str, where: str, problem: str) -> ImproperlyConfigured:
    place = f"{source}: {where}: " if where else f"{source}: "
    return ImproperlyConfigured(place + problem)


def _text(value: object, source: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(source, where, f"expected a non-empty text, got {value!r}")
    return value.strip()


def _parse_target(spec: object, source: str, where: str) -> tuple[MembershipTarget, str]:
    if not isinstance(spec, dict):
        raise _fail(source, where, f"expected a mapping with organization, team, project and role, got {spec!r}")
    unknown = sorted(str(key) for key in spec if key not in _TARGET_KEYS)
    if unknown:
        raise _fail(source, where, f"unknown key {unknown[0]!r} (expected organization, team, project, role)")
    if "organization" not in spec:
        raise _fail(source, where, "organization is required")
    organization = _text(spec["organization"], source, f"{where}.organization")
    team = _text(spec["team"], source, f"{where}.team") if spec.get("team") is not None else ""
    project = _text(spec["project"], source, f"{where}.project") if spec.get("project") is not None else ""
    if project and not team:
        raise _fail(source, where, "a project needs its team")
    role = spec.get("role", "member")
    if role not in MEMBERSHIP_ROLES:
        raise _fail(source, f"{where}.role", f"expected one of {', '.join(MEMBERSHIP_ROLES)}, got {role!r}")
    return MembershipTarget(organization, team, project), role


def parse_role_map(data: object, *, source: str) -> RoleMap:
    """Check a decoded mapping and build the RoleMap; ImproperlyConfigured names `source` and the bad entry."""
    if data is None:
        return RoleMap()
    if not isinstance(data, dict):
        raise _fail(source, "", f"expected a mapping with roles and memberships, got {type(data).__name__}")
    unknown = sorted(str(key) for key in data if key not in {"roles", "memberships"})
    if unknown:
        raise _fail(source, "", f"unknown key {unknown[0]!r} (expected roles, memberships)")
    roles_data = data.get("roles") or {}
    memberships_data = data.get("memberships") or {}
    if not isinstance(roles_data, dict):
        raise _fail(source, "roles", "expected a mapping of group name to staff role")
    if not isinstance(memberships_data, dict):
        raise _fail(source, "memberships", "expected a mapping of group name to a membership")
    roles: dict[str, str] = {}
    for group, role in roles_data.items():
        name = _text(group, source, "roles")
        if role not in STAFF_ROLES:
            raise _fail(source, f"roles.{name}", f"expected one of {', '.join(STAFF_ROLES)}, got {role!r}")
        roles[name] = role
    memberships: dict[str, tuple[tuple[MembershipTarget, str], ...]] = {}
    for group, spec in memberships_data.items():
        name = _text(group, source, "memberships")
        specs = spec if isinstance(spec, list) else [spec]
        memberships[name] = tuple(
            _parse_target(item, source, f"memberships.{name}" + (f"[{index}]" if isinstance(spec, list) else ""))
            for index, item in enumerate(specs)
        )
    return RoleMap(roles=roles, memberships=memberships)


def load_role_map(environ: Mapping[str, str] = os.environ) -> RoleMap:
    """The mapping from LLMGW_OIDC_ROLE_MAP (JSON) or LLMGW_OIDC_MAPPING_FILE (YAML); empty when neither is set."""
    inline = (environ.get("LLMGW_OIDC_ROLE_MAP") or "").strip()
    path = (environ.get("LLMGW_OIDC_MAPPING_FILE") or "").strip()
    if inline and path:
        raise ImproperlyConfigured("LLMGW_OIDC_ROLE_MAP and LLMGW_OIDC_MAPPING_FILE are both set: set one of them")
    if inline:
        try:
            data: Any = json.loads(inline)
        except json.JSONDecodeError as exc:
            raise ImproperlyConfigured(f"LLMGW_OIDC_ROLE_MAP: not valid JSON ({exc})") from None
        return parse_role_map(data, source="LLMGW_OIDC_ROLE_MAP")
    if path:
        source = f"LLMGW_OIDC_MAPPING_FILE={path!r}"
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ImproperlyConfigured(f"{source}: cannot read the file ({exc.strerror})") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ImproperlyConfigured(f"{source}: not valid YAML ({exc})") from None
        return parse_role_map(data, source=source)
    return RoleMap()


# Claims ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SsoIdentity:
    """What llmgw uses from the provider's claims."""

    email: str
    name: str
    # None when the provider sent no groups claim at all: then roles and memberships stay as they are.
    groups: frozenset[str] | None
    # None when the provider does not say.
    email_verified: bool | None


def _as_bool(value: object) -> bool | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    # Some providers send the claim as text.
    return str(value).strip().lower() in {"true", "1", "yes"}


def identity_from_claims(claims: Mapping[str, Any], *, groups_claim: str = "groups") -> SsoIdentity:
    email = claims.get("email")
    name = claims.get("name")
    if not isinstance(name, str) or not name.strip():
        parts = [claims.get("given_name"), claims.get("family_name")]
        name = " ".join(part.strip() for part in parts if isinstance(part, str) and part.strip())
    raw_groups = claims.get(groups_claim)
    groups: frozenset[str] | None
    if raw_groups is None:
        groups = None
    elif isinstance(raw_groups, str):
        groups = frozenset({raw_groups})
    elif isinstance(raw_groups, list | tuple):
        groups = frozenset(str(group) for group in raw_groups if isinstance(group, str | int))
    else:
        groups = frozenset()
    return SsoIdentity(
        email=email.strip().lower() if isinstance(email, str) else "",
        name=name.strip()[:200],
        groups=groups,
        email_verified=_as_bool(claims.get("email_verified")),
    )
