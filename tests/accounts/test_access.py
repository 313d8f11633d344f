"""Who may do what, on every URL: each route declares a rule, and each role is tried against it.

The routes are found from the URL resolver (the API router's routes and actions included), so a
new page or endpoint fails here until it declares who may use it (`@requires`/`@public` from
apps.accounts.access on a console view, a permission class from there on an API view) and is
entered in MATRIX below, with the objects its URL names and the bodies its changes need.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone
from rest_framework.permissions import AllowAny
from rest_framework.views import APIView

from apps.accounts import access, services
from apps.accounts.choices import StaffRole
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User
from apps.catalog.models import Model, Profile
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.models import Node, Replica
from apps.mirror.models import MirrorVersion
from apps.quotas.models import CapacityQuota, RateLimit, UsageRecord
from tests.conftest import make_user
from tests.mirror.ggufbytes import held_gguf
from tests.mirror.hubserver import HubServer, Repo

pytestmark = pytest.mark.django_db

ROLES = ("anonymous", "member", "viewer", "billing", "operator", "administrator")
STAFF = {"viewer", "billing", "operator", "administrator"}

# The role matrix: whom each rule lets in.
WHO: dict[str, set[str]] = {
    "public": set(ROLES),
    "signed_in": set(ROLES) - {"anonymous"},
    "read_everything": STAFF,
    "change_cluster": {"operator", "administrator"},
    "change_limits": {"billing", "administrator"},
    "administrator": {"administrator"},
    # Managers hold no staff role; what they may do is tried in tests/accounts/test_people.py.
    "manages_branch": {"administrator"},
    "nobody": set(),
}

MUTATING = ("POST", "PUT", "PATCH", "DELETE")

# Routes Django protects itself, or that serve files.
SKIPPED_PREFIXES = ("django-admin/", "static/", "media/")

# Open to everyone, each for a reason. Keyed by URL name; OIDC's routes by their prefix.
PUBLIC: dict[str, str] = {
    "healthz": "liveness probe for the orchestrator; says only ok",
    "readyz": "readiness probe for the orchestrator; says which services answer",
    "metrics": "Prometheus scrapes without a session; counts and gauges, no secrets (guard it at the network)",
    "login": "the sign-in form",
    "logout": "ends the caller's own session, if any",
    "signup": "the sign-up form; closed unless LLMGW_SIGNUP_OPEN, and rationed per address",
    "signup-done": "the page after signing up; shows nothing about any account",
    "set-language": "sets the language cookie and redirects",
    "connect-script": "`curl … | sh` has no session; the script holds no secret",
    "api-agent-enroll": "an agent has no account: it trades a one-time token for its credential",
    "install-script": "a new node has no credential yet: the onboarding script holds no secret",
    "install-bundle": "a new node has no credential yet: the agent's code and its sha256, no data",
    "api-engine-file": "an agent has no account: it shows its node credential (or a staff session) for the archive",
    "api-mirror-file": "an agent has no account: it shows its node credential (or a staff session) for the file",
    "api-schema": "describes the API; holds no data",
    "api-docs": "Swagger UI for the schema; holds no data",
    "docs": "the manual's contents; LLMGW_DOCS_REQUIRE_SIGNIN sends strangers to sign in first",
    "docs-page": "a page of the manual, as in the repository; LLMGW_DOCS_REQUIRE_SIGNIN sends strangers to sign in",
    "about": "the project's page: what llmgw is and how to install it; holds no data",
    "favicon": "the console's icon, which browsers ask for before anyone signs in; holds no data",
}
PUBLIC_PREFIXES: dict[str, str] = {
    "oidc/": "single sign-on's redirects and callback run before anyone is signed in",
}

# Personal things every signed-in person manages for themselves, viewers included: they change
# nothing of the installation's. Everything else is refused to a viewer.
# POSTs that only compute, for anyone who may read the fleet (none now: simulations take the
# worker's time and memory, so operators and administrators run them).
COMPUTE_ONLY: set[str] = set()
PERSONAL = {
    "api-keys",
    "account",
    "apikey-list",
    "apikey-detail",
    "apikey-revoke",
    "apikey-share",
    "chat-session-key",
    "chat-render",
    "batches:batch-cancel",  # a batch of one's own keys or projects
}

MODEL_SPEC = {
    "name": "m2",
    "replicas": {"min": 0, "max": 1},
    "source": "/models/m2.gguf",
    "profiles": [{"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "2GB", "cpu_cores": 1}],
}


# The objects URLs name ----------------------------------------------------------------------------


@dataclass
class World:
    users: dict[str, User | None]
    keys: dict[str, ApiKey]
    org: Organization
    team: Team
    project: Project
    node: Node
    model: Model
    replica: Replica
    limit: RateLimit
    quota: CapacityQuota
    record: UsageRecord
    event: AuditEvent
    mirror: MirrorVersion
    hub_url: str

    def key_of(self, role: str) -> ApiKey:
        """The caller's own key (the keys API shows each person only theirs)."""
        return self.keys[role if role != "anonymous" else "member"]


@pytest.fixture
def hub(settings: Any) -> Iterator[HubServer]:
    """A Hub of ours for the mirror's routes (search, a repository, a file to fetch)."""
    with HubServer([Repo("acme/tiny-GGUF", {"tiny-Q4_K_M.gguf": b"GGUF" + bytes(60), "README.md": b"#\n"})]) as server:
        settings.HF_ENDPOINT = server.url
        yield server


@pytest.fixture
def world(db: Any, hub: HubServer) -> World:
    users: dict[str, User | None] = {
        "anonymous": None,
        "member": make_user("member@example.com"),
        "viewer": make_user("viewer@example.com", role=StaffRole.VIEWER),
        "billing": make_user("billing@example.com", role=StaffRole.BILLING),
        "operator": make_user("operator@example.com", role=StaffRole.OPERATOR),
        "administrator": make_user("admin@example.com", role=StaffRole.ADMIN),
    }
    keys = {
        role: services.create_api_key(user, name=f"{role} key", actor=user).key
        for role, user in users.items()
        if user is not None
    }
    org = Organization.objects.create(name="Acme", slug="acme")
    team = Team.objects.create(organization=org, name="Research", slug="research")
    project = Project.objects.create(team=team, name="Search", slug="search")
    node = Node.objects.create(
        name="n1",
        status=NodeStatus.READY,
        registered_at=timezone.now(),
        hardware={"cpus": 32, "memory_total_bytes": 64 * 1024**3},
    )
    model = Model.objects.create(name="m1", min_replicas=0, max_replicas=1, source="/models/m1.gguf")
    profile = Profile.objects.create(
        model=model, name="cpu", engine="llama.cpp", accelerator="cpu", memory_bytes=2 * 1024**3, cpu_cores=1
    )
    replica = Replica.objects.create(model=model, profile=profile, state=ReplicaState.PENDING)
    limit = RateLimit.objects.create(organization=org, requests_per_minute=60)
    quota = CapacityQuota.objects.create(organization=org, gpus=8)
    member = users["member"]
    record = UsageRecord.objects.create(
        request_id="req_x",
        user=member,
        api_key=keys["member"],
        model="m1",
        endpoint="chat",
        status=200,
        prompt_tokens=5,
        completion_tokens=7,
    )
    event = AuditEvent.objects.filter(action="api_key.create").first()
    assert event is not None
    mirror = held_gguf("tiny-Q4_K_M.gguf")
    return World(
        users=users,
        keys=keys,
        org=org,
        team=team,
        project=project,
        node=node,
        model=model,
        replica=replica,
        limit=limit,
        quota=quota,
        record=record,
        event=event,
        mirror=mirror,
        hub_url=hub.url,
    )


# The matrix: every route, its rule, and how to call it ----------------------------------------------

Kwargs = Callable[[World, str], dict[str, Any]]


def no_kwargs(world: World, role: str) -> dict[str, Any]:
    return {}


def node(world: World, role: str) -> dict[str, Any]:
    return {"name": world.node.name}


def held() -> str:
    """A rack held just now, for a release to end."""
    from apps.facility.models import Hold

    return Hold.objects.create(level="rack", name=f"r{uuid.uuid4().hex[:8]}").domain


def a_policy() -> str:
    """A guardrail policy made just now, for a change or removal."""
    from apps.guardrails.models import Policy

    return Policy.objects.create(name=f"p{uuid.uuid4().hex[:8]}").name


def budgeted() -> str:
    """A rack with a power cap just set, for a removal to end."""
    from apps.facility.models import Budget

    return Budget.objects.create(level="rack", name=f"r{uuid.uuid4().hex[:8]}", watts=9000).domain


def mapped_fabric(world: World, role: str) -> dict[str, Any]:
    """A fabric one ready node (whose agent maps fabrics) is on."""
    from apps.fabrics.models import NodeFabrics

    Node.objects.filter(pk=world.node.pk).update(features=["ibnetdiscover.v1"])
    port = {"device": "mlx5_0", "port": 1, "fabric": "ib-a", "link_layer": "InfiniBand", "up": True}
    NodeFabrics.objects.update_or_create(node=world.node, defaults={"ports": [{**port, "sm_guid": "0x01"}]})
    return {"fabric": "ib:0x01"}


def failed_request(world: World, role: str) -> dict[str, Any]:
    from apps.cluster.models import AgentRequest

    mapped_fabric(world, role)
    row = AgentRequest.objects.create(node=world.node, kind="ibnetdiscover", state="failed", error="no cable")
    return {"pk": row.pk}


def two_on_a_fabric(world: World) -> dict[str, dict[str, Any]]:
    """A second node on the first's fabric, both agents able to run perftest: a test of them starts."""
    from apps.fabrics.models import NodeFabrics

    mapped_fabric(world, "")
    other, _ = Node.objects.get_or_create(
        name="n2", defaults={"status": NodeStatus.READY, "registered_at": timezone.now(), "address": "10.0.0.2"}
    )
    features = ["ibnetdiscover.v1", "perftest.v1"]
    Node.objects.filter(pk__in=[world.node.pk, other.pk]).update(features=features, address="10.0.0.2")
    port = {"device": "mlx5_0", "port": 1, "fabric": "ib-a", "link_layer": "InfiniBand", "up": True}
    NodeFabrics.objects.update_or_create(node=other, defaults={"ports": [{**port, "sm_guid": "0x01"}]})
    return {"POST": {"a": world.node.name, "b": "n2"}}


def a_fabric_test(world: World, role: str) -> dict[str, Any]:
    from apps.fabrics.models import FabricTest

    two_on_a_fabric(world)
    test = FabricTest.objects.create(client=world.node, server=Node.objects.get(name="n2"), fabric="ib:0x01")
    return {"pk": test.pk}


def model(world: World, role: str) -> dict[str, Any]:
    return {"name": world.model.name}


def own_key(world: World, role: str) -> dict[str, Any]:
    return {"pk": world.key_of(role).pk}


def own_sim_run(world: World, role: str) -> dict[str, Any]:
    """A simulation of the caller's own (a stranger names the administrator's)."""
    from apps.sim.models import SimRun

    owner = world.users[role] or world.users["administrator"]
    return {"pk": SimRun.objects.create(owner=owner, scenario=SIM_SCENARIO).pk}


def own_batch(world: World, role: str, *, which: str | None = None) -> dict[str, Any]:
    """An in-progress batch of the caller's own (a stranger names the administrator's), with an output
    file when `which` asks for it."""
    from datetime import timedelta

    from apps.batches import storage
    from apps.batches.models import Batch, BatchFile

    owner = world.users[role] or world.users["administrator"]
    assert owner is not None
    batch_id = f"batch_access_{role}"
    output = None
    if which is not None:
        sink = storage.Sink(max_bytes=1024)
        sink.write(b'{"custom_id": "a"}\n')
        sink.commit(f"file-access-{role}")
        output, _ = BatchFile.objects.get_or_create(
            id=f"file-access-{role}",
            defaults={"user": owner, "purpose": "batch_output", "filename": "out.jsonl", "bytes": 19},
        )
    Batch.objects.update_or_create(
        id=batch_id,
        defaults={
            "user": owner,
            "endpoint": "/v1/chat/completions",
            "status": "in_progress",
            "output_file": output,
            "expires_at": timezone.now() + timedelta(hours=24),
        },
    )
    return {"pk": batch_id, **({"which": which} if which else {})}


def own_batch_output(world: World, role: str) -> dict[str, Any]:
    return own_batch(world, role, which="output")


def pk_of(attribute: str) -> Kwargs:
    return lambda world, role: {"pk": getattr(world, attribute).pk}


def member_user(world: World, role: str) -> dict[str, Any]:
    return {"pk": world.users["member"].pk}  # type: ignore[union-attr]


def org_membership(world: World, role: str) -> dict[str, Any]:
    """The member's membership of the organisation, made when first asked for."""
    membership, _ = Membership.objects.get_or_create(user=world.users["member"], organization=world.org, team=None)
    return {"pk": membership.pk}


def engine_rule_to_remove() -> dict[str, dict[str, Any]]:
    """A rule for every node, made anew before each call, so that removing it succeeds."""
    from apps.cluster.models import EngineChoice

    EngineChoice.objects.get_or_create(engine="llama.cpp", scope="all", match="", defaults={"version": "b1"})
    return {"POST": {"engine": "llama.cpp"}}


SIM_SCENARIO = "duration: 1m\nnode_types: {g: {gpus: {class: L4, count: 1}}}\nnodes: [{type: g, count: 1}]\n"


@dataclass(frozen=True)
class Route:
    """`rule` is what the view must declare: one rule for a console view, (read, write) for the API."""

    rule: str | tuple[str, str]
    kwargs: Kwargs = no_kwargs
    # Bodies for the mutating methods the route answers, so an allowed request succeeds.
    bodies: Callable[[World], dict[str, dict[str, Any]]] = field(default=lambda world: {})


MATRIX: dict[str, Route] = {
    # Console pages
    "landing": Route("signed_in"),
    "chat": Route("signed_in"),
    "chat-session-key": Route("signed_in"),
    "chat-render": Route("signed_in", bodies=lambda w: {"POST": {"text": "**hi**"}}),
    "usage": Route("signed_in"),
    "cluster": Route("read_everything"),
    "sim": Route("read_everything"),
    "sim-runs": Route("change_cluster", bodies=lambda w: {"POST": {"scenario": SIM_SCENARIO}}),
    "sim-run": Route("change_cluster", own_sim_run),
    "sim-what-if": Route("change_cluster", bodies=lambda w: {"POST": {"node": w.node.name}}),
    "account": Route("signed_in", bodies=lambda w: {"POST": {"tool": "continue", "model": w.model.name}}),
    "api-keys": Route("signed_in", bodies=lambda w: {"POST": {"name": "laptop", "expires": "30"}}),
    "audit": Route("read_everything"),
    "people": Route("read_everything"),
    "people-members": Route("read_everything"),
    "people-limits": Route("read_everything"),
    "people-usage": Route("read_everything"),
    "people-member-add": Route(
        "manages_branch",
        bodies=lambda w: {"POST": {"branch": f"team:{w.team.pk}", "email": "member@example.com", "role": "member"}},
    ),
    "people-member-remove": Route("manages_branch", org_membership),
    "people-user-suspend": Route(
        "administrator", member_user, bodies=lambda w: {"POST": {"branch": f"org:{w.org.pk}"}}
    ),
    "people-user-reactivate": Route("administrator", member_user),
    "people-team-add": Route("administrator", bodies=lambda w: {"POST": {"branch": f"org:{w.org.pk}", "name": "Ops"}}),
    "people-project-add": Route(
        "administrator", bodies=lambda w: {"POST": {"branch": f"team:{w.team.pk}", "name": "Chat"}}
    ),
    "people-organization-add": Route("administrator", bodies=lambda w: {"POST": {"name": "Globex"}}),
    "people-branch-rename": Route(
        "administrator", bodies=lambda w: {"POST": {"branch": f"team:{w.team.pk}", "name": "Research and Development"}}
    ),
    # The project has no members, models or keys, so an administrator's removal goes through.
    "people-branch-remove": Route("administrator", bodies=lambda w: {"POST": {"branch": f"project:{w.project.pk}"}}),
    "people-rate-limit": Route(
        "change_limits", bodies=lambda w: {"POST": {"branch": f"org:{w.org.pk}", "requests_per_minute": "30"}}
    ),
    "people-capacity-quota": Route(
        "change_limits", bodies=lambda w: {"POST": {"branch": f"org:{w.org.pk}", "gpus": "4"}}
    ),
    "people-share": Route(
        "manages_branch", bodies=lambda w: {"POST": {"branch": f"team:{w.team.pk}", "branch-weight": "2"}}
    ),
    "org": Route("manages_branch"),
    "org-limits": Route("manages_branch"),
    "org-usage": Route("manages_branch"),
    "cluster:nodes": Route("read_everything"),
    "fabrics:fabrics": Route("read_everything"),
    "fabrics:nvlink": Route("read_everything"),
    "fabrics:fabric": Route("read_everything", mapped_fabric),
    "facility:facility": Route("read_everything"),
    "guardrails": Route("read_everything"),
    "guardrails-set": Route(
        "administrator", bodies=lambda w: {"POST": {"policy": f"name: p{uuid.uuid4().hex[:8]}\nrules: []\n"}}
    ),
    "guardrails-remove": Route("administrator", bodies=lambda w: {"POST": {"name": a_policy()}}),
    "facility:hold": Route(
        "change_cluster",
        bodies=lambda w: {"POST": {"level": "rack", "name": f"r{uuid.uuid4().hex[:8]}", "reason": "PDU swap"}},
    ),
    "facility:release": Route(
        "change_cluster", bodies=lambda w: {"POST": dict(zip(("level", "name"), held().split("="), strict=True))}
    ),
    "facility:budget": Route(
        "change_cluster",
        bodies=lambda w: {"POST": {"level": "rack", "name": f"r{uuid.uuid4().hex[:8]}", "watts": "9000"}},
    ),
    "facility:budget-remove": Route("change_cluster", bodies=lambda w: {"POST": {"domain": budgeted()}}),
    "cluster:node-add": Route(
        "change_cluster", bodies=lambda w: {"POST": {"name": "n2", "labels": "", "expires_hours": "1"}}
    ),
    "cluster:node": Route("read_everything", node),
    "cluster:node-cordon": Route("change_cluster", node, bodies=lambda w: {"POST": {"reason": "fan"}}),
    "cluster:node-uncordon": Route("change_cluster", node),
    "cluster:node-drain": Route("change_cluster", node),
    "cluster:node-location": Route("change_cluster", node, bodies=lambda w: {"POST": {"rack": "r12"}}),
    "cluster:node-doctor": Route("read_everything", node),
    "cluster-engine-set": Route("change_cluster", bodies=lambda w: {"POST": {"engine": "llama.cpp", "version": "b1"}}),
    "cluster-engine-remove": Route("change_cluster", bodies=lambda w: engine_rule_to_remove()),
    "cluster-engine-build": Route("change_cluster", node, bodies=lambda w: {"POST": {"build": "cu129"}}),
    "cluster:node-doctor-run": Route("change_cluster", node),
    "mirror:held": Route("read_everything"),
    "mirror:explore": Route("read_everything"),
    "mirror:fetch": Route(
        "change_cluster",
        bodies=lambda w: {"POST": {"urls": f"{w.hub_url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"}},
    ),
    "mirror:remove": Route("change_cluster", pk_of("mirror")),
    "mirror:adapter-attach": Route(
        "change_cluster", lambda w, role: {"model": w.model.name}, bodies=lambda w: {"POST": {"version": "0"}}
    ),
    "mirror:adapter-detach": Route(
        "change_cluster", lambda w, role: {"model": w.model.name}, bodies=lambda w: {"POST": {"path": "/x"}}
    ),
    "mirror:serve": Route(
        "change_cluster",
        pk_of("mirror"),
        bodies=lambda w: {"POST": {"name": "served", "placement": "cpu", "context": "256", "allow_cpu": "on"}},
    ),
    "catalog:models": Route("read_everything"),
    "catalog:model-apply": Route(
        "change_cluster", bodies=lambda w: {"POST": {"spec": "models:\n  - " + json.dumps(MODEL_SPEC)}}
    ),
    "catalog:model": Route("read_everything", model),
    "catalog:model-explain": Route("read_everything", model),
    "catalog:model-target": Route(
        "change_cluster", model, bodies=lambda w: {"POST": {"min_replicas": "0", "max_replicas": "2"}}
    ),
    "catalog:model-class": Route("change_cluster", model, bodies=lambda w: {"POST": {"capacity_class": "critical"}}),
    "catalog:model-delete": Route("change_cluster", model),
    "catalog:model-owner": Route("change_cluster", model, bodies=lambda w: {"POST": {"owner": ""}}),
    "catalog:model-resources": Route(
        "change_cluster", model, bodies=lambda w: {"POST": {"profile": "cpu", "memory": "3GB", "cpu_cores": "2"}}
    ),
    # The API
    "api-root": Route(("signed_in", "signed_in")),
    "api-me": Route(("signed_in", "signed_in")),
    "api-status": Route(("signed_in", "signed_in")),
    "api-usage": Route(("signed_in", "signed_in")),
    "api-request": Route(("signed_in", "signed_in"), lambda w, role: {"request_id": w.record.request_id}),
    "api-node-enrollments": Route(("read_everything", "change_cluster"), bodies=lambda w: {"POST": {"name": "n3"}}),
    "api-sim": Route(("change_cluster", "change_cluster"), bodies=lambda w: {"POST": {"scenario": SIM_SCENARIO}}),
    "api-sim-run": Route(("change_cluster", "change_cluster"), own_sim_run),
    "apikey-list": Route(("signed_in", "signed_in"), bodies=lambda w: {"POST": {"name": "ci"}}),
    "apikey-detail": Route(("signed_in", "signed_in"), own_key),
    "apikey-revoke": Route(("signed_in", "signed_in"), own_key),
    # A key's owner may lower its band (administrators and managers may set more: test_shares.py).
    "apikey-share": Route(("signed_in", "signed_in"), own_key, bodies=lambda w: {"PATCH": {"band": "batch"}}),
    "organization-list": Route(("read_everything", "administrator"), bodies=lambda w: {"POST": {"name": "Globex"}}),
    "organization-detail": Route(("read_everything", "administrator"), pk_of("org")),
    # Weights: administrators here; managers of the level above (tests/accounts/test_shares.py).
    "organization-share": Route(
        ("manages_branch", "manages_branch"), pk_of("org"), bodies=lambda w: {"PATCH": {"weight": 2}}
    ),
    "team-share": Route(("manages_branch", "manages_branch"), pk_of("team"), bodies=lambda w: {"PATCH": {"weight": 2}}),
    "project-share": Route(
        ("manages_branch", "manages_branch"), pk_of("project"), bodies=lambda w: {"PATCH": {"band": "batch"}}
    ),
    "team-list": Route(
        ("read_everything", "administrator"), bodies=lambda w: {"POST": {"organization": w.org.pk, "name": "Ops"}}
    ),
    "team-detail": Route(("read_everything", "administrator"), pk_of("team")),
    "project-list": Route(
        ("read_everything", "administrator"), bodies=lambda w: {"POST": {"team": w.team.pk, "name": "Chat"}}
    ),
    "project-detail": Route(("read_everything", "administrator"), pk_of("project")),
    "node-list": Route(("read_everything", "change_cluster")),
    "node-detail": Route(("read_everything", "change_cluster"), node),
    "node-cordon": Route(("read_everything", "change_cluster"), node, bodies=lambda w: {"POST": {"reason": "fan"}}),
    "node-uncordon": Route(("read_everything", "change_cluster"), node),
    "node-drain": Route(("read_everything", "change_cluster"), node),
    "node-revoke": Route(("read_everything", "change_cluster"), node),
    "node-labels": Route(
        ("read_everything", "change_cluster"), node, bodies=lambda w: {"POST": {"set": {"llmgw.io/rack": "r12"}}}
    ),
    "node-engines": Route(("read_everything", "change_cluster"), node, bodies=lambda w: {"POST": {"disable": []}}),
    "node-engine-build": Route(
        ("read_everything", "change_cluster"), node, bodies=lambda w: {"POST": {"build": "cu129"}}
    ),
    "api-engines": Route(
        ("read_everything", "change_cluster"), bodies=lambda w: {"POST": {"engine": "llama.cpp", "version": "b1"}}
    ),
    "api-engines-remove": Route(("read_everything", "change_cluster"), bodies=lambda w: engine_rule_to_remove()),
    "api-engines-refresh": Route(("read_everything", "change_cluster")),
    "api-fabrics": Route(("read_everything", "administrator")),
    "api-nvlink": Route(("read_everything", "administrator")),
    "api-fabric-topology": Route(("read_everything", "change_cluster"), mapped_fabric),
    "api-agent-requests": Route(("read_everything", "change_cluster")),
    "api-fabric-tests": Route(("read_everything", "change_cluster"), bodies=two_on_a_fabric),
    "api-facility": Route(("read_everything", "administrator")),
    "api-guardrails": Route(
        ("read_everything", "administrator"), bodies=lambda w: {"POST": {"name": f"p{uuid.uuid4().hex[:8]}"}}
    ),
    "api-guardrail": Route(
        ("read_everything", "administrator"),
        lambda w, role: {"name": a_policy()},
        bodies=lambda w: {"PUT": {"description": "changed"}, "DELETE": {}},
    ),
    "api-facility-holds": Route(
        ("read_everything", "change_cluster"), bodies=lambda w: {"POST": {"domain": f"rack=r{uuid.uuid4().hex[:8]}"}}
    ),
    "api-facility-release": Route(("read_everything", "change_cluster"), bodies=lambda w: {"POST": {"domain": held()}}),
    "api-facility-budgets": Route(
        ("read_everything", "change_cluster"),
        bodies=lambda w: {"POST": {"domain": f"rack=r{uuid.uuid4().hex[:8]}", "watts": 15000}},
    ),
    "api-fabric-test": Route(("read_everything", "change_cluster"), a_fabric_test),
    "api-agent-request-retry": Route(("read_everything", "change_cluster"), failed_request),
    "api-mirror": Route(
        ("read_everything", "change_cluster"),
        bodies=lambda w: {"POST": {"urls": [f"{w.hub_url}/acme/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf"]}},
    ),
    "api-mirror-search": Route(("read_everything", "change_cluster")),
    "api-mirror-repo": Route(
        ("read_everything", "change_cluster"), lambda w, role: {"owner": "acme", "name": "tiny-GGUF"}
    ),
    "api-mirror-version": Route(("read_everything", "change_cluster"), pk_of("mirror")),
    "api-mirror-manifest": Route(("read_everything", "change_cluster"), pk_of("mirror")),
    "api-mirror-estimate": Route(("read_everything", "change_cluster"), pk_of("mirror")),
    "model-list": Route(("read_everything", "change_cluster")),
    "model-apply": Route(("read_everything", "change_cluster"), bodies=lambda w: {"POST": {"models": [MODEL_SPEC]}}),
    "model-detail": Route(("read_everything", "change_cluster"), model),
    "model-target": Route(("read_everything", "change_cluster"), model, bodies=lambda w: {"POST": {"max": 2}}),
    "model-resources": Route(
        ("read_everything", "change_cluster"), model, bodies=lambda w: {"POST": {"memory": "3GB"}}
    ),
    "model-capacity-class": Route(
        ("read_everything", "change_cluster"), model, bodies=lambda w: {"POST": {"capacity_class": "critical"}}
    ),
    "model-explain": Route(("read_everything", "change_cluster"), model),
    "model-headroom": Route(("read_everything", "change_cluster"), model),
    "replica-list": Route(("read_everything", "change_cluster")),
    "replica-detail": Route(("read_everything", "change_cluster"), pk_of("replica")),
    "ratelimit-list": Route(
        ("read_everything", "change_limits"), bodies=lambda w: {"POST": {"team": w.team.pk, "requests_per_minute": 5}}
    ),
    "ratelimit-detail": Route(
        ("read_everything", "change_limits"),
        pk_of("limit"),
        bodies=lambda w: {"PUT": {"requests_per_minute": 7}, "PATCH": {"tokens_per_day": 1000}, "DELETE": {}},
    ),
    "capacityquota-list": Route(
        ("read_everything", "change_limits"), bodies=lambda w: {"POST": {"team": w.team.pk, "gpus": 2}}
    ),
    "capacityquota-detail": Route(
        ("read_everything", "change_limits"),
        pk_of("quota"),
        bodies=lambda w: {"PUT": {"gpus": 4}, "PATCH": {"replicas": 3}, "DELETE": {}},
    ),
    "audit-list": Route(("read_everything", "nobody")),
    "audit-detail": Route(("read_everything", "nobody"), pk_of("event")),
    # Batches: each person's own on the console; every organisation's for staff in the API.
    "batches:batches": Route("signed_in"),
    "batches:batch": Route("signed_in", own_batch),
    "batches:batch-cancel": Route("signed_in", own_batch, bodies=lambda w: {"POST": {}}),
    "batches:batch-file": Route("signed_in", own_batch_output),
    "batch-list": Route(("read_everything", "change_cluster")),
    "batch-detail": Route(("read_everything", "change_cluster"), own_batch),
    "batch-cancel": Route(("read_everything", "change_cluster"), own_batch, bodies=lambda w: {"POST": {}}),
}


# Reading the declarations ----------------------------------------------------------------------


@dataclass(frozen=True)
class Declared:
    route: str  # as written in the URLconf, for messages
    name: str
    api: bool
    rule: str | tuple[str, str] | None  # None: no decision declared
    methods: tuple[str, ...]  # the methods the view answers, besides GET when it answers GET
    problem: str = ""


def _walk(patterns: list[Any], prefix: str, namespace: str) -> Iterator[tuple[str, str, URLPattern]]:
    for pattern in patterns:
        route = prefix + str(pattern.pattern)
        if isinstance(pattern, URLResolver):
            inner = ":".join(part for part in (namespace, pattern.namespace or "") if part)
            yield from _walk(pattern.url_patterns, route, inner)
        else:
            name = f"{namespace}:{pattern.name}" if namespace and pattern.name else str(pattern.name or "")
            yield route, name, pattern


def _explicit_permissions(cls: type[APIView], initkwargs: dict[str, Any]) -> list[type] | None:
    """The view's own permission_classes; None when it only inherits DRF's default."""
    if "permission_classes" in initkwargs:
        return list(initkwargs["permission_classes"])
    for klass in cls.__mro__:
        if "permission_classes" in vars(klass) and not klass.__module__.startswith("rest_framework."):
            return list(vars(klass)["permission_classes"])
    return None


def declaration(route: str, name: str, pattern: URLPattern) -> Declared:
    callback = pattern.callback
    cls = getattr(callback, "cls", None)
    if isinstance(cls, type) and issubclass(cls, APIView):
        actions = getattr(callback, "actions", None)
        if actions:
            methods = tuple(m.upper() for m in actions if m not in ("head", "options"))
        else:
            methods = tuple(m.upper() for m in ("get", *map(str.lower, MUTATING)) if hasattr(cls, m))
        permissions = _explicit_permissions(cls, getattr(callback, "initkwargs", {}) or {})
        if permissions is None:
            return Declared(route, name, True, None, methods, "no permission_classes of its own")
        if permissions == [AllowAny]:
            return Declared(route, name, True, "public", methods)
        if len(permissions) != 1 or not issubclass(permissions[0], access.RulePermission):
            return Declared(
                route,
                name,
                True,
                None,
                methods,
                f"permission_classes {permissions} is not one class from apps.accounts.access",
            )
        return Declared(route, name, True, (permissions[0].read_rule, permissions[0].write_rule), methods)
    rule = getattr(callback, "access_rule", None)
    methods = tuple(getattr(callback, "access_methods", ()))
    if rule is None:
        return Declared(route, name, False, None, methods, "no @requires(...) or @public")
    return Declared(route, name, False, rule, methods)


def declarations() -> list[Declared]:
    found = []
    for route, name, pattern in _walk(get_resolver().url_patterns, "", ""):
        if route.startswith(SKIPPED_PREFIXES):
            continue
        if "format" in pattern.pattern.regex.groupindex:
            continue  # the router's ".json" twin of a route: the same view, checked without the suffix
        found.append(declaration(route, name, pattern))
    return found


def public_reason(item: Declared) -> str | None:
    if item.name in PUBLIC:
        return PUBLIC[item.name]
    return next((reason for prefix, reason in PUBLIC_PREFIXES.items() if item.route.startswith(prefix)), None)


def test_every_route_declares_who_may_use_it() -> None:
    problems = []
    seen = set()
    for item in declarations():
        label = f"/{item.route} ({item.name or 'unnamed'})"
        seen.add(item.name)
        if not item.name:
            problems.append(f"{label}: give the route a name, so the matrix can hold it")
        elif public_reason(item) is not None:
            if item.rule not in (None, "public"):
                problems.append(f"{label}: listed in PUBLIC but declares {item.rule!r}")
        elif item.problem:
            problems.append(f"{label}: {item.problem}")
        elif item.rule == "public":
            problems.append(f"{label}: declared public; list it in PUBLIC with the reason")
        elif item.name not in MATRIX:
            problems.append(f"{label}: missing from MATRIX (declares {item.rule!r})")
        elif MATRIX[item.name].rule != item.rule:
            problems.append(f"{label}: declares {item.rule!r} but MATRIX expects {MATRIX[item.name].rule!r}")
    problems += [f"MATRIX names {name!r}, which no URL has" for name in MATRIX if name not in seen]
    assert problems == [], "routes without a reviewed permission decision:\n" + "\n".join(problems)


def test_the_rules_let_in_whom_the_matrix_says(world: World) -> None:
    for rule, who in WHO.items():
        allowed = {role for role, user in world.users.items() if access.allows(rule, user)}
        assert allowed == who, rule


def test_an_undeclared_view_is_named() -> None:
    from django.http import HttpResponse
    from django.urls import path

    def bare(request: Any) -> HttpResponse:
        return HttpResponse()

    item = declaration("secret/", "secret", path("secret/", bare, name="secret"))
    assert item.rule is None and "@requires" in item.problem

    class BareView(APIView):
        def get(self, request: Any) -> Any:
            return None

    item = declaration("api/v1/bare", "bare", path("api/v1/bare", BareView.as_view(), name="bare"))
    assert item.rule is None and "permission_classes" in item.problem


# Trying each role ------------------------------------------------------------------------------


def _refused(response: Any) -> bool:
    if response.status_code in (401, 403, 404):
        return True
    return response.status_code in (301, 302) and response["Location"].startswith(reverse("login"))


def _allowed(response: Any) -> bool:
    return 200 <= response.status_code < 400 and not _refused(response)


def _request(client: Client, method: str, url: str, body: dict[str, Any] | None, api: bool) -> Any:
    """One request, rolled back afterwards so that every request meets the same world."""
    with transaction.atomic():
        if api:
            data = json.dumps(body) if body is not None else None
            response = client.generic(
                method, url, data or "", content_type="application/json", HTTP_ACCEPT="application/json"
            )
        elif method == "GET":
            response = client.get(url)
        else:
            response = client.generic(method, url, _form(body or {}), content_type="application/x-www-form-urlencoded")
        transaction.set_rollback(True)
    return response


def _form(body: dict[str, Any]) -> str:
    from urllib.parse import urlencode

    return urlencode(body)


def _rule_for(item: Declared, method: str) -> str:
    assert item.rule is not None
    if isinstance(item.rule, tuple):
        return item.rule[0] if method == "GET" else item.rule[1]
    return item.rule


def _matrix_cases() -> list[Declared]:
    return [item for item in declarations() if item.name in MATRIX and public_reason(item) is None]


@pytest.mark.parametrize("role", ROLES)
def test_each_role_gets_what_its_rules_allow(world: World, role: str) -> None:
    client = Client()
    if world.users[role] is not None:
        client.force_login(world.users[role])
    wrong = []
    for item in _matrix_cases():
        route = MATRIX[item.name]
        url = reverse(item.name, kwargs=route.kwargs(world, role))
        bodies = route.bodies(world)
        for method in ("GET", *MUTATING):
            response = _request(client, method, url, bodies.get(method), item.api)
            if method not in item.methods:
                ok = _refused(response) or response.status_code == 405
                want = "refused or 405 (not answered)"
            elif role in WHO[_rule_for(item, method)]:
                ok, want = _allowed(response), "allowed (2xx/3xx)"
            else:
                ok, want = _refused(response), "refused (401/403/404 or sign in)"
            if not ok:
                wrong.append(f"{method} {url} ({item.name}) as {role}: {response.status_code}, want {want}")
    assert wrong == [], "\n".join(wrong)


def test_a_viewer_changes_nothing_anywhere(world: World) -> None:
    client = Client()
    client.force_login(world.users["viewer"])
    before = AuditEvent.objects.count()
    changed = []
    for item in _matrix_cases():
        if item.name in PERSONAL or item.name in COMPUTE_ONLY:
            continue
        route = MATRIX[item.name]
        url = reverse(item.name, kwargs=route.kwargs(world, "viewer"))
        for method in MUTATING:
            with transaction.atomic():
                body = route.bodies(world).get(method)
                if item.api:
                    response = client.generic(method, url, json.dumps(body or {}), content_type="application/json")
                else:
                    response = client.generic(
                        method, url, _form(body or {}), content_type="application/x-www-form-urlencoded"
                    )
            if response.status_code not in (403, 404, 405):
                changed.append(f"{method} {url}: {response.status_code}")
    assert changed == []
    assert AuditEvent.objects.count() == before


def test_a_viewer_is_told_403_by_the_api_and_the_console(world: World) -> None:
    client = Client()
    client.force_login(world.users["viewer"])
    assert client.post("/api/v1/nodes/n1/cordon", {"reason": "x"}, content_type="application/json").status_code == 403
    assert client.post("/nodes/n1/cordon", {"reason": "x"}).status_code == 403
    assert client.post("/api/v1/limits", {"team": world.team.pk}, content_type="application/json").status_code == 403
    world.node.refresh_from_db()
    assert not world.node.cordoned


def test_nobody_reads_another_persons_key(world: World) -> None:
    client = Client()
    client.force_login(world.users["administrator"])
    assert client.get(f"/api/v1/keys/{world.keys['member'].pk}").status_code == 404
    assert client.post(f"/api/v1/keys/{world.keys['member'].pk}/revoke").status_code == 404


# `llmgw ctl` goes through the same API ------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_ctl_as_a_viewer_changes_nothing(live_server: Any, capsys: Any, monkeypatch: Any, tmp_path: Any) -> None:
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    viewer = make_user("viewer@example.com", role=StaffRole.VIEWER)
    secret = services.create_api_key(viewer, name="cli", actor=viewer).secret
    Node.objects.create(name="n1", status=NodeStatus.READY)
    Model.objects.create(name="m1", min_replicas=0, max_replicas=1, source="/models/m1.gguf")
    org = Organization.objects.create(name="Acme", slug="acme")
    base = ["ctl", "--server", live_server.url, "--key", secret]
    for command in (
        ["node", "cordon", "n1", "--reason", "fan"],
        ["model", "target", "m1", "--min", "1"],
        ["limits", "create", "--org", str(org.pk), "--rpm", "10"],
    ):
        assert main([*base, *command]) == 1, command
        assert "error 403" in capsys.readouterr().err, command
    # Reading is allowed.
    assert main([*base, "nodes"]) == 0
    assert "n1" in capsys.readouterr().out
    assert not Node.objects.get(name="n1").cordoned
    assert Model.objects.get(name="m1").min_replicas == 0
    assert not RateLimit.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_ctl_limits_as_billing(live_server: Any, capsys: Any, monkeypatch: Any, tmp_path: Any) -> None:
    from llmgw.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    billing = make_user("billing@example.com", role=StaffRole.BILLING)
    secret = services.create_api_key(billing, name="cli", actor=billing).secret
    org = Organization.objects.create(name="Acme", slug="acme")
    base = ["ctl", "--server", live_server.url, "--key", secret]
    assert main([*base, "limits", "create", "--org", str(org.pk), "--rpm", "10"]) == 0
    limit = RateLimit.objects.get()
    assert f"limit {limit.pk} (org:{org.pk}) created: rpm 10" in capsys.readouterr().out
    assert main([*base, "limits", "set", str(limit.pk), "--tpd", "5000", "--rpm", "0"]) == 0
    limit.refresh_from_db()
    assert (limit.requests_per_minute, limit.tokens_per_day) == (None, 5000)
    capsys.readouterr()
    assert main([*base, "limits"]) == 0
    assert f"org:{org.pk}" in capsys.readouterr().out
    assert main([*base, "limits", "delete", str(limit.pk)]) == 0
    assert not RateLimit.objects.exists()
    # Billing changes limits, not the cluster.
    Node.objects.create(name="n1", status=NodeStatus.READY)
    assert main([*base, "node", "cordon", "n1", "--reason", "x"]) == 1
    assert "error 403" in capsys.readouterr().err
