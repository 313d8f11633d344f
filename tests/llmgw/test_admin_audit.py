"""Every change made in the Django admin is audited, or refused where a service must make it.

The tests walk every model registered in the admin. For each they open the list and the
change form as an administrator and submit a change to every field the form lets one edit
(a change worked out from the form field, or CHANGES where it cannot be), and look for the
audit event naming the object. A model listed in READ_ONLY must refuse every change; a
model that allows adding, deleting or an action must be in ADDS, DELETES or ACTIONS. So a
model registered later, a field added to a form or a new admin action fails here until
someone decides how its changes are audited.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from html.parser import HTMLParser
from typing import Any

import pytest
from django import forms
from django.contrib import admin
from django.contrib.auth.models import Group
from django.db import models
from django.test import Client, RequestFactory
from django.utils import timezone

from apps.accounts import people_services, services
from apps.accounts.models import AuditEvent, Membership, Organization, Project, Team, User
from apps.batches.models import Batch, BatchFile, BatchLine, LineTally
from apps.catalog.models import Model
from apps.cluster import enrolment
from apps.cluster.choices import ReplicaState
from apps.cluster.models import AgentRequest, ControlLock, EngineChoice, EngineRelease, EnrollmentToken, Node, Replica
from apps.fabrics.models import FabricMap, FabricTest, MasterChange, NodeFabrics
from apps.facility.models import Budget, Hold
from apps.gateway.models import StoredResponse, TableVersion
from apps.guardrails.models import Policy, Rule
from apps.mirror.models import MirrorFile, MirrorVersion
from apps.quotas import services as quotas
from apps.quotas.models import HeldTime, UsageRecord, UsageRollup
from apps.schedule.models import PeriodicRun, SchedulerLease
from apps.sim.models import SimRun
from tests.builders import make_model, make_node, make_replica
from tests.conftest import make_user
from tests.quotas.conftest import make_key, recent_minute, record

pytestmark = pytest.mark.django_db

REGISTERED = sorted(model._meta.label for model in admin.site._registry)


# The objects the admin is tried on ---------------------------------------------------------------------


@dataclass
class World:
    alice: User
    bob: User
    org: Organization
    team: Team
    project: Project
    qwen: Model
    hosted: Model
    node: Node
    replica: Replica
    group: Group


@pytest.fixture
def world(alice: User, bob: User) -> World:
    org = services.create_organization(name="Acme", actor=None)
    team = services.create_team(org, name="Vision", actor=None)
    project = services.create_project(team, name="Search", actor=None)
    people_services.add_member(team, bob, "member", actor=None)
    key = make_key(bob, project)
    quotas.create_capacity_quota(actor=None, team=team, gpus=4)
    quotas.create_rate_limit(actor=None, project=project, requests_per_minute=60)
    node = make_node("gpu1", gpus=2)
    qwen = make_model("qwen", gpus=1)
    hosted = Model.objects.create(
        name="hosted",
        external_url="https://llm.example.org/v1",
        external_model="gpt-4o",
        min_replicas=0,
        max_replicas=1,
    )
    replica = make_replica(qwen, node, gpu_indices=(0,))
    enrolment.create_enrollment("gpu2", actor=alice)
    ControlLock.objects.get_or_create(name="reconciler")
    TableVersion.objects.get_or_create(pk=1, defaults={"version": 1})
    UsageRecord.objects.create(**record(key))
    UsageRollup.objects.create(period="minute", bucket_start=recent_minute(), model="qwen", requests=1)
    HeldTime.objects.create(bucket_start=recent_minute(), model="qwen", gpu_class="H100-80GB", gpu_seconds=60)
    return World(
        alice=alice,
        bob=bob,
        org=org,
        team=team,
        project=project,
        qwen=qwen,
        hosted=hosted,
        node=node,
        replica=replica,
        group=Group.objects.create(name="auditors"),
    )


# One object of every registered model, for its change form.
OBJECTS: dict[str, Callable[[World], models.Model]] = {
    "auth.Group": lambda w: w.group,
    "accounts.User": lambda w: w.bob,
    "accounts.Organization": lambda w: w.org,
    "accounts.Team": lambda w: w.team,
    "accounts.Project": lambda w: w.project,
    "accounts.Membership": lambda w: Membership.objects.get(user=w.bob),
    "accounts.ApiKey": lambda w: w.bob.api_keys.get(),
    "accounts.AuditEvent": lambda w: AuditEvent.objects.latest("pk"),
    "quotas.CapacityQuota": lambda w: w.team.capacity_quota,
    "quotas.RateLimit": lambda w: w.project.rate_limit,
    "quotas.UsageRecord": lambda w: UsageRecord.objects.get(),
    "quotas.UsageRollup": lambda w: UsageRollup.objects.get(),
    "quotas.HeldTime": lambda w: HeldTime.objects.get(),
    # The external one: its provider fields can change, and it has no profiles to disagree.
    "catalog.Model": lambda w: w.hosted,
    "catalog.Profile": lambda w: w.qwen.profiles.get(),
    "cluster.Node": lambda w: w.node,
    "cluster.Gpu": lambda w: w.node.gpus.first(),  # type: ignore[return-value]
    "cluster.EnrollmentToken": lambda w: EnrollmentToken.objects.get(),
    "cluster.Replica": lambda w: w.replica,
    "cluster.Shard": lambda w: w.replica.shards.get(),
    "cluster.ControlLock": lambda w: ControlLock.objects.get(),
    "cluster.EngineChoice": lambda w: EngineChoice.objects.get_or_create(
        engine="llama.cpp", scope="all", match="", defaults={"version": "b1"}
    )[0],
    "cluster.EngineRelease": lambda w: EngineRelease.objects.get_or_create(engine="llama.cpp", version="b1")[0],
    "gateway.TableVersion": lambda w: TableVersion.objects.get(),
    "cluster.AgentRequest": lambda w: AgentRequest.objects.get_or_create(node=w.node, kind="ibnetdiscover")[0],
    "fabrics.NodeFabrics": lambda w: NodeFabrics.objects.get_or_create(node=w.node)[0],
    "fabrics.MasterChange": lambda w: MasterChange.objects.get_or_create(
        node=w.node, port="mlx5_0/1", previous="0x01", master="0x02"
    )[0],
    "fabrics.FabricMap": lambda w: FabricMap.objects.get_or_create(fabric="ib:0x01", node=w.node)[0],
    "fabrics.FabricTest": lambda w: FabricTest.objects.get_or_create(client=w.node, server=w.node, fabric="ib:0x01")[0],
    "facility.Hold": lambda w: Hold.objects.get_or_create(level="rack", name="r12")[0],
    "facility.Budget": lambda w: Budget.objects.get_or_create(level="rack", name="r12", defaults={"watts": 15000})[0],
    "guardrails.Policy": lambda w: Policy.objects.get_or_create(name="pii")[0],
    "guardrails.Rule": lambda w: Rule.objects.get_or_create(
        policy=[Policy.objects.get_or_create(name=name)[0] for name in ("pii", "other")][0],  # another to move it to
        name="cards",
        defaults={"kind": "detector", "detector": "card"},
    )[0],
    "mirror.MirrorVersion": lambda w: MirrorVersion.objects.get_or_create(
        repo="acme/m", commit="a" * 40, name="m.gguf", defaults={"kind": "gguf"}
    )[0],
    "mirror.MirrorFile": lambda w: MirrorFile.objects.get_or_create(
        version=MirrorVersion.objects.get_or_create(
            repo="acme/m", commit="a" * 40, name="m.gguf", defaults={"kind": "gguf"}
        )[0],
        path="m.gguf",
        defaults={"size": 4, "sha256": "b" * 64},
    )[0],
    "schedule.SchedulerLease": lambda w: SchedulerLease.objects.get_or_create(
        name="beat",
        defaults={
            "holder": "host:1:abc",
            "acquired_at": timezone.now(),
            "renewed_at": timezone.now(),
            "expires_at": timezone.now(),
        },
    )[0],
    "schedule.PeriodicRun": lambda w: PeriodicRun.objects.get_or_create(
        task="reconcile", defaults={"sent_at": timezone.now(), "sent_by": "host:1:abc"}
    )[0],
    "sim.SimRun": lambda w: SimRun.objects.get_or_create(owner=w.alice, title="what if", defaults={"scenario": "{}"})[
        0
    ],
    "batches.BatchFile": lambda w: _batch_file(w),
    "batches.Batch": lambda w: _batch(w),
    "batches.BatchLine": lambda w: BatchLine.objects.get_or_create(
        batch=_batch(w), number=1, defaults={"custom_id": "a", "body": {"messages": []}}
    )[0],
    "batches.LineTally": lambda w: LineTally.objects.get_or_create(status="succeeded", defaults={"count": 3})[0],
    "gateway.StoredResponse": lambda w: StoredResponse.objects.get_or_create(
        id="resp_admin",
        defaults={
            "organization": w.org,
            "user": w.alice,
            "key_id": 1,
            "model": "qwen",
            "status": "completed",
            "thread": "resp_admin",
            "expires_at": timezone.now() + timedelta(days=30),
        },
    )[0],
}


def _batch_file(w: World) -> BatchFile:
    return BatchFile.objects.get_or_create(
        id="file-admin", defaults={"user": w.alice, "purpose": "batch", "filename": "in.jsonl", "bytes": 10}
    )[0]


def _batch(w: World) -> Batch:
    return Batch.objects.get_or_create(
        id="batch_admin",
        defaults={
            "user": w.alice,
            "organization": w.org,
            "endpoint": "/v1/chat/completions",
            "input_file": _batch_file(w),
            "expires_at": timezone.now() + timedelta(days=1),
        },
    )[0]


# Models whose rows the admin shows but never changes, and why.
READ_ONLY = {
    "accounts.AuditEvent": "the log itself: written by the services, never edited or deleted",
    "quotas.UsageRecord": "usage history, written by the gateway",
    "quotas.UsageRollup": "usage sums, written by the gateway's usage writer",
    "quotas.HeldTime": "GPU and core time held, counted by the held-time accrual",
    "cluster.Gpu": "written by the node's registration and heartbeats",
    "cluster.EnrollmentToken": "made and used up by enrollment; it can only be withdrawn (deleted) here",
    "cluster.Replica": "placed, rolled and removed by the reconciler",
    "cluster.Shard": "reported by the agents for the reconciler's replicas",
    "cluster.ControlLock": "the reconciler's lock row",
    "cluster.EngineChoice": "set by server.yaml, `ctl engine` and the API, which audit it and tell the nodes",
    "cluster.EngineRelease": "a release's asset listing, read by the worker from the releases API",
    "gateway.TableVersion": "bumped by the gateway's signals with every change it must reload for",
    "mirror.MirrorVersion": "added by Fetch, `ctl mirror add` and the API, which check the source and the disk",
    "mirror.MirrorFile": "written by the worker's fetch as it downloads and verifies",
    "schedule.SchedulerLease": "held and renewed by the acting beat; it expires by itself",
    "schedule.PeriodicRun": "moved by the beat that sends each periodic task",
    "sim.SimRun": "asked from the console and the API, run by the worker, swept after a day",
    "batches.BatchFile": "uploaded through /v1/files or written when a batch ends, removed at expiry",
    "batches.Batch": "made through the batch APIs, run by the runners, cancelled from the Batches page or the API",
    "batches.BatchLine": "read from a batch's input file and answered by the runners",
    "batches.LineTally": "counted as the runners write each line's try, shown on /metrics",
    "gateway.StoredResponse": "kept by the gateway for the Responses API until it expires",
    "cluster.AgentRequest": "made by beat and ctl fabric-test, answered by agents",
    "fabrics.NodeFabrics": "written from each agent's fabrics message",
    "fabrics.MasterChange": "kept when a port reports another master subnet manager",
    "fabrics.FabricMap": "parsed from an agent's ibnetdiscover answer",
    "fabrics.FabricTest": "started by ctl fabric-test and run by the worker",
    "facility.Hold": "made and released with ctl facility hold / release or the API, which audit them",
    "facility.Budget": "from server.yaml's facility.budgets, or set with ctl facility budget or the API",
}

# Changes for fields whose value cannot be worked out from the form field alone.
CHANGES: dict[tuple[str, str], Any] = {
    # A reason is kept only while the node is cordoned.
    ("cluster.Node", "cordon_reason"): {"cordoned": ["on"], "cordon_reason": ["disk replaced"]},
}


def _attach(scope: str) -> Callable[[Any], dict[str, list[str]]]:
    """A policy attached elsewhere is attached to one place only: the others are cleared."""

    def change(form: Any) -> dict[str, list[str]]:
        spare = [value for value in form.options[scope] if value and value not in form.data().get(scope, [""])]
        cleared = {other: [""] for other in ("organization", "team", "project", "model") if other != scope}
        return {**cleared, scope: spare[:1]}

    return change


# Only vLLM takes a GPU memory share.
CHANGES[("catalog.Profile", "gpu_memory_utilisation")] = {"engine": ["vllm"], "gpu_memory_utilisation": ["0.8"]}
# A rule of another kind says what it matches.
CHANGES[("guardrails.Rule", "kind")] = {"kind": ["terms"], "terms": ['["hush"]']}
for _scope in ("organization", "team", "project", "model"):
    CHANGES[("guardrails.Policy", _scope)] = _attach(_scope)

# The management form of a policy's rules, left empty.
EMPTY_RULES = {
    "rules-TOTAL_FORMS": "0",
    "rules-INITIAL_FORMS": "0",
    "rules-MIN_NUM_FORMS": "0",
    "rules-MAX_NUM_FORMS": "1000",
}

# A new row for every model the admin may add: the fields to fill in, and the event expected.
ADDS: dict[str, tuple[Callable[[World], dict[str, str]], str]] = {
    "auth.Group": (lambda w: {"name": "operators"}, "group.create"),
    "accounts.User": (
        lambda w: {
            "email": "dora@example.com",
            "password1": "a long new passphrase",
            "password2": "a long new passphrase",
        },
        "user.create",
    ),
    "accounts.Organization": (lambda w: {"name": "Globex", "slug": "globex"}, "organization.create"),
    "accounts.Team": (lambda w: {"organization": str(w.org.pk), "name": "Speech", "slug": "speech"}, "team.create"),
    "accounts.Project": (
        lambda w: {"team": str(w.team.pk), "name": "Dictation", "slug": "dictation"},
        "project.create",
    ),
    "accounts.Membership": (
        lambda w: {
            "user": str(w.alice.pk),
            "organization": str(w.org.pk),
            "team": "",
            "project": "",
            "role": "manager",
        },
        "membership.add",
    ),
    "quotas.CapacityQuota": (lambda w: {"project": str(w.project.pk), "gpus": "2"}, "capacity_quota.create"),
    "quotas.RateLimit": (lambda w: {"team": str(w.team.pk), "requests_per_minute": "30"}, "rate_limit.create"),
    "guardrails.Policy": (lambda w: {"name": "secrets", "enabled": "on", **EMPTY_RULES}, "policy.create"),
    "guardrails.Rule": (
        lambda w: {
            "policy": str(Policy.objects.get_or_create(name="pii")[0].pk),
            "name": "mails",
            "order": "0",
            "kind": "detector",
            "action": "redact",
            "applies_to": "both",
            "terms": "[]",
            "detector": "email",
            "model_names": "[]",
            "enabled": "on",
        },
        "rule.create",
    ),
}

# A row to delete for every model the admin may delete, and the event expected.
DELETES: dict[str, tuple[Callable[[World], models.Model], str]] = {
    "auth.Group": (lambda w: Group.objects.create(name="temporary"), "group.delete"),
    "accounts.User": (lambda w: make_user("dora@example.com"), "user.delete"),
    "accounts.Organization": (lambda w: services.create_organization(name="Globex", actor=None), "organization.remove"),
    "accounts.Team": (lambda w: services.create_team(w.org, name="Speech", actor=None), "team.remove"),
    "accounts.Project": (lambda w: services.create_project(w.team, name="Dictation", actor=None), "project.remove"),
    "accounts.Membership": (
        lambda w: people_services.add_member(w.org, w.alice, "member", actor=None),
        "membership.remove",
    ),
    "accounts.ApiKey": (lambda w: make_key(w.bob, name="old"), "api_key.delete"),
    "quotas.CapacityQuota": (
        lambda w: quotas.create_capacity_quota(actor=None, project=w.project, gpus=1),
        "capacity_quota.delete",
    ),
    "quotas.RateLimit": (
        lambda w: quotas.create_rate_limit(actor=None, team=w.team, requests_per_minute=10),
        "rate_limit.delete",
    ),
    "catalog.Model": (lambda w: make_model("retired", gpus=1), "model.delete"),
    "guardrails.Policy": (lambda w: Policy.objects.create(name="old"), "policy.delete"),
    "guardrails.Rule": (
        lambda w: Rule.objects.create(policy=Policy.objects.get_or_create(name="pii")[0], name="old", kind="detector"),
        "rule.delete",
    ),
    "cluster.Node": (lambda w: make_node("spare"), "node.delete"),
    "cluster.EnrollmentToken": (
        lambda w: enrolment.create_enrollment("gpu3", actor=None).token,
        "node.enrollment_delete",
    ),
}

# Every admin action other than Django's delete_selected: a row to act on, and the event expected.
ACTIONS: dict[tuple[str, str], tuple[Callable[[World], models.Model], str]] = {
    ("accounts.ApiKey", "revoke_keys"): (lambda w: make_key(w.bob, name="leaked"), "api_key.revoke"),
    ("cluster.Node", "revoke_nodes"): (lambda w: make_node("stolen"), "node.revoke"),
}


# Reading and submitting the admin's forms ------------------------------------------------------------------


class FormFields(HTMLParser):
    """What a browser would send from the page's admin form, and the options of each select."""

    def __init__(self, form_id: str) -> None:
        super().__init__(convert_charrefs=True)
        self.form_id = form_id
        self.inside = False
        self.values: list[tuple[str, str]] = []
        self.options: dict[str, list[str]] = {}
        self._select: str | None = None
        self._multiple = self._chosen = False
        self._first: str | None = None
        self._textarea: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "form" and a.get("id") == self.form_id:
            self.inside = True
            return
        name = a.get("name")
        if not self.inside:
            return
        if tag == "input" and name and "disabled" not in a:
            kind = (a.get("type") or "text").lower()
            if kind in ("checkbox", "radio"):
                if "checked" in a:
                    self.values.append((name, a.get("value") or "on"))
            elif kind not in ("submit", "button", "image", "reset", "file"):
                self.values.append((name, a.get("value") or ""))
        elif tag == "select" and name and "disabled" not in a:
            self._select, self._multiple, self._chosen, self._first = name, "multiple" in a, False, None
            self.options[name] = []
        elif tag == "option" and self._select:
            value = a.get("value") or ""
            self.options[self._select].append(value)
            self._first = value if self._first is None else self._first
            if "selected" in a:
                self.values.append((self._select, value))
                self._chosen = True
        elif tag == "textarea" and name and "disabled" not in a:
            self._textarea, self._text = name, []

    def handle_data(self, data: str) -> None:
        if self._textarea:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "form":
            self.inside = False
        elif tag == "select" and self._select:
            if not self._multiple and not self._chosen and self._first is not None:
                self.values.append((self._select, self._first))
            self._select = None
        elif tag == "textarea" and self._textarea:
            text = "".join(self._text)
            self.values.append((self._textarea, text[1:] if text.startswith("\n") else text))
            self._textarea = None

    def data(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for name, value in self.values:
            found.setdefault(name, []).append(value)
        return found


def read_form(client: Client, url: str, model: type[models.Model]) -> FormFields:
    response = client.get(url)
    assert response.status_code == 200, url
    fields = FormFields(f"{model._meta.model_name}_form")
    fields.feed(response.content.decode())
    assert fields.values, f"no form on {url}"
    return fields


def errors(response: Any) -> str:
    page = response.content.decode()
    found = re.findall(r'<ul class="errorlist[^"]*"[^>]*>(.*?)</ul>', page, re.S)
    found += re.findall(r'<p class="errornote">(.*?)</p>', page, re.S)
    return " | ".join(re.sub(r"<[^>]+>", " ", text).strip() for text in found) or page[:1500]


def url(obj: models.Model | type[models.Model], view: str) -> str:
    opts = obj._meta
    if view in ("changelist", "add"):
        return f"/django-admin/{opts.app_label}/{opts.model_name}/{'add/' if view == 'add' else ''}"
    return f"/django-admin/{opts.app_label}/{opts.model_name}/{obj.pk}/{view}/"


def as_admin(user: User) -> Any:
    request = RequestFactory().get("/django-admin/")
    request.user = user
    return request


def editable_fields(model_admin: admin.ModelAdmin, request: Any, obj: models.Model) -> dict[str, forms.Field]:
    if not model_admin.has_change_permission(request, obj):
        return {}
    form = model_admin.get_form(request, obj, change=True)
    return {name: field for name, field in form.base_fields.items() if not field.disabled}


def generated_change(label: str, name: str, field: forms.Field, form: FormFields) -> dict[str, list[str]]:
    """A valid new value for one field, worked out from the kind of form field and its value now."""
    if (label, name) in CHANGES:
        found = CHANGES[(label, name)]
        return found(form) if callable(found) else found  # type: ignore[no-any-return]
    data = form.data()
    current = data.get(name, [""])
    if isinstance(field, forms.SplitDateTimeField):
        day = (timezone.now() + timedelta(days=30)).date().isoformat()
        return {f"{name}_0": [day], f"{name}_1": ["12:00:00"]}
    if isinstance(field, forms.BooleanField):
        return {name: [] if name in data else ["on"]}
    if isinstance(field, forms.ModelMultipleChoiceField):
        spare = [value for value in form.options[name] if value and value not in current]
        return {name: [*data.get(name, []), *spare[:1]]}
    if isinstance(field, forms.ChoiceField):  # model choices and plain choices alike
        spare = [value for value in form.options[name] if value and value not in current]
        assert spare, f"{label}.{name}: no other choice to make"
        return {name: spare[:1]}
    if isinstance(field, forms.JSONField):
        value = json.loads(current[0] or "null")
        value = {**value, "changed": "yes"} if isinstance(value, dict) else [*(value or []), "changed"]
        return {name: [json.dumps(value)]}
    if isinstance(field, forms.FloatField):
        return {name: [str(float(current[0]) + 1) if current[0] else "1"]}
    if isinstance(field, forms.IntegerField):
        return {name: [str(int(current[0]) + 1) if current[0] else "1"]}
    if isinstance(field, forms.EmailField):
        return {name: [f"changed.{current[0]}"]}
    if isinstance(field, forms.URLField):
        return {name: ["https://changed.example.org/v1"]}
    if isinstance(field, forms.SlugField):
        return {name: [f"{current[0]}-changed"]}
    if isinstance(field, forms.CharField):
        return {name: [f"{current[0]} (changed)".strip()]}
    raise AssertionError(f"no change known for {label}.{name} ({type(field).__name__}): add one to CHANGES")


def value_of(obj: models.Model, name: str) -> Any:
    field = obj._meta.get_field(name)
    if field.many_to_many:
        return sorted(getattr(obj, name).values_list("pk", flat=True))
    return getattr(obj, field.attname)  # type: ignore[union-attr]


def last_event_id() -> int:
    return AuditEvent.objects.order_by("-pk").values_list("pk", flat=True).first() or 0


def events_for(obj: models.Model, after: int) -> list[AuditEvent]:
    return list(
        AuditEvent.objects.filter(pk__gt=after, target_type=obj._meta.label_lower, target_id=str(obj.pk)).order_by("pk")
    )


# Coverage: every registered model is decided about ---------------------------------------------------------


def test_every_registered_model_is_covered_or_read_only_with_a_reason(world: World) -> None:
    request = as_admin(world.alice)
    assert REGISTERED, "nothing registered in the admin"
    for label in REGISTERED:
        model = next(m for m in admin.site._registry if m._meta.label == label)
        model_admin = admin.site._registry[model]
        assert label in OBJECTS, f"{label} is registered in the admin: add an object for it to OBJECTS"
        obj = OBJECTS[label](world)
        if label in READ_ONLY:
            assert READ_ONLY[label].strip()
            assert not model_admin.has_change_permission(request, obj), f"{label} is listed read-only but editable"
            assert not model_admin.has_add_permission(request), f"{label} is listed read-only but can be added"
        else:
            assert editable_fields(model_admin, request, obj), f"{label} has nothing to edit: list it in READ_ONLY"
        assert model_admin.has_add_permission(request) == (label in ADDS), (
            f"{label}: adding is {'allowed' if label not in ADDS else 'refused'}; keep ADDS in step"
        )
        assert model_admin.has_delete_permission(request, obj) == (label in DELETES), (
            f"{label}: deleting is {'allowed' if label not in DELETES else 'refused'}; keep DELETES in step"
        )
        actions = set(model_admin.get_actions(request)) - {"delete_selected"}
        assert actions == {name for (owner, name) in ACTIONS if owner == label}, (
            f"{label}: admin actions {sorted(actions)}; each needs an entry in ACTIONS"
        )
    assert set(READ_ONLY) <= set(REGISTERED)
    assert {label for label, _name in CHANGES} <= set(REGISTERED)


# Changes -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", REGISTERED)
def test_each_change_made_in_the_admin_is_audited_or_refused(client: Client, world: World, label: str) -> None:
    client.force_login(world.alice)
    model = next(m for m in admin.site._registry if m._meta.label == label)
    model_admin = admin.site._registry[model]
    obj = OBJECTS[label](world)
    assert client.get(url(model, "changelist")).status_code == 200
    change_url = url(obj, "change")
    if label in READ_ONLY:
        assert client.get(change_url).status_code == 200  # shown...
        before = last_event_id()
        assert client.post(change_url, {}).status_code == 403  # ...never changed
        assert client.get(url(model, "add")).status_code == 403
        assert last_event_id() == before
        return
    fields = editable_fields(model_admin, as_admin(world.alice), obj)
    for name, field in fields.items():
        form = read_form(client, change_url, model)
        change = generated_change(label, name, field, form)
        data = form.data()
        for key, values in change.items():
            if values:
                data[key] = values
            else:
                data.pop(key, None)
        obj.refresh_from_db()
        was = value_of(obj, name)
        mark = last_event_id()
        response = client.post(change_url, data)
        assert response.status_code == 302, f"{label}.{name} = {change}: {errors(response)}"
        obj.refresh_from_db()
        assert value_of(obj, name) != was, f"{label}.{name}: the admin said saved, but it was not"
        events = events_for(obj, mark)
        assert events, f"{label}.{name} changed in the admin without an audit event"
        assert {event.actor_label for event in events} == {world.alice.email}


def test_a_profile_changed_on_its_models_page_is_audited(client: Client, world: World) -> None:
    client.force_login(world.alice)
    profile = world.qwen.profiles.get()
    form = read_form(client, url(world.qwen, "change"), Model)
    data = form.data()
    assert data["profiles-0-parallel"] == ["4"]
    data["profiles-0-parallel"] = ["8"]
    response = client.post(url(world.qwen, "change"), data)
    assert response.status_code == 302, errors(response)
    profile.refresh_from_db()
    assert profile.parallel == 8
    event = AuditEvent.objects.get(action="profile.update")
    assert (event.target_id, event.changes["parallel"], event.actor_label) == (
        str(profile.pk),
        [4, 8],
        world.alice.email,
    )
    assert not events_for(world.qwen, 0)  # the model itself did not change


def test_a_suspension_made_in_the_admin_goes_through_the_service(client: Client, world: World) -> None:
    client.force_login(world.alice)
    form = read_form(client, url(world.bob, "change"), User)
    data = form.data()
    data.pop("is_active")
    assert client.post(url(world.bob, "change"), data).status_code == 302
    event = AuditEvent.objects.get(action="user.suspend")
    assert (event.target_id, event.changes) == (str(world.bob.pk), {"is_active": [True, False]})
    # The only administrator is not suspended, here as anywhere.
    form = read_form(client, url(world.alice, "change"), User)
    data = form.data()
    data.pop("is_active")
    page = client.post(url(world.alice, "change"), data, follow=True)
    assert b"the only active administrator" in page.content
    world.alice.refresh_from_db()
    assert world.alice.is_active


def test_a_password_set_in_the_admin_is_audited_without_its_hash(client: Client, world: World) -> None:
    client.force_login(world.alice)
    response = client.post(
        f"/django-admin/accounts/user/{world.bob.pk}/password/",
        {"password1": "another long passphrase", "password2": "another long passphrase"},
    )
    assert response.status_code == 302, errors(response)
    world.bob.refresh_from_db()
    assert world.bob.check_password("another long passphrase")
    event = AuditEvent.objects.get(action="user.password")
    assert (event.target_id, event.changes, event.actor_label) == (str(world.bob.pk), {}, world.alice.email)


def test_a_name_a_sibling_has_is_refused_on_the_form(client: Client, world: World) -> None:
    client.force_login(world.alice)
    other = services.create_team(world.org, name="Speech", actor=None)
    data = read_form(client, url(other, "change"), Team).data()
    data["name"] = ["vision"]
    response = client.post(url(other, "change"), data)
    assert response.status_code == 200
    assert "already has a team named" in errors(response)
    other.refresh_from_db()
    assert other.name == "Speech"


# Adding ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", sorted(ADDS))
def test_a_row_added_in_the_admin_is_audited(client: Client, world: World, label: str) -> None:
    client.force_login(world.alice)
    model = next(m for m in admin.site._registry if m._meta.label == label)
    values, action = ADDS[label]
    data = read_form(client, url(model, "add"), model).data()
    data.update({name: [value] for name, value in values(world).items()})
    mark = last_event_id()
    response = client.post(url(model, "add"), data)
    assert response.status_code == 302, errors(response)
    event = AuditEvent.objects.get(pk__gt=mark, action=action)
    assert event.target_type == model._meta.label_lower
    assert model._default_manager.filter(pk=event.target_id).exists()
    assert event.actor_label == world.alice.email


# Deleting --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", REGISTERED)
def test_a_delete_in_the_admin_is_audited_or_refused(client: Client, world: World, label: str) -> None:
    client.force_login(world.alice)
    if label not in DELETES:
        obj = OBJECTS[label](world)
        mark = last_event_id()
        assert client.post(url(obj, "delete"), {"post": "yes"}).status_code == 403
        assert type(obj)._default_manager.filter(pk=obj.pk).exists()
        assert last_event_id() == mark
        return
    make, action = DELETES[label]
    obj = make(world)
    assert client.get(url(obj, "delete")).status_code == 200
    mark = last_event_id()
    response = client.post(url(obj, "delete"), {"post": "yes"})
    assert response.status_code == 302, errors(response)
    assert [e.action for e in events_for(obj, mark) if e.action == action] == [action]
    remaining = type(obj)._default_manager.filter(pk=obj.pk)
    if isinstance(obj, Model):  # taken out of service now, removed by the reconciler once its replicas stop
        assert remaining.get().deleted_at is not None
    else:
        assert not remaining.exists()


@pytest.mark.parametrize("label", sorted(DELETES))
def test_a_delete_of_selected_rows_is_audited_row_by_row(client: Client, world: World, label: str) -> None:
    client.force_login(world.alice)
    make, action = DELETES[label]
    obj = make(world)
    mark = last_event_id()
    response = client.post(
        url(type(obj), "changelist"), {"action": "delete_selected", "_selected_action": [str(obj.pk)], "post": "yes"}
    )
    assert response.status_code == 302, errors(response)
    assert [e.action for e in events_for(obj, mark) if e.action == action] == [action]


def test_a_deleted_model_stops_its_replicas(client: Client, world: World) -> None:
    client.force_login(world.alice)
    assert client.post(url(world.qwen, "delete"), {"post": "yes"}).status_code == 302
    world.replica.refresh_from_db()
    assert world.replica.state == ReplicaState.STOPPING
    assert Model.objects.live().filter(pk=world.qwen.pk).count() == 0


def test_a_node_is_revoked_before_it_is_deleted(client: Client, world: World) -> None:
    client.force_login(world.alice)
    node = make_node("spare")
    mark = last_event_id()
    assert client.post(url(node, "delete"), {"post": "yes"}).status_code == 302
    assert [e.action for e in events_for(node, mark)] == ["node.revoke", "node.delete"]


def test_a_branch_something_depends_on_is_not_removed(client: Client, world: World) -> None:
    client.force_login(world.alice)
    mark = last_event_id()
    page = client.post(url(world.team, "delete"), {"post": "yes"})
    assert page.status_code == 200
    assert "cannot be removed" in page.content.decode()
    assert Team.objects.filter(pk=world.team.pk).exists()
    assert last_event_id() == mark


# Actions ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("label,name", sorted(ACTIONS))
def test_each_admin_action_goes_through_its_service(client: Client, world: World, label: str, name: str) -> None:
    client.force_login(world.alice)
    make, action = ACTIONS[(label, name)]
    obj = make(world)
    mark = last_event_id()
    response = client.post(url(type(obj), "changelist"), {"action": name, "_selected_action": [str(obj.pk)]})
    assert response.status_code == 302, errors(response)
    assert [e.action for e in events_for(obj, mark)] == [action]
    assert [e.actor_label for e in events_for(obj, mark)] == [world.alice.email]
