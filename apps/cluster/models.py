"""Nodes, their GPUs and the tokens that let an agent join."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from agent.probes.mig import SLICE_BASE, SLICE_STRIDE
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState, StopReason
from apps.cluster.samples import read_sample

if TYPE_CHECKING:
    from agent.messages import HeartbeatSample

__all__ = [
    "AgentRequest",
    "ControlLock",
    "EngineChoice",
    "EngineRelease",
    "EnrollmentToken",
    "Gpu",
    "Node",
    "device_label",
    "Replica",
    "Shard",
]


class Node(models.Model):
    """A server running the llmgw agent.

    `hardware` is what the agent said at registration (CPU, OS, memory, driver); `sample`
    is its latest heartbeat, written as one row update per heartbeat. Unknown values are
    absent or null in both, never 0.
    """

    name = models.CharField(_("name"), max_length=200, unique=True)
    labels = models.JSONField(_("labels"), default=dict, blank=True)
    status = models.CharField(_("status"), max_length=16, choices=NodeStatus.choices, default=NodeStatus.PENDING)
    cordoned = models.BooleanField(_("cordoned"), default=False)
    cordon_reason = models.CharField(_("cordon reason"), max_length=500, blank=True)
    # A drain: its replicas are replaced elsewhere first, then stopped, their engines running on for
    # drain_grace seconds (LLMGW_DRAIN_GRACE_SECONDS when unset) for the requests in flight.
    drain_requested_at = models.DateTimeField(_("drain requested"), null=True, blank=True)
    drain_grace = models.PositiveIntegerField(_("drain grace (s)"), null=True, blank=True)
    drain_force = models.BooleanField(_("drain without waiting for room"), default=False)
    agent_version = models.CharField(_("agent version"), max_length=64, blank=True)
    features = models.JSONField(_("features"), default=list, blank=True)
    hardware = models.JSONField(_("hardware"), default=dict, blank=True)
    warnings = models.JSONField(_("warnings"), default=list, blank=True)
    sample = models.JSONField(_("latest sample"), null=True, blank=True)
    sampled_at = models.DateTimeField(_("sampled"), null=True, blank=True)
    credential_hash = models.CharField(_("credential hash"), max_length=64, unique=True, null=True, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    registered_at = models.DateTimeField(_("registered"), null=True, blank=True)
    last_seen_at = models.DateTimeField(_("last seen"), null=True, blank=True)
    revoked_at = models.DateTimeField(_("revoked"), null=True, blank=True)
    # Where the gateway reaches this node's engines: the agent's advertised address, else
    # the address its websocket came from.
    address = models.CharField(_("address"), max_length=255, blank=True)
    # Bumped whenever the node's shard list changes, so its connection notices and resends it
    # even when the change was made in another process and no channel layer links them.
    desired_version = models.PositiveIntegerField(_("desired state version"), default=0)
    # The channel of the node's newest agent connection; an older one closes when it sees another here.
    connection = models.CharField(_("agent connection"), max_length=200, blank=True, editable=False)
    # Engines this node must not install or run, whatever the engine choices say.
    disabled_engines = models.JSONField(_("disabled engines"), default=list, blank=True)

    class EngineBuild(models.TextChoices):
        AUTO = "auto", _("auto (the best the driver and GPUs allow)")
        CU13 = "cu13", _("CUDA 13")
        CU129 = "cu129", _("CUDA 12.9")
        NONE = "none", _("none (no vLLM or SGLang on this node)")

    # Which CUDA build of vLLM and SGLang this node installs.
    engine_build = models.CharField(
        _("vLLM/SGLang build"), max_length=8, choices=EngineBuild.choices, default=EngineBuild.AUTO
    )
    # The checks `llmgw doctor` last ran on the node when asked from the console: [{name, status, detail, fix}].
    doctor = models.JSONField(_("doctor's checks"), null=True, blank=True, editable=False)
    doctor_requested_at = models.DateTimeField(_("doctor asked"), null=True, blank=True, editable=False)
    doctor_at = models.DateTimeField(_("doctor answered"), null=True, blank=True, editable=False)

    class Meta:
        verbose_name = _("node")
        verbose_name_plural = _("nodes")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def live_status(self) -> str:
        """The status to show and to place by: a node marked ready whose heartbeats stopped reads
        unreachable at once, whether or not the scheduler that marks it so is running."""
        if self.status == NodeStatus.READY and self.last_seen_at is not None:
            grace = timedelta(seconds=settings.AGENT_HEARTBEAT_INTERVAL * settings.AGENT_MISSED_HEARTBEATS)
            if timezone.now() - self.last_seen_at > grace:
                return NodeStatus.UNREACHABLE
        return self.status

    def get_live_status_display(self) -> str:
        return str(NodeStatus(self.live_status).label)

    @property
    def placement_labels(self) -> dict[str, str]:
        """The labels placement sees: the agent's (agent.yaml), with the ones kept here over them."""
        return {**((self.hardware or {}).get("labels") or {}), **(self.labels or {})}

    @property
    def latest_sample(self) -> HeartbeatSample | None:
        """The latest sample, however old, checked against its type (apps.cluster.samples: a value
        of the wrong type is left out); None when there is none."""
        return read_sample(self.sample)

    def fresh_sample(
        self, now: datetime | None = None, max_age: timedelta = timedelta(minutes=1)
    ) -> HeartbeatSample | None:
        """The latest sample (checked, as latest_sample) if it is recent enough to stand for now, else None."""
        if self.sample is None or self.sampled_at is None:
            return None
        if (now or timezone.now()) - self.sampled_at > max_age:
            return None
        return read_sample(self.sample)

    @property
    def cpus(self) -> int | None:
        value = (self.latest_sample or {}).get("cpus") or self.hardware.get("cpus")
        return int(value) if value else None

    @property
    def memory_total_bytes(self) -> int | None:
        value = (self.latest_sample or {}).get("memory_total_bytes") or self.hardware.get("memory_total_bytes")
        return int(value) if value else None


class Gpu(models.Model):
    """One device of a node, as its agent last registered it: a whole card, or a slice of one (a
    MIG device of an NVIDIA card, a compute partition of an AMD card).

    A slice's index is agent.probes.mig.slice_index(card, number) and names its card
    (`parent_index`); a card cut into slices (`split`) is never offered whole. `fault` is why the
    device cannot be trusted now, in its agent's words (a MIG layout the tools disagree on, a mode
    change waiting for a reset): such a device is shown with it and never placed on.
    """

    class Kind(models.TextChoices):
        GPU = "gpu", _("whole card")
        MIG = "mig", _("MIG slice")
        PARTITION = "partition", _("compute partition")

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus", verbose_name=_("node"))
    index = models.PositiveSmallIntegerField(_("index"))
    uuid = models.CharField(_("UUID"), max_length=100, blank=True)
    name = models.CharField(_("name"), max_length=200, blank=True)
    gpu_class = models.CharField(_("GPU class"), max_length=100, blank=True)
    pci_bus_id = models.CharField(_("PCI bus id"), max_length=32, blank=True)
    memory_total_mib = models.PositiveIntegerField(_("memory (MiB)"), null=True, blank=True)
    mig_mode = models.CharField(_("MIG mode"), max_length=32, blank=True)
    mig_pending = models.CharField(_("MIG mode after a reset"), max_length=32, blank=True)
    vendor = models.CharField(_("vendor"), max_length=16, blank=True)
    kind = models.CharField(_("kind"), max_length=16, choices=Kind.choices, default=Kind.GPU)
    parent_index = models.PositiveSmallIntegerField(_("card"), null=True, blank=True)
    profile = models.CharField(_("profile"), max_length=64, blank=True)
    # What the engine is told to use: a MIG device's UUID, an AMD device's ROCm index.
    device_id = models.CharField(_("device id"), max_length=200, blank=True)
    share = models.FloatField(_("share of its card"), null=True, blank=True)
    split = models.BooleanField(_("split into slices"), default=False)
    memory_group = models.CharField(_("memory shared with"), max_length=64, blank=True)
    compute_partition = models.CharField(_("compute partition"), max_length=16, blank=True)
    memory_partition = models.CharField(_("memory partition"), max_length=16, blank=True)
    # Health that decides whether the card may be given out; rewritten only when it changes.
    ecc_fault = models.BooleanField(_("uncorrected ECC errors"), default=False)
    foreign_processes = models.PositiveIntegerField(_("processes not started by llmgw"), default=0)
    fault = models.CharField(_("why it cannot be trusted"), max_length=1000, blank=True)

    class Meta:
        verbose_name = _("GPU")
        verbose_name_plural = _("GPUs")
        ordering = ["node__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="%(app_label)s_%(class)s_unique_node_index"),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index} {self.gpu_class or self.name}"

    @property
    def healthy(self) -> bool:
        return not self.ecc_fault and self.foreign_processes == 0 and not self.fault

    @property
    def label(self) -> str:
        """How it reads in pages and refusals: "GPU 0", "GPU 0 MIG 2 (1g.10gb)", "GPU 1 XCP 3 (cpx.nps4)"."""
        return device_label(self.index, self.kind, self.parent_index, self.profile)


def device_label(index: int, kind: str, parent: int | None, profile: str) -> str:
    """A device's name in any language: the card's number, and a slice's number on it and profile."""
    if parent is None:
        return f"GPU {index}"
    word = "MIG" if kind == Gpu.Kind.MIG else "XCP"
    number = index - SLICE_BASE - parent * SLICE_STRIDE
    return f"GPU {parent} {word} {number}" + (f" ({profile})" if profile else "")


class EnrollmentToken(models.Model):
    """A one-time secret an agent trades for its node credential. Only the hash is kept."""

    node_name = models.CharField(_("node name"), max_length=200)
    labels = models.JSONField(_("labels"), default=dict, blank=True)
    # Engines the node must not install or run (`llmgw ctl node add --disable-engine`).
    disabled_engines = models.JSONField(_("disabled engines"), default=list, blank=True)
    token_hash = models.CharField(_("token hash"), max_length=64, unique=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
        verbose_name=_("created by"),
    )
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    expires_at = models.DateTimeField(_("expires"))
    used_at = models.DateTimeField(_("used"), null=True, blank=True)
    node = models.ForeignKey(
        Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("node")
    )

    class Meta:
        verbose_name = _("enrollment token")
        verbose_name_plural = _("enrollment tokens")
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.node_name} ({self.created_at:%Y-%m-%d %H:%M})"


class Replica(models.Model):
    """One running copy of a model: one shard per node it spans. Placed and released whole."""

    model = models.ForeignKey(
        "catalog.Model", on_delete=models.CASCADE, related_name="replicas", verbose_name=_("model")
    )
    profile = models.ForeignKey(
        "catalog.Profile",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="replicas",
        verbose_name=_("profile"),
    )
    state = models.CharField(_("state"), max_length=16, choices=ReplicaState.choices, default=ReplicaState.PENDING)
    # Kept running beyond the model's minimum (under load); preemptible within its class.
    above_minimum = models.BooleanField(_("above its minimum"), default=False)
    # What it was placed to run (the model's source and its profile's settings then): its engines
    # keep this command line until the replica is replaced, never change it in place.
    spec = models.JSONField(_("running spec"), default=dict, blank=True)
    # A replica started to take the place of one whose spec is out of date (a rolling change).
    replaces = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("replaces")
    )
    # The refusals placement met, shown by explain: every node that could not take it, and why.
    rejections = models.JSONField(_("placement refusals"), default=list, blank=True)
    failures = models.PositiveIntegerField(_("failures in a row"), default=0)
    next_attempt_at = models.DateTimeField(_("next attempt"), null=True, blank=True)
    message = models.TextField(_("message"), blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now)
    placed_at = models.DateTimeField(_("placed"), null=True, blank=True)
    ready_at = models.DateTimeField(_("ready since"), null=True, blank=True)
    stop_requested_at = models.DateTimeField(_("stop requested"), null=True, blank=True)
    # Set when it is stopped: why, and how long its engines run on for the requests in flight.
    stop_reason = models.CharField(_("stop reason"), max_length=16, choices=StopReason.choices, blank=True)
    drain_grace = models.PositiveIntegerField(_("drain grace (s)"), null=True, blank=True)

    class Meta:
        verbose_name = _("replica")
        verbose_name_plural = _("replicas")
        ordering = ["model__name", "created_at"]

    def __str__(self) -> str:
        return f"{self.model.name}#{self.pk}"


class Shard(models.Model):
    """The part of a replica on one node: the GPUs, memory and cores it claims there."""

    replica = models.ForeignKey(Replica, on_delete=models.CASCADE, related_name="shards", verbose_name=_("replica"))
    rank = models.PositiveSmallIntegerField(_("rank"), default=0)
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="shards", verbose_name=_("node"))
    gpu_indices = models.JSONField(_("GPUs"), default=list, blank=True)
    # What its engine is told to use, one per GPU index, read from the devices when it was placed: a
    # MIG slice's UUID, an AMD device's ROCm index; [] for whole NVIDIA cards (told their indices).
    devices = models.JSONField(_("devices"), default=list, blank=True)
    vendor = models.CharField(_("vendor"), max_length=16, blank=True)
    # Since when the shard's claim has not been counted as held time yet (apps.cluster.held): set
    # when the shard is placed, moved on each time its time is counted.
    held_since = models.DateTimeField(_("held time counted until"), default=timezone.now)
    memory_bytes = models.BigIntegerField(_("memory claimed"), default=0)
    cpu_cores = models.FloatField(_("cores claimed"), default=0)
    port = models.PositiveIntegerField(_("port"))
    # The engine is started with this key, so only the gateway can use it.
    secret = models.CharField(_("engine key"), max_length=64)
    state = models.CharField(_("state"), max_length=16, choices=ShardState.choices, default=ShardState.ASSIGNED)
    pid = models.PositiveIntegerField(_("process id"), null=True, blank=True)
    exit_code = models.IntegerField(_("exit code"), null=True, blank=True)
    log_tail = models.JSONField(_("last log lines"), default=list, blank=True)
    message = models.TextField(_("message"), blank=True)
    # The tokens one request may hold, as the engine itself says once ready (None: it did not say);
    # the gateway refuses a prompt that cannot fit by it when the profile states no context.
    context_tokens = models.PositiveIntegerField(_("context (tokens)"), null=True, blank=True)
    reported_at = models.DateTimeField(_("reported"), null=True, blank=True)
    # What the engine's process group uses, from the node's heartbeats (None until measured).
    cores_used = models.FloatField(_("cores used"), null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(_("memory used"), null=True, blank=True)
    # What placement adds to the engine's environment on this node (NCCL's adapters for the fabric
    # the replica was formed on); the profile's own env wins over it.
    env = models.JSONField(_("environment"), default=dict, blank=True)

    class Meta:
        verbose_name = _("shard")
        verbose_name_plural = _("shards")
        ordering = ["replica_id", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["replica", "rank"], name="%(app_label)s_%(class)s_unique_replica_rank"),
            models.UniqueConstraint(fields=["node", "port"], name="%(app_label)s_%(class)s_unique_node_port"),
        ]

    def __str__(self) -> str:
        return f"{self.replica}/{self.rank}@{self.node.name}"

    @property
    def shard_id(self) -> str:
        return f"r{self.replica_id}s{self.rank}"


class ControlLock(models.Model):
    """A row to lock, so that one reconciler pass runs at a time across all workers."""

    name = models.CharField(_("name"), max_length=64, primary_key=True)

    class Meta:
        verbose_name = _("control lock")
        verbose_name_plural = _("control locks")

    def __str__(self) -> str:
        return self.name


class EngineChoice(models.Model):
    """Which version of an engine the nodes a rule picks should have (`engines:` in server.yaml).

    A node takes, per engine, the most specific rule that matches it: its name, then one of its
    labels, then one of its GPU classes, then the rule for every node; without any, the version
    this release was checked against (apps.cluster.engines.DEFAULT_VERSIONS). Version "none"
    keeps the engine off the nodes the rule picks.
    """

    class Scope(models.TextChoices):
        ALL = "all", _("every node")
        GPU_CLASS = "gpu_class", _("GPU class")
        LABEL = "label", _("label")
        NODE = "node", _("node")

    engine = models.CharField(_("engine"), max_length=32)
    version = models.CharField(_("version"), max_length=64)
    scope = models.CharField(_("applies to"), max_length=16, choices=Scope.choices, default=Scope.ALL)
    # The GPU class, "key=value" of a label, or the node name; "" for every node.
    match = models.CharField(_("match"), max_length=300, blank=True)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        verbose_name = _("engine choice")
        verbose_name_plural = _("engine choices")
        ordering = ["engine", "scope", "match"]
        constraints = [
            models.UniqueConstraint(
                fields=["engine", "scope", "match"], name="%(app_label)s_%(class)s_unique_engine_scope_match"
            ),
        ]

    def __str__(self) -> str:
        where = self.get_scope_display() if self.scope == self.Scope.ALL else f"{self.scope} {self.match}"
        return f"{self.engine} {self.version} ({where})"


class EngineRelease(models.Model):
    """An engine release's asset listing, fetched once by the control plane (GitHub's
    `releases/tags/<tag>`) and handed to the nodes: they never call GitHub themselves."""

    engine = models.CharField(_("engine"), max_length=32)
    version = models.CharField(_("version"), max_length=64)
    # [{"name", "size", "digest": "sha256:<hex>", "browser_download_url"}], as the releases API lists them.
    assets = models.JSONField(_("assets"), default=list, blank=True)
    fetched_at = models.DateTimeField(_("fetched"), null=True, blank=True)
    error = models.CharField(_("last error"), max_length=1000, blank=True)
    # The releases API could not be reached at all (not: it answered that there is no such release).
    unreachable = models.BooleanField(_("unreachable"), default=False)
    tried_at = models.DateTimeField(_("last tried"), null=True, blank=True)

    class Meta:
        verbose_name = _("engine release")
        verbose_name_plural = _("engine releases")
        ordering = ["engine", "version"]
        constraints = [
            models.UniqueConstraint(fields=["engine", "version"], name="%(app_label)s_%(class)s_unique_engine_version"),
        ]

    def __str__(self) -> str:
        return f"{self.engine} {self.version}"


class AgentRequest(models.Model):
    """A question only a node's agent can answer (its fabric's map, a bandwidth test), kept as a row
    so it can be seen, waited for and tried again: pending until sent, then answered, failed or
    timed out."""

    class State(models.TextChoices):
        PENDING = "pending", _("pending")
        SENT = "sent", _("sent")
        ANSWERED = "answered", _("answered")
        FAILED = "failed", _("failed")
        TIMED_OUT = "timed_out", _("timed out")

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="requests", verbose_name=_("node"))
    kind = models.CharField(_("kind"), max_length=64)
    params = models.JSONField(_("parameters"), default=dict, blank=True)
    state = models.CharField(_("state"), max_length=16, choices=State.choices, default=State.PENDING, db_index=True)
    result = models.JSONField(_("result"), null=True, blank=True)
    error = models.TextField(_("error"), blank=True)
    timeout_s = models.PositiveIntegerField(_("timeout (s)"), default=300)
    # Several requests answered together (the two sides of a bandwidth test) share a group.
    group = models.CharField(_("group"), max_length=64, blank=True, db_index=True)
    retry_of = models.ForeignKey(
        "self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("retry of")
    )
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    sent_at = models.DateTimeField(_("sent"), null=True, blank=True)
    answered_at = models.DateTimeField(_("answered"), null=True, blank=True)

    class Meta:
        verbose_name = _("agent request")
        verbose_name_plural = _("agent requests")
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.kind} #{self.pk}"

    @property
    def request_id(self) -> str:
        return f"req-{self.pk}"
