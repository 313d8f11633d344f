"""Policies set outside the admin: the API, `llmgw ctl guardrails` and the Guardrails page's form,
each audited; and what every policy did, counted on the usage page and in the usage API."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from django.test import Client

from apps.accounts import services as accounts
from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent
from apps.gateway.tables import load_tables
from apps.guardrails import services
from apps.guardrails.models import Policy
from apps.quotas.usage import write_records_sync
from tests.builders import make_model
from tests.conftest import make_user
from tests.quotas.conftest import make_key, record

pytestmark = pytest.mark.django_db

FALCON = "Project Falcon"
PII = {
    "name": "pii",
    "description": "Personal data stays in",
    "organization": "acme",
    "rules": [
        {"name": "cards", "kind": "detector", "detector": "card", "action": "refuse"},
        {"name": "codename", "kind": "terms", "terms": [FALCON], "action": "redact"},
        {"name": "guard", "kind": "guard_model", "models": ["llama-guard"], "applies_to": "both", "limit": 800},
    ],
}


def _acme() -> Any:
    return accounts.create_organization(name="Acme", actor=None)


def test_a_policy_is_set_whole_replaced_and_deleted_with_each_change_audited() -> None:
    org = _acme()
    admin = make_user("ada@example.com", role=StaffRole.ADMIN)
    policy = services.set_policy(PII, actor=admin, address="10.0.0.5")
    assert policy.organization == org
    assert [(r.order, r.name, r.kind) for r in policy.rules.all()] == [
        (0, "cards", "detector"),
        (1, "codename", "terms"),
        (2, "guard", "guard_model"),
    ]
    assert services.policy_dict(policy) == {
        "name": "pii",
        "description": "Personal data stays in",
        "enabled": True,
        "organization": "acme",
        "rules": [
            {"name": "cards", "kind": "detector", "action": "refuse", "applies_to": "both", "detector": "card"},
            {
                "name": "codename",
                "kind": "terms",
                "action": "redact",
                "applies_to": "both",
                "terms": ["Project Falcon"],
            },
            {
                "name": "guard",
                "kind": "guard_model",
                "action": "refuse",
                "applies_to": "both",
                "limit": 800,
                "models": ["llama-guard"],
                "fail_open": False,
            },
        ],
    }
    # The gateway's tables carry it, compiled, for a key of the organisation.
    tables = load_tables()
    assert [r.name for r in tables.guards.organizations[org.pk]] == ["cards", "codename", "guard"]
    # Replaced: its rules are the ones given now, in their order.
    services.set_policy({**PII, "rules": PII["rules"][1:2]}, actor=admin)
    assert list(Policy.objects.get(name="pii").rules.values_list("name", flat=True)) == ["codename"]
    services.set_policy({**PII, "rules": PII["rules"][1:2]}, actor=admin)  # the same again: nothing to audit
    services.delete_policy("pii", actor=admin)
    events = list(AuditEvent.objects.filter(target_type="guardrails.policy").order_by("pk"))
    assert [e.action for e in events] == ["policy.create", "policy.update", "policy.delete"]
    assert events[0].actor == admin and events[0].address == "10.0.0.5"
    assert events[0].changes["rules"][0] is None and events[0].changes["rules"][1][0]["name"] == "cards"
    assert events[2].changes["name"] == ["pii", None]  # as the Audit page reads changes: old → new
    assert list(events[1].changes) == ["rules"]  # only what changed
    assert not Policy.objects.exists()


@pytest.mark.parametrize(
    ("change", "where", "says"),
    [
        ({"rulez": []}, "", "unknown field rulez"),
        (
            {"rules": [{"name": "x", "kind": "terms", "terms": ["a"], "acton": "log"}]},
            "rules[0]",
            "unknown field acton",
        ),
        ({"rules": [{"name": "x", "kind": "regex", "pattern": "(?<=a)b"}]}, "rules[0].pattern", "look-behind"),
        ({"rules": [{"name": "x", "kind": "regex", "pattern": None}]}, "rules[0].pattern", ""),
        ({"rules": [{"name": "x", "kind": "detector", "detector": ["card"]}]}, "rules[0].detector", ""),
        ({"rules": [{"name": "x", "kind": "detector", "detector": "dna"}]}, "rules[0].detector", "dna"),
        ({"rules": [{"kind": "terms", "terms": ["a"]}, {"kind": "guard_model", "models": []}]}, "rules[1].models", ""),
        ({"organization": "nowhere"}, "organization", "no organization “nowhere” (give it as SLUG)"),
        ({"organization": None, "team": "acme/x", "model": "m"}, "model", "not 2"),
        ({"name": " "}, "name", "give the policy a name"),
        ({"enabled": "false"}, "enabled", "true or false"),
    ],
)
def test_a_policy_that_cannot_be_set_says_where_and_why_and_changes_nothing(
    change: dict[str, Any], where: str, says: str
) -> None:
    _acme()
    services.set_policy(PII, actor=None)
    before = services.policy_dict(Policy.objects.get(name="pii"))
    with pytest.raises(services.PolicyError) as caught:
        services.set_policy({**PII, **change}, actor=None)
    assert where in caught.value.errors, caught.value.errors
    assert says in " ".join(caught.value.errors[where])
    assert services.policy_dict(Policy.objects.get(name="pii")) == before
    assert AuditEvent.objects.filter(action="policy.update").count() == 0


def test_the_api_lists_sets_replaces_and_deletes_policies_for_administrators_only(api: Any) -> None:
    _acme()
    make_model("m", gpus=1)
    api.force_authenticate(make_user("ada@example.com", role=StaffRole.ADMIN))
    made = api.post("/api/v1/guardrails", PII, format="json")
    assert made.status_code == 201, made.json()
    assert made.json()["rules"][0]["name"] == "cards" and made.json()["counts"] == {}
    again = api.post("/api/v1/guardrails", {**PII, "enabled": False}, format="json")
    assert again.status_code == 200 and again.json()["enabled"] is False
    moved = api.put("/api/v1/guardrails/pii", {"model": "m", "rules": PII["rules"][:1]}, format="json")
    assert moved.status_code == 200 and moved.json()["model"] == "m" and "organization" not in moved.json()
    bad = api.put("/api/v1/guardrails/pii", {"rules": [{"kind": "regex", "pattern": r"(\d)\1"}]}, format="json")
    assert bad.status_code == 400 and "a reference back to a group" in bad.json()["errors"]["rules[0].pattern"][0]
    assert api.put("/api/v1/guardrails/pii", ["not", "a", "policy"], format="json").status_code == 400
    assert api.get("/api/v1/guardrails/pii").json()["model"] == "m"  # the bad one changed nothing
    key = make_key(make_user("alice@example.com"))
    verdict = [{"policy": "pii", "rule": "cards", "kind": "detector", "action": "refuse", "detector": "card"}]
    write_records_sync([record(key, status=400, guardrail=verdict)])
    listed = api.get("/api/v1/guardrails").json()["results"]
    assert [(p["name"], p["counts"]["refuse"]) for p in listed] == [("pii", 1)]
    for role in (StaffRole.VIEWER, StaffRole.OPERATOR):
        api.force_authenticate(make_user(f"{role}@example.com", role=role))
        assert api.get("/api/v1/guardrails").status_code == 200
        refused = api.post("/api/v1/guardrails", {**PII, "name": "other"}, format="json")
        assert refused.status_code == 403
        assert api.delete("/api/v1/guardrails/pii").status_code == 403
    api.force_authenticate(make_user("alice2@example.com"))
    assert api.get("/api/v1/guardrails").status_code == 403
    api.force_authenticate(make_user("ada2@example.com", role=StaffRole.ADMIN))
    assert api.delete("/api/v1/guardrails/pii").status_code == 204
    assert api.delete("/api/v1/guardrails/pii").status_code == 404


def test_an_administrator_sets_a_policy_from_the_guardrails_page(client: Client) -> None:
    _acme()
    client.force_login(make_user("ada@example.com", role=StaffRole.ADMIN))
    page = client.get("/guardrails/").content.decode()
    assert 'data-section="set-policy"' in page and "personal-data" in page  # an example to start from
    text = yaml.safe_dump(PII, sort_keys=False)
    answer = client.post("/guardrails/set", {"policy": text}, follow=True)
    assert "Policy “pii” is set, with 3 rules." in answer.content.decode()
    assert Policy.objects.get(name="pii").rules.count() == 3
    edit = client.get("/guardrails/?edit=pii").content.decode()
    assert "Edit the policy pii" in edit and "Project Falcon" in edit
    broken = text.replace("kind: terms", "kind: terms\n  - :")
    answer = client.post("/guardrails/set", {"policy": broken})
    assert answer.status_code == 400
    body = answer.content.decode()
    assert "This is not YAML (line" in body and "Project Falcon" in body  # what was typed is kept
    answer = client.post("/guardrails/set", {"policy": text.replace("card\n", "cardz\n")})
    assert answer.status_code == 400 and "rules[0].detector" in answer.content.decode()
    answer = client.post("/guardrails/remove", {"name": "pii"}, follow=True)
    assert "Policy “pii” is removed." in answer.content.decode() and not Policy.objects.exists()
    assert [e.action for e in AuditEvent.objects.order_by("pk") if e.action.startswith("policy.")] == [
        "policy.create",
        "policy.delete",
    ]
    client.force_login(make_user("olga@example.com", role=StaffRole.OPERATOR))
    assert 'data-section="set-policy"' not in client.get("/guardrails/").content.decode()
    assert client.post("/guardrails/set", {"policy": text}).status_code == 403


def test_usage_counts_each_policys_refusals_stops_redactions_and_logs(client: Client, api: Any) -> None:
    alice = make_user("alice@example.com")
    bob = make_user("bob@example.com")
    mine, theirs = make_key(alice), make_key(bob)

    def found(policy: str, action: str) -> dict[str, str]:
        return {"policy": policy, "rule": "r", "kind": "terms", "action": action}

    write_records_sync(
        [
            record(mine, status=400, guardrail=[found("pii", "refuse")]),
            record(mine, guardrail=[found("pii", "redact"), found("pii", "redact"), found("secrets", "stop")]),
            record(mine, guardrail=[found("watch", "log")]),
            record(mine),
            record(theirs, status=400, guardrail=[found("pii", "refuse")]),
        ]
    )
    client.force_login(alice)
    page = client.get("/usage/").content.decode()
    assert 'id="guardrail-table"' in page
    assert '<tr data-policy="pii">' in page
    api.force_authenticate(alice)  # her own requests only: bob's refusal is not hers to see
    counts = api.get("/api/v1/usage").json()["guardrails"]
    assert counts == [
        {"policy": "pii", "refuse": 1, "redact": 1, "stop": 0, "log": 0},
        {"policy": "secrets", "refuse": 0, "redact": 0, "stop": 1, "log": 0},
        {"policy": "watch", "refuse": 0, "redact": 0, "stop": 0, "log": 1},
    ]
    api.force_authenticate(make_user("vic@example.com", role=StaffRole.VIEWER))
    assert api.get("/api/v1/usage").json()["guardrails"][0] == {
        "policy": "pii",
        "refuse": 2,
        "redact": 1,
        "stop": 0,
        "log": 0,
    }


@pytest.mark.django_db(transaction=True)
def test_ctl_guardrails_applies_lists_shows_and_deletes(  # type: ignore[no-untyped-def]
    live_server, key_for, capsys, monkeypatch, tmp_path
) -> None:
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    _acme()
    secret = key_for(make_user("ada@example.com", role=StaffRole.ADMIN))

    def ctl(*args: str) -> tuple[int, str]:
        status = main(["ctl", "--server", live_server.url, "--key", secret, *args])
        captured = capsys.readouterr()
        return status, captured.out + captured.err

    second = {"name": "secrets", "rules": [{"kind": "detector", "detector": "api_key", "action": "stop"}]}
    spec = tmp_path / "policies.yaml"
    spec.write_text(yaml.safe_dump([PII, second], sort_keys=False))
    status, out = ctl("guardrails", "apply", str(spec))
    assert status == 0, out
    assert "policy pii: 3 rules, applies to organization acme" in out
    assert "policy secrets: 1 rules, applies to everyone" in out
    status, out = ctl("guardrails")
    lines = out.splitlines()
    assert lines[0].split() == ["POLICY", "APPLIES", "TO", "RULES", "REFUSED", "REDACTED", "STOPPED", "LOGGED"]
    assert lines[1].split()[:4] == ["pii", "organization", "acme", "3"]
    status, out = ctl("guardrails", "show", "pii")
    assert yaml.safe_load(out)["rules"][1]["terms"] == ["Project Falcon"]
    spec.write_text('{"name": "pii", "rules": [{"kind": "regex", "pattern": "a++"}]}')  # JSON is taken too
    status, out = ctl("guardrails", "apply", str(spec))
    assert status != 0 and "rules[0].pattern" in out and "possessive quantifier" in out
    assert ctl("guardrails", "delete", "secrets") == (0, "policy secrets deleted\n")
    assert list(Policy.objects.values_list("name", flat=True)) == ["pii"]
