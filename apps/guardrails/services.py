"""Setting and removing guardrail policies outside the admin: the API, `llmgw ctl guardrails` and
the Guardrails page all come here, and every change is audited (policy.create, policy.update,
policy.delete, as the admin writes them).

A policy is given whole, as data (JSON, or YAML from the CLI and the page):

    name: company
    description: what it is for
    enabled: true
    organization: acme            # or team: acme/search, project: acme/search/crawler, model: NAME;
                                  # none of them: it applies to every request
    rules:                        # applied in this order
      - {name: no cards, kind: detector, detector: card, action: refuse}
      - {name: codename, kind: terms, terms: [Project Falcon], action: refuse}
      - {name: guard, kind: guard_model, models: [llama-guard], applies_to: both, limit: 800}

Setting a policy replaces its rules with those given. A key that is not known is refused by name
(a typo never silently resets a setting), and so is every rule that Rule.clean refuses, with its
place in the list.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from apps.accounts import audit
from apps.guardrails.models import Policy, Rule
from llmgw.errors import ServiceError

__all__ = ["PolicyError", "delete_policy", "policy_dict", "set_policy"]

POLICY_KEYS = {"name", "description", "enabled", "organization", "team", "project", "model", "rules"}
RULE_KEYS = {
    "name",
    "kind",
    "action",
    "applies_to",
    "terms",
    "pattern",
    "detector",
    "limit",
    "models",
    "fail_open",
    "enabled",
}
SCOPES = ("organization", "team", "project", "model")
# A scope named that does not exist: what was given, and the shape it is given in.
NO_SUCH_SCOPE = {
    "organization": gettext_lazy("no organization “%(value)s” (give it as SLUG)"),
    "team": gettext_lazy("no team “%(value)s” (give it as ORG/TEAM)"),
    "project": gettext_lazy("no project “%(value)s” (give it as ORG/TEAM/PROJECT)"),
    "model": gettext_lazy("no model “%(value)s” (give it as NAME)"),
}


class PolicyError(ServiceError, ValueError):
    """A policy that cannot be set: `errors` maps each place ("rules[2].pattern") to what is wrong, in
    the current language (the API's and the page's request's)."""

    code = "policy_invalid"

    def __init__(self, errors: dict[str, list[str]]) -> None:
        self.errors = errors
        first = next(iter(errors.items()))
        super().__init__(
            _("%(field)s: %(message)s") % {"field": first[0], "message": first[1][0]} if first[0] else first[1][0],
            details=errors,
        )


def policy_dict(policy: Policy) -> dict[str, Any]:
    """A policy as it is given to set_policy (and shown by the API, the CLI and the audit log)."""
    out: dict[str, Any] = {"name": policy.name, "description": policy.description, "enabled": policy.enabled}
    if policy.organization_id:
        out["organization"] = policy.organization.slug  # type: ignore[union-attr]
    if policy.team_id:
        team = policy.team
        assert team is not None
        out["team"] = f"{team.organization.slug}/{team.slug}"
    if policy.project_id:
        project = policy.project
        assert project is not None
        out["project"] = f"{project.team.organization.slug}/{project.team.slug}/{project.slug}"
    if policy.model_id:
        out["model"] = policy.model.name  # type: ignore[union-attr]
    out["rules"] = [_rule_dict(rule) for rule in policy.rules.order_by("order", "pk")]
    return out


def _rule_dict(rule: Rule) -> dict[str, Any]:
    out: dict[str, Any] = {"name": rule.name, "kind": rule.kind, "action": rule.action, "applies_to": rule.applies_to}
    if rule.kind == "terms":
        out["terms"] = list(rule.terms or [])
    elif rule.kind == "regex":
        out["pattern"] = rule.pattern
    elif rule.kind == "detector":
        out["detector"] = rule.detector
    if rule.limit is not None:
        out["limit"] = rule.limit
    if rule.kind in ("models", "guard_model"):
        out["models"] = list(rule.model_names or [])
    if rule.kind == "guard_model":
        out["fail_open"] = rule.fail_open
    if not rule.enabled:
        out["enabled"] = False
    return out


def _scope(data: dict[str, Any], errors: dict[str, list[str]]) -> dict[str, Any]:
    """The policy's attachment from its slugs: {"organization": Organization} and the like."""
    from apps.accounts.models import Organization, Project, Team
    from apps.catalog.models import Model

    given = [key for key in SCOPES if data.get(key) not in (None, "")]
    if len(given) > 1:
        errors[given[1]] = [
            _("attach a policy to one of organization, team, project or model, not %(count)s") % {"count": len(given)}
        ]
        return {}
    found: dict[str, Any] = dict.fromkeys(SCOPES)
    if not given:
        return found
    key = given[0]
    value = str(data[key])
    parts = value.split("/")
    row: Any = None
    if key == "organization":
        row = Organization.objects.filter(slug=value).first()
    elif key == "team" and len(parts) == 2:
        row = Team.objects.filter(organization__slug=parts[0], slug=parts[1]).first()
    elif key == "project" and len(parts) == 3:
        row = Project.objects.filter(team__organization__slug=parts[0], team__slug=parts[1], slug=parts[2]).first()
    elif key == "model":
        row = Model.objects.filter(name=value).first()
    if row is None:
        errors[key] = [NO_SUCH_SCOPE[key] % {"value": value}]
    found[key] = row
    return found


def _unknown(unknown: list[str], known: set[str], *, rule: bool) -> str:
    """Keys given that a rule (or a policy) does not have, and the ones it has."""
    values = {"fields": ", ".join(unknown), "known": ", ".join(sorted(known))}
    if rule:
        text = ngettext(
            "unknown field %(fields)s (a rule has %(known)s)",
            "unknown fields %(fields)s (a rule has %(known)s)",
            len(unknown),
        )
    else:
        text = ngettext(
            "unknown field %(fields)s (a policy has %(known)s)",
            "unknown fields %(fields)s (a policy has %(known)s)",
            len(unknown),
        )
    return text % values


def _messages(exc: ValidationError) -> dict[str, list[str]]:
    if hasattr(exc, "error_dict"):
        return {field: [str(m) for e in errs for m in e.messages] for field, errs in exc.error_dict.items()}
    return {"": [str(m) for m in exc.messages]}


def _rules(policy: Policy, given: Any, errors: dict[str, list[str]]) -> list[Rule]:
    if not isinstance(given, list):
        errors["rules"] = [_("a list of rules")]
        return []
    rules: list[Rule] = []
    names: set[str] = set()
    for i, item in enumerate(given):
        where = f"rules[{i}]"
        if not isinstance(item, dict):
            errors[where] = [_("a rule is a mapping of its fields")]
            continue
        unknown = sorted(set(item) - RULE_KEYS)
        if unknown:
            errors[where] = [_unknown(unknown, RULE_KEYS, rule=True)]
            continue
        name = str(item.get("name") or f"rule {i + 1}")
        if name in names:
            errors[f"{where}.name"] = [_("two rules are named “%(name)s”") % {"name": name}]
            continue
        names.add(name)
        fields: dict[str, Any] = {"name": name, "order": i, "kind": item.get("kind", "")}
        for key in ("action", "applies_to", "terms", "pattern", "detector", "limit", "fail_open", "enabled"):
            if key in item:
                fields[key] = item[key]
        if "models" in item:
            fields["model_names"] = item["models"]
        if isinstance(fields.get("terms"), str):
            fields["terms"] = [fields["terms"]]
        rule = Rule(policy=policy, **fields)
        try:
            rule.full_clean(exclude=["policy"], validate_unique=False)
        except ValidationError as exc:
            for field, messages in _messages(exc).items():
                field = "models" if field == "model_names" else field
                errors[f"{where}.{field}" if field else where] = messages
            continue
        rules.append(rule)
    return rules


@transaction.atomic
def set_policy(data: Any, *, actor: Any = None, address: str | None = None) -> Policy:
    """Create the policy named in `data`, or replace it (its fields and all its rules); audited.
    PolicyError says what is wrong, and nothing is changed."""
    if not isinstance(data, dict):
        raise PolicyError({"": [_("a policy is a mapping: name, where it applies, rules")]})
    errors: dict[str, list[str]] = {}
    unknown = sorted(set(data) - POLICY_KEYS)
    if unknown:
        errors[""] = [_unknown(unknown, POLICY_KEYS, rule=False)]
    name = str(data.get("name") or "").strip()
    if not name:
        errors["name"] = [_("give the policy a name")]
    scope = _scope(data, errors)
    if not isinstance(data.get("enabled", True), bool):
        errors["enabled"] = [_("true or false")]
    if errors:
        raise PolicyError(errors)
    policy = Policy.objects.select_for_update().filter(name=name).first()
    before = policy_dict(policy) if policy is not None else None
    if policy is None:
        policy = Policy(name=name)
    policy.description = str(data.get("description") or "")
    policy.enabled = data.get("enabled", True)
    for key, row in scope.items():
        setattr(policy, key, row)
    try:
        policy.full_clean(validate_unique=False)
    except ValidationError as exc:
        raise PolicyError(_messages(exc)) from None
    rules = _rules(policy, data.get("rules", []), errors)
    if errors:
        raise PolicyError(errors)
    policy.save()
    policy.rules.all().delete()
    Rule.objects.bulk_create(rules)  # the policy's save above has the gateway read its tables again
    after = policy_dict(policy)
    if before is None:
        audit.record(actor, "policy.create", policy, changes=audit.diff({}, after), address=address)
    elif before != after:
        audit.record(actor, "policy.update", policy, changes=audit.diff(before, after), address=address)
    return policy


@transaction.atomic
def delete_policy(name: str, *, actor: Any = None, address: str | None = None) -> None:
    policy = Policy.objects.filter(name=name).first()
    if policy is None:
        raise PolicyError({"name": [_("no policy “%(name)s”") % {"name": name}]})
    audit.record(actor, "policy.delete", policy, changes=audit.diff(policy_dict(policy), {}), address=address)
    policy.delete()
