"""The REST API against its own OpenAPI schema, with schemathesis, as every staff role and an
ordinary member (each with an API key), and as a stranger with none.

For each operation in /api/v1/schema, schemathesis generates requests from the schema and
sends them straight to the WSGI application, in process. Every answer must be no 5xx, have a
declared status code and content type, and a body of the declared shape. Requests come in three
kinds: valid ones (positive), with generated path parameters (mostly 404s, which must be
declared too) and with those naming the rows built here, so that the shapes of real answers
are checked; invalid ones (negative: wrong types, missing or extra fields in bodies and
queries, and path parameters of the wrong type), on the rows built here and on generated
paths; and path parameters no route or view may take (HOSTILE_PATH_VALUES: unicode digits, a
NUL, ids past 32 and 64 bits), each in each parameter of each operation. A path no URL
pattern matches is answered by the API's own JSON 404 (llmgw.edge), so it is checked as well.

Every operation is walked, DELETE and key revocation included: each example runs in a
savepoint that is rolled back, so every one meets the same rows and none has to be skipped for
being destructive (a key revoking itself, a limit deleted). Runs are derandomized, so a failure
repeats, and small enough for the whole file to stay within a few minutes on two cores.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections, transaction
from django.utils import timezone

from apps.accounts import services as accounts
from apps.accounts.choices import MembershipRole, StaffRole
from apps.accounts.models import AuditEvent, Membership
from apps.catalog import services as catalog
from apps.catalog.models import Model
from apps.cluster import actions, enrolment
from apps.cluster.choices import ReplicaState, ShardState
from apps.cluster.models import AgentRequest, Replica, Shard
from apps.fabrics.models import FabricTest
from apps.guardrails.services import set_policy
from apps.quotas import services as quotas
from apps.quotas.usage import write_records_sync
from tests.budget import FULL
from tests.conftest import make_user
from tests.quotas.conftest import record

# Schemathesis draws its requests with hypothesis: `make properties` runs this at the full counts.
pytestmark = [pytest.mark.django_db, pytest.mark.properties]

# Examples per operation, role and generation mode: requests with generated path parameters, and
# requests naming the rows built here. The suite's run draws fewer than `make properties` does
# (tests/budget.py); every operation is still walked by every role.
GENERATED_EXAMPLES = 4 if FULL else 3
KNOWN_EXAMPLES = 6 if FULL else 4
ROLES = ["admin", "operator", "billing", "viewer", "member", "anonymous"]
# The roles most operations refuse before any of their own code runs (401, 403) are asked a third
# as often: what the handlers do with odd input is walked by the roles they serve. An operator is
# served by most of the handlers an administrator is, so is asked half as often (the two took 47 s
# of the PostgreSQL run's 11 minutes between them).
FEWER = {"operator": 2, "billing": 3, "viewer": 3, "member": 3, "anonymous": 3}
# Path parameters no route or view may take: a NUL, unicode digits (str.isdigit() passes them,
# int() refuses them), an id past 32 bits, the first number past a bigint, one far past it, and
# numbers no id is. The roles asked less often are asked every third (a NUL, "²" and "-1").
HOSTILE_PATH_VALUES = ["\x00", "³", "99999999999999999999999", "²", str(2**40), str(2**63), "-1", "0"]


@dataclass
class World:
    """The rows every example meets, and an API key for each role."""

    keys: dict[str, str]
    key_ids: dict[str, int]
    # path parameter -> collection -> the value naming a row of it
    path_values: dict[str, dict[str, Any]] = field(default_factory=dict)


def build_world() -> World:
    admin = make_user("admin@example.com", role=StaffRole.ADMIN, name="Ada")
    staff = {
        role: make_user(f"{role}@example.com", role=role)
        for role in (StaffRole.OPERATOR, StaffRole.BILLING, StaffRole.VIEWER)
    }
    member = make_user("member@example.com", name="Mel")

    org = accounts.create_organization(name="Acme", actor=admin)
    team = accounts.create_team(org, name="Vision", actor=admin)
    project = accounts.create_project(team, name="Search", actor=admin)
    Membership.objects.create(user=member, organization=org, team=team, project=project, role=MembershipRole.MEMBER)

    made = {"admin": accounts.create_api_key(admin, name="admin", actor=admin)}
    for role, user in staff.items():
        made[str(role)] = accounts.create_api_key(user, name=str(role), actor=user)
    made["member"] = accounts.create_api_key(member, name="ci", project=project, allowed_models=["qwen"], actor=member)
    member_key = made["member"].key

    enrollment = enrolment.create_enrollment("gpu1", labels={"rack": "r1"}, actor=admin)
    node, _credential = enrolment.enroll_node(enrollment.secret)
    hardware = {
        "cpus": 32,
        "memory_total_bytes": 256 * 1024**3,
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i}",
                "name": "NVIDIA H100 80GB HBM3",
                "gpu_class": "H100-80GB",
                "memory_total_mib": 81559,
            }
            for i in range(2)
        ],
    }
    enrolment.register_node(
        node.pk,
        {
            "agent_version": "0.1.0",
            "hardware": hardware,
            "sample": {
                "cpus": 32,
                "cpu_utilization_pct": 12.5,
                "memory_total_bytes": 256 * 1024**3,
                "memory_used_bytes": 10 * 1024**3,
                "gpus": [{"index": 0}, {"index": 1, "memory_used_mib": 1000}],
            },
        },
    )
    actions.cordon_node(node, reason="fan noise", actor=admin)

    catalog.apply_models(
        {
            "models": [
                {
                    "name": "qwen",
                    "source": "/models/qwen.gguf",
                    "replicas": {"min": 1, "max": 2},
                    "owner": {"organization": org.slug, "team": team.slug},
                    "profiles": [
                        {"name": "cpu", "memory": "8GB", "cpu_cores": 4},
                        {"name": "h100", "accelerator": "cuda", "gpus_per_shard": 1, "memory": "20GB", "priority": 10},
                    ],
                },
                {"name": "gpt-x", "replicas": 0, "external": {"url": "https://api.example.com/v1", "model": "gpt-x"}},
            ]
        },
        actor=admin,
    )
    model = Model.objects.get(name="qwen")
    profile = model.profiles.get(name="cpu")
    replica = Replica.objects.create(
        model=model, profile=profile, state=ReplicaState.READY, ready_at=timezone.now(), placed_at=timezone.now()
    )
    Shard.objects.create(
        replica=replica,
        rank=0,
        node=node,
        port=20001,
        secret="s",
        memory_bytes=8 * 1024**3,
        cpu_cores=4,
        state=ShardState.READY,
    )
    Replica.objects.create(
        model=model,
        profile=None,
        state=ReplicaState.PENDING,
        message="no node fits",
        rejections=[{"profile": "cpu", "node": "gpu1", "code": "cordoned"}],
    )

    limit = quotas.create_rate_limit(actor=admin, organization=org, requests_per_minute=600)
    quota = quotas.create_capacity_quota(actor=admin, team=team, gpus=8)
    records = [
        record(member_key),
        record(member_key, status=429, total_ms=None, first_token_ms=None),
        record(None, model="gpt-x", prompt_tokens=None, completion_tokens=None),
    ]
    write_records_sync(records)

    set_policy({"name": "pii", "rules": [{"name": "cards", "kind": "detector", "detector": "card"}]}, actor=admin)
    fabric_test = FabricTest.objects.create(client=node, server=node, fabric="ib0", state=FabricTest.State.DONE)
    failed = AgentRequest.objects.create(
        node=node, kind="ibnetdiscover", params={"fabric": "ib0"}, state=AgentRequest.State.FAILED, error="no sminfo"
    )

    event = AuditEvent.objects.order_by("pk").first()
    assert event is not None
    from tests.mirror.ggufbytes import held_gguf

    held = held_gguf()
    values = {
        "id": {
            "/api/v1/limits/": limit.pk,
            "/api/v1/quotas/": quota.pk,
            "/api/v1/organizations/": org.pk,
            "/api/v1/teams/": team.pk,
            "/api/v1/projects/": project.pk,
            "/api/v1/replicas/": replica.pk,
            "/api/v1/audit/": event.pk,
            "/api/v1/mirror/": held.pk,
            "/api/v1/fabric-tests/": fabric_test.pk,
            "/api/v1/agent-requests/": failed.pk,
        },
        "name": {
            "/api/v1/nodes/": node.name,
            "/api/v1/models/": model.name,
            "/api/v1/mirror/repos/": "tiny-GGUF",
            "/api/v1/guardrails/": "pii",
        },
        "fabric": {"/api/v1/fabrics/": "ib0"},
        "owner": {"/api/v1/mirror/repos/": "acme"},
        "request_id": {"/api/v1/requests/": records[0]["request_id"]},
    }
    return World(
        keys={role: new.secret for role, new in made.items()},
        key_ids={role: new.key.pk for role, new in made.items()},
        path_values=values,
    )


def known_path_parameters(world: World, role: str, operation: Any) -> dict[str, Any]:
    """The path parameters naming rows of the world for this operation's collection; for keys,
    the caller's own (the only ones anybody sees; a stranger names the administrator's)."""
    found = {}
    for name in re.findall(r"\{(\w+)\}", operation.path):
        if operation.path.startswith("/api/v1/keys/"):
            found[name] = world.key_ids.get(role, world.key_ids["admin"])
            continue
        for prefix, value in world.path_values.get(name, {}).items():
            if operation.path.startswith(prefix):
                found[name] = value
    return found


@pytest.fixture
def world(settings: Any) -> Iterator[World]:
    from tests.mirror.hubserver import HubServer, Repo

    settings.ALLOWED_HOSTS = ["localhost", "testserver"]  # schemathesis calls the app as localhost
    # The mirror's explorer asks a Hub: one of ours, holding one repository.
    hub = HubServer([Repo("acme/tiny-GGUF", {"tiny.gguf": b"GGUF" + bytes(60), "README.md": b"#\n"})])
    hub.__enter__()
    settings.HF_ENDPOINT = hub.url
    # Thousands of 4xx answers would each log a warning; a 500 still logs its traceback.
    requests_log = logging.getLogger("django.request")
    level = requests_log.level
    requests_log.setLevel(logging.ERROR)
    try:
        yield build_world()
    finally:
        requests_log.setLevel(level)
        hub.__exit__()


@pytest.fixture
def app() -> Iterator[Any]:
    """The project's WSGI application (what get_wsgi_application() makes, without setting Django
    up again). As Django's test client does, the connection is kept open between requests:
    closing it would end the test's transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield WSGIHandler()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def operations(schema: Any) -> Iterator[Any]:
    for result in schema.get_all_operations():
        yield result.ok()


@dataclass
class Tally:
    operations: int = 0
    examples: int = 0
    failures: list[str] = field(default_factory=list)
    walked: set[str] = field(default_factory=set)  # the operations at least one example was sent to

    def call(self, case: Any, label: str, *, headers: dict[str, str], checks: list[Callable[..., Any]]) -> None:
        """Send one case in a savepoint rolled back after it; a failure is told (and raised)."""
        self.examples += 1
        self.walked.add(case.operation.label)
        with transaction.atomic():
            try:
                case.call_and_validate(headers=headers, checks=checks)
            except (Exception, BaseExceptionGroup) as exc:
                self.failures.append(f"{label}:\n{exc}")
                raise
            finally:
                transaction.set_rollback(True)


def run_operation(
    operation: Any,
    *,
    mode: Any,
    headers: dict[str, str],
    examples: int,
    path_parameters: dict[str, Any],
    checks: list[Callable[..., Any]],
    tally: Tally,
) -> None:
    from hypothesis import HealthCheck, Phase, given, settings

    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters or None)
    label = f"{operation.label} ({mode.value}, {'known rows' if path_parameters else 'generated'})"
    failed = len(tally.failures)

    @given(case=strategy)
    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def test(case: Any) -> None:
        tally.call(case, label, headers=headers, checks=checks)

    try:
        test()
    except (Exception, BaseExceptionGroup):  # every operation's failure is told, then the test fails
        # Hypothesis replays a failing example while it shrinks it: the last one told is kept.
        told = tally.failures[failed:]
        del tally.failures[failed:]
        tally.failures.append(told[-1] if told else f"{label}: failed")


def run_hostile_paths(
    operation: Any,
    *,
    values: list[str],
    headers: dict[str, str],
    known: dict[str, Any],
    checks: list[Callable[..., Any]],
    tally: Tally,
) -> None:
    """Each of `values` in each path parameter in turn, the others naming rows of the world."""
    names = re.findall(r"\{(\w+)\}", operation.path)
    for name in names:
        for value in values:
            parameters = {other: known.get(other, "x") for other in names} | {name: value}
            label = f"{operation.label} ({name}={value!r})"
            with contextlib.suppress(Exception, BaseExceptionGroup):  # told in tally.failures
                tally.call(operation.Case(path_parameters=parameters), label, headers=headers, checks=checks)


@pytest.mark.parametrize("role", ROLES)
def test_the_api_answers_as_its_schema_says(role: str, world: World, app: Any) -> None:
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_wsgi("/api/v1/schema?format=json", app)
    headers = {"Authorization": f"Bearer {world.keys[role]}"} if role in world.keys else {}
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    tally = Tally()
    labels = set()
    hostile = HOSTILE_PATH_VALUES[:: FEWER.get(role, 1)]
    for operation in operations(schema):
        tally.operations += 1
        labels.add(operation.label)
        known = known_path_parameters(world, role, operation)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if known:
                run_operation(
                    operation,
                    mode=mode,
                    headers=headers,
                    examples=KNOWN_EXAMPLES // FEWER.get(role, 1),
                    path_parameters=known,
                    checks=checks,
                    tally=tally,
                )
            run_operation(
                operation,
                mode=mode,
                headers=headers,
                examples=GENERATED_EXAMPLES // FEWER.get(role, 1),
                path_parameters={},
                checks=checks,
                tally=tally,
            )
        run_hostile_paths(operation, values=hostile, headers=headers, known=known, checks=checks, tally=tally)
    print(f"{role}: {tally.operations} operations, {tally.examples} examples")
    assert not tally.failures, "\n\n".join(tally.failures)
    assert tally.operations >= 45 and tally.examples >= 3 * tally.operations // FEWER.get(role, 1)  # it really ran
    assert sorted(labels - tally.walked) == []  # every operation, DELETE and key revocation included


def test_the_schema_declares_keys_sessions_errors_and_the_shapes_answered(api: Any) -> None:
    schema = api.get("/api/v1/schema?format=json").json()
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "llmgw_...",
        "description": "An API key, as made on the Account page or at /api/v1/keys.",
    }
    assert schema["components"]["securitySchemes"]["cookieAuth"]["in"] == "cookie"
    paths = schema["paths"]
    assert paths["/api/v1/nodes/"]["get"]["security"] == [{"apiKey": []}, {"cookieAuth": []}]
    assert paths["/api/v1/agent/enroll"]["post"]["security"] == [{}]  # the token travels in the body
    assert set(paths["/api/v1/nodes/{name}/cordon/"]["post"]["responses"]) == {"200", "400", "401", "403", "404", "415"}
    assert set(paths["/api/v1/models/{name}/target/"]["post"]["responses"]) >= {"409"}
    assert set(paths["/api/v1/agent/enroll"]["post"]["responses"]) == {"200", "400", "403", "415", "429"}
    resources = paths["/api/v1/models/{name}/resources/"]["post"]
    assert resources["responses"]["200"]["content"]["application/json"]["schema"]["type"] == "array"
    assert not [p for p in resources.get("parameters", []) if p["in"] == "query"]
    group = schema["components"]["schemas"]["UsageRow"]["properties"]["group"]
    assert group["oneOf"] == [{"type": "integer"}, {"type": "string"}] and group["nullable"] is True
    error = schema["components"]["schemas"]["Error"]
    assert error["required"] == ["detail"] and set(error["properties"]) == {"detail", "code", "errors"}
