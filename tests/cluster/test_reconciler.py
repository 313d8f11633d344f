"""The reconciler against the database: place, stop, retry, preempt, and never double-claim."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from apps.catalog.models import Model, Profile
from apps.cluster import actions, reports
from apps.cluster.choices import ReplicaState, ShardState
from apps.cluster.models import Node, Replica, Shard
from apps.cluster.reconciler import desired_shards, reconcile
from tests.builders import make_model, make_node


def claimed_gpus() -> list[tuple[int, int]]:
    return [(s.node_id, i) for s in Shard.objects.exclude(replica__state=ReplicaState.PENDING) for i in s.gpu_indices]


@pytest.mark.django_db
def test_it_places_the_wanted_replicas_on_distinct_gpus() -> None:
    node = make_node(gpus=8)
    make_model("big", replicas=3, gpus=2)
    report = reconcile()
    assert len(report.placed) == 3
    gpus = claimed_gpus()
    assert len(gpus) == 6 and len(set(gpus)) == 6
    assert set(Replica.objects.values_list("state", flat=True)) == {ReplicaState.STARTING}
    shards = desired_shards(node)
    assert len(shards) == 3 and all(len(s["gpu_indices"]) == 2 and s["api_key"] for s in shards)
    assert len({s["port"] for s in shards}) == 3


@pytest.mark.django_db
def test_a_model_that_fits_nowhere_stays_pending_with_reasons_and_costs_nothing_next_pass() -> None:
    make_node(gpus=0, memory_gb=8)
    make_model("huge", memory_gb=24, cores=1, engine="llama.cpp")
    reconcile()
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.PENDING
    reasons = " ".join(r["message"] for r in replica.rejections)
    assert "gpu1" in reasons and "24" in reasons and "8" in reasons
    with CaptureQueriesContext(connection) as queries:
        reconcile()
    writes = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE"))
        and "control_lock" not in q["sql"].lower()
        and "controllock" not in q["sql"].lower()
    ]
    assert writes == []


@pytest.mark.django_db
def test_lowering_the_target_stops_the_newest_and_releases_it_once_stopped() -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)
    reconcile()
    model.min_replicas = 1
    model.save(update_fields=["min_replicas"])
    reconcile()
    stopping = Replica.objects.get(state=ReplicaState.STOPPING)
    assert len(desired_shards(node)) == 1
    # The agent no longer runs it: its report leaves it out.
    kept = Replica.objects.exclude(pk=stopping.pk).get()
    reports.record_report(node.pk, [{"shard": f"r{kept.pk}s0", "state": "ready"}])
    reconcile()
    assert list(Replica.objects.values_list("pk", flat=True)) == [kept.pk]
    assert Replica.objects.get().state == ReplicaState.READY


@pytest.mark.django_db
def test_a_failed_engine_is_retried_after_a_growing_backoff() -> None:
    node = make_node(gpus=8)
    make_model("crashy", gpus=1)
    reconcile()
    replica = Replica.objects.get()
    reports.record_report(
        node.pk,
        [{"shard": f"r{replica.pk}s0", "state": "failed", "exit_code": 1, "log_tail": ["error: cannot open model"]}],
    )
    replica.refresh_from_db()
    assert replica.state == ReplicaState.FAILED and replica.failures == 1
    assert "code 1" in replica.message
    first_wait = replica.next_attempt_at - timezone.now()
    reconcile()  # too early: nothing moves
    assert Replica.objects.get().state == ReplicaState.FAILED
    reconcile(now=replica.next_attempt_at + timedelta(seconds=1))
    replica.refresh_from_db()
    assert replica.state == ReplicaState.STARTING
    reports.record_report(node.pk, [{"shard": f"r{replica.pk}s0", "state": "failed", "exit_code": 1}])
    replica.refresh_from_db()
    assert replica.failures == 2
    assert replica.next_attempt_at - timezone.now() > first_wait


@pytest.mark.django_db
def test_a_critical_model_preempts_an_opportunistic_one_and_holds_it_back() -> None:
    node = make_node(gpus=2)
    make_model("spare", replicas=1, gpus=2, capacity_class="opportunistic")
    reconcile()
    make_model("vital", replicas=1, gpus=2, capacity_class="critical")
    reconcile()
    # The victim stops; its model is held at once, its replacement left pending while held.
    victim = Replica.objects.exclude(state=ReplicaState.PENDING).get(model__name="spare")
    assert victim.state == ReplicaState.STOPPING
    assert Model.objects.get(name="spare").held_until is not None
    assert Replica.objects.get(model__name="vital").state == ReplicaState.PENDING
    reports.record_report(node.pk, [])  # the agent stopped it
    reconcile()
    reconcile()
    assert Replica.objects.get(model__name="vital").state == ReplicaState.STARTING
    assert not Replica.objects.filter(model__name="spare").exclude(state=ReplicaState.PENDING).exists()


@pytest.mark.django_db
def test_a_standard_model_at_its_minimum_is_never_preempted_by_its_own_class() -> None:
    make_node(gpus=2)
    make_model("first", replicas=1, gpus=2, capacity_class="standard")
    reconcile()
    make_model("second", replicas=1, gpus=2, capacity_class="standard")
    reconcile()
    assert Replica.objects.get(model__name="first").state == ReplicaState.STARTING
    assert Replica.objects.get(model__name="second").state == ReplicaState.PENDING


@pytest.mark.django_db(transaction=True)
def test_two_reconcilers_racing_never_double_claim() -> None:
    make_node(gpus=8)
    make_model("a", replicas=3, gpus=2)
    make_model("b", replicas=3, gpus=2)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(3):
                reconcile()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    gpus = claimed_gpus()
    assert len(gpus) == len(set(gpus)) == 8
    placed = Replica.objects.exclude(state=ReplicaState.PENDING).count()
    assert placed == 4 and Replica.objects.count() == 6


@pytest.mark.django_db
def test_reports_move_replicas_to_ready_and_keep_the_log_tail() -> None:
    node = make_node(gpus=8)
    make_model("m", gpus=1)
    reconcile()
    replica = Replica.objects.get()
    reports.record_report(node.pk, [{"shard": f"r{replica.pk}s0", "state": "ready", "pid": 4242}])
    replica.refresh_from_db()
    assert replica.state == ReplicaState.READY and replica.ready_at is not None
    assert Shard.objects.get().pid == 4242 and Shard.objects.get().state == ShardState.READY


def mark_ready(node: Node) -> None:
    shards = [
        {"shard": f"r{r.pk}s0", "state": "ready"}
        for r in Replica.objects.exclude(state=ReplicaState.STOPPING).exclude(state=ReplicaState.PENDING)
    ]
    reports.record_report(node.pk, shards)


def live_replicas() -> int:
    return Replica.objects.exclude(state=ReplicaState.STOPPING).count()


@pytest.mark.django_db
def test_a_busy_model_grows_one_ready_replica_at_a_time_up_to_its_maximum() -> None:
    from apps.catalog.services import record_busy

    node = make_node(gpus=8)
    model = make_model("m", replicas=1, gpus=1)
    Model.objects.filter(pk=model.pk).update(max_replicas=3)
    reconcile()
    mark_ready(node)

    assert record_busy("m")
    report = reconcile()
    assert live_replicas() == 2 and report.scaled == ["m: 1 → 2"]
    # Still busy while the new replica loads: no second step until it is ready and busy again.
    record_busy("m")
    reconcile()
    assert live_replicas() == 2
    mark_ready(node)
    reconcile()
    assert live_replicas() == 2, "the moment of busyness came before the new replica was ready"
    record_busy("m")
    reconcile()
    assert live_replicas() == 3
    mark_ready(node)
    record_busy("m")
    reconcile()
    assert live_replicas() == 3 and Model.objects.get().load_replicas == 3  # never past the maximum
    assert len(set(claimed_gpus())) == 3


@pytest.mark.django_db
def test_a_quiet_model_shrinks_one_step_per_quiet_spell_back_to_its_minimum(settings) -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=1, gpus=1)
    Model.objects.filter(pk=model.pk).update(max_replicas=3, load_replicas=3, busy_at=timezone.now())
    reconcile()
    mark_ready(node)
    assert live_replicas() == 3
    long_ago = timezone.now() - timedelta(seconds=settings.SCALE_DOWN_AFTER * 2)
    Model.objects.filter(pk=model.pk).update(busy_at=long_ago, scaled_at=long_ago)

    newest = Replica.objects.order_by("-created_at", "-pk").first()
    report = reconcile()
    assert live_replicas() == 2 and report.scaled == ["m: 3 → 2"]
    assert Replica.objects.get(state=ReplicaState.STOPPING).pk == newest.pk
    reconcile()
    assert live_replicas() == 2, "one step per quiet spell"
    Model.objects.filter(pk=model.pk).update(scaled_at=long_ago)
    reconcile()
    assert live_replicas() == 1 and Model.objects.get().load_replicas == 0


@pytest.mark.django_db
def test_a_model_that_may_not_grow_is_never_marked_busy() -> None:
    from apps.catalog.services import record_busy

    make_model("fixed", replicas=2, gpus=1)
    assert record_busy("fixed") is False
    assert record_busy("no-such-model") is False
    assert Model.objects.get().busy_at is None


@pytest.mark.django_db
def test_every_desired_shard_the_reconciler_makes_is_read_back_whole_by_the_agents_parser() -> None:
    from agent.protocol import DesiredShard

    nodes = [make_node("gpu1", gpus=8), make_node("gpu2", gpus=8), make_node("cpu1", gpus=0)]
    make_model("gpu-model", replicas=2, gpus=2)
    make_model("cpu-model", replicas=1, memory_gb=2, cores=2, engine="llama.cpp")
    tuned = make_model("tuned", replicas=1, gpus=4)
    Profile.objects.filter(model=tuned).update(
        extra_args=["--max-num-seqs", "8"], env={"NCCL_DEBUG": "INFO"}, context_size=8192, parallel=16
    )
    for index, node in enumerate(nodes):
        Node.objects.filter(pk=node.pk).update(address=f"10.0.0.{index + 1}")
    reconcile()
    produced = [item for node in Node.objects.all() for item in desired_shards(node)]
    assert len(produced) == 4
    for item in produced:
        parsed = DesiredShard.parse(item)
        assert parsed.to_message() == item  # nothing lost or changed on the way
    tuned_shard = next(DesiredShard.parse(i) for i in produced if i["model"] == "tuned")
    assert tuned_shard.env == {"NCCL_DEBUG": "INFO"} and tuned_shard.parallel == 16
    assert tuned_shard.stop_grace is not None


@pytest.mark.django_db
def test_a_broken_lock_table_fails_the_pass_loudly_instead_of_skipping_it(monkeypatch, caplog) -> None:
    from django.db import ProgrammingError

    from apps.cluster import reconciler

    def broken(*args, **kwargs):
        raise ProgrammingError('relation "cluster_controllock" does not exist')

    monkeypatch.setattr(reconciler.ControlLock.objects, "get_or_create", broken)
    failed = reconciler.PASSES.labels(result="failed")._value.get()
    with pytest.raises(ProgrammingError):
        reconcile()
    assert reconciler.PASSES.labels(result="failed")._value.get() == failed + 1
    assert "a reconciler pass failed" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_pass_that_finds_the_lock_held_is_skipped_and_counted() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises writers: there a second pass waits instead of being refused")
    from apps.cluster import reconciler

    reconciler.ControlLock.objects.get_or_create(name="reconciler")  # as after the first pass ever
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        from django.db import connection as own
        from django.db import transaction

        with transaction.atomic():
            reconciler._lock()
            held.set()
            release.wait(10)
        own.close()

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    skipped = reconciler.PASSES.labels(result="skipped")._value.get()
    try:
        assert reconcile().ran is False
    finally:
        release.set()
        holder.join(10)
    assert reconciler.PASSES.labels(result="skipped")._value.get() == skipped + 1
    assert reconcile().ran is True


@pytest.mark.django_db
def test_a_model_below_its_minimum_takes_back_a_replica_its_class_grew_into_under_load() -> None:
    node = make_node(gpus=2)
    grown = make_model("grown", replicas=1, gpus=1, capacity_class="standard")
    # Under load: two wanted, the gateway busy a moment ago.
    Model.objects.filter(pk=grown.pk).update(
        max_replicas=2, load_replicas=2, busy_at=timezone.now(), scaled_at=timezone.now()
    )
    reconcile()
    replicas = list(Replica.objects.filter(model=grown).order_by("created_at", "pk"))
    assert [r.state for r in replicas] == [ReplicaState.STARTING] * 2
    assert [r.above_minimum for r in replicas] == [False, True]  # the second was added for load
    make_model("newcomer", replicas=1, gpus=1, capacity_class="standard")
    reconcile()
    replicas = list(Replica.objects.filter(model=grown).order_by("created_at", "pk"))
    assert [r.state for r in replicas] == [ReplicaState.STARTING, ReplicaState.STOPPING]
    held = Model.objects.get(name="grown")
    assert held.held_for == Model.objects.get(name="newcomer") and held.held_until is not None
    reports.record_report(node.pk, [{"shard": f"r{replicas[0].pk}s0", "state": "ready"}])  # the agent stopped it
    reconcile()
    reconcile()
    assert Replica.objects.get(model__name="newcomer").state == ReplicaState.STARTING
    # The room it gave up is used: the hold is lifted at once, not after a fixed time, and the
    # grown model waits for room as any pending replica does, without taking its minimum back.
    released = Model.objects.get(name="grown")
    assert released.held_for is None and released.held_until is None
    running = (ReplicaState.STARTING, ReplicaState.READY)
    assert Replica.objects.filter(model=grown, state__in=running).count() == 1
    assert Replica.objects.filter(model__name="newcomer", state__in=running).count() == 1


def _report_ready(replica: Replica) -> None:
    """What the agent says once the engines of every shard of the replica answer."""
    for shard in replica.shards.all():
        reports.record_report(
            shard.node_id,
            [
                {"shard": s.shard_id, "state": "ready"}
                for s in Shard.objects.filter(node_id=shard.node_id)
                if s.replica.state != ReplicaState.STOPPING
            ],
        )


@pytest.mark.django_db
def test_a_changed_profile_is_rolled_out_replacement_first_within_the_maximum() -> None:
    from apps.accounts.models import AuditEvent

    node = make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)
    Model.objects.filter(pk=model.pk).update(max_replicas=3)
    reconcile()
    for replica in Replica.objects.filter(model=model):
        _report_ready(replica)
    old = set(Replica.objects.filter(model=model).values_list("pk", flat=True))
    assert all("--max-num-seqs" not in str(s["extra_args"]) for s in desired_shards(node))
    Profile.objects.filter(model=model).update(extra_args=["--max-num-seqs", "4"])
    reconcile()
    replacement = Replica.objects.get(model=model, replaces__isnull=False)
    assert replacement.replaces_id in old
    # The old replicas run on with their command line: nothing is restarted in place.
    assert sum("--max-num-seqs" in s["extra_args"] for s in desired_shards(node)) == 1
    from apps.cluster.model_selectors import model_status, models_with_replicas

    assert model_status(models_with_replicas().get(pk=model.pk))["rolling"] == {"done": 0, "of": 2}
    for _step in range(6):  # each replacement gets ready; its old replica stops and is released
        for replica in Replica.objects.filter(model=model).exclude(state=ReplicaState.STOPPING):
            _report_ready(replica)
        reports.record_report(
            node.pk,
            [
                {"shard": s.shard_id, "state": "ready"}
                for s in Shard.objects.filter(node=node, replica__state__in=(ReplicaState.STARTING, ReplicaState.READY))
            ],
        )
        reconcile()
    running = Replica.objects.filter(model=model).exclude(state=ReplicaState.STOPPING)
    assert running.count() == 2 and not (set(running.values_list("pk", flat=True)) & old)
    assert all(s["extra_args"] == ["--max-num-seqs", "4"] for s in desired_shards(node))
    assert model_status(models_with_replicas().get(pk=model.pk))["rolling"] is None
    actions = list(AuditEvent.objects.filter(action__startswith="replica.roll").values_list("action", flat=True))
    assert actions.count("replica.roll_start") == 2 and actions.count("replica.rolled") == 2


@pytest.mark.django_db
def test_without_room_a_replica_is_replaced_in_place_one_at_a_time() -> None:
    node = make_node(gpus=1)
    model = make_model("solo", replicas=1, gpus=1)  # min = max = 1, and one GPU in all
    reconcile()
    first = Replica.objects.get(model=model)
    _report_ready(first)
    Profile.objects.filter(model=model).update(parallel=8)
    reconcile()
    assert Replica.objects.get(pk=first.pk).state == ReplicaState.STOPPING
    waiting = Replica.objects.exclude(pk=first.pk).get(model=model)
    assert waiting.state == ReplicaState.PENDING
    reports.record_report(node.pk, [])  # the old engine stopped
    reconcile()
    reconcile()
    replacement = Replica.objects.get(pk=waiting.pk)
    assert replacement.state == ReplicaState.STARTING and replacement.spec["parallel"] == 8


@pytest.mark.django_db
def test_a_replacement_that_fails_stops_the_roll_and_the_old_replica_keeps_serving() -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=1, gpus=1)
    Model.objects.filter(pk=model.pk).update(max_replicas=2)
    reconcile()
    first = Replica.objects.get(model=model)
    _report_ready(first)
    Profile.objects.filter(model=model).update(extra_args=["--no-such-flag"])
    reconcile()
    replacement = Replica.objects.get(model=model, replaces=first)
    reports.record_report(
        node.pk,
        [
            {"shard": first.shards.get().shard_id, "state": "ready"},
            {
                "shard": replacement.shards.get().shard_id,
                "state": "failed",
                "exit_code": 2,
                "message": "unknown argument: --no-such-flag",
            },
        ],
    )
    reconcile()
    assert Replica.objects.get(pk=first.pk).state == ReplicaState.READY
    assert "rolling change stopped" in Replica.objects.get(pk=first.pk).message
    assert Replica.objects.filter(model=model).count() == 2  # no further replacement while it fails


def _all_ready() -> None:
    for node in Node.objects.all():
        reports.record_report(
            node.pk,
            [
                {"shard": s.shard_id, "state": "ready"}
                for s in Shard.objects.filter(node=node, replica__state__in=(ReplicaState.STARTING, ReplicaState.READY))
            ],
        )


@pytest.mark.django_db
def test_a_drain_moves_each_replica_elsewhere_first_then_stops_it() -> None:
    first, second = make_node("a", gpus=2), make_node("b", gpus=2)
    model = make_model("m", replicas=1, gpus=1)
    reconcile()
    on_a = Replica.objects.get(model=model)
    if on_a.shards.get().node_id != first.pk:  # the test drains whichever node it landed on
        first, second = second, first
    _all_ready()
    actions.drain_node(Node.objects.get(pk=first.pk), grace=30, actor=None)
    reconcile()
    replacement = Replica.objects.get(model=model, replaces=on_a)
    assert replacement.shards.get().node_id == second.pk
    assert Replica.objects.get(pk=on_a.pk).state == ReplicaState.READY  # still serving meanwhile
    status = actions.drain_status(Node.objects.get(pk=first.pk))
    assert status is not None and status["left"] == 1 and status["replicas"][0]["state"] == "moving"
    _all_ready()
    reconcile()
    assert Replica.objects.get(pk=on_a.pk).state == ReplicaState.STOPPING
    assert [s["stop_grace"] for s in desired_shards(Node.objects.get(pk=first.pk))] == []  # nothing wanted there
    reports.record_report(first.pk, [])
    reconcile()
    assert actions.drain_status(Node.objects.get(pk=first.pk))["left"] == 0  # type: ignore[index]
    assert Node.objects.get(pk=first.pk).cordoned


@pytest.mark.django_db
def test_a_drain_with_no_room_elsewhere_waits_and_says_why_unless_forced() -> None:
    node = make_node("only", gpus=1)
    model = make_model("m", replicas=1, gpus=1)
    reconcile()
    replica = Replica.objects.get(model=model)
    _all_ready()
    actions.drain_node(Node.objects.get(pk=node.pk), actor=None)
    reconcile()
    reconcile()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY  # waits: nowhere to go
    status = actions.drain_status(Node.objects.get(pk=node.pk))
    assert status is not None and status["left"] == 1 and status["replicas"][0]["reasons"]
    assert any("only" in reason for reason in status["replicas"][0]["reasons"])
    actions.drain_node(Node.objects.get(pk=node.pk), force=True, actor=None)
    reconcile()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.STOPPING


@pytest.mark.django_db
def test_uncordoning_ends_a_drain() -> None:
    node = make_node("only", gpus=1)
    make_model("m", replicas=1, gpus=1)
    reconcile()
    _all_ready()
    actions.drain_node(Node.objects.get(pk=node.pk), actor=None)
    reconcile()
    actions.uncordon_node(Node.objects.get(pk=node.pk), actor=None)
    reconcile()
    reconcile()
    assert actions.drain_status(Node.objects.get(pk=node.pk)) is None
    running = Replica.objects.exclude(state__in=(ReplicaState.STOPPING, ReplicaState.PENDING))
    assert running.count() == 1


def _holds(node: Node, directory: str, *sources: str) -> None:
    """The node's storage as its agent reports it: a model directory and the sources held there."""
    Node.objects.filter(pk=node.pk).update(
        sample={
            **(node.sample or {}),
            "storage": [
                {
                    "mount_point": "/",
                    "fstype": "ext4",
                    "shared": False,
                    "total_bytes": 10**12,
                    "free_bytes": 10**11,
                    "directories": [directory],
                    "weights": list(sources),
                    "held": [{"path": s, "bytes": 1000} for s in sources],
                }
            ],
        }
    )


@pytest.mark.django_db
def test_a_replica_goes_to_the_node_that_holds_its_source() -> None:
    first, second = make_node("a", gpus=0), make_node("b", gpus=0)
    _holds(first, "/models")
    _holds(second, "/models", "/models/cpu-model")
    make_model("cpu-model", replicas=1, memory_gb=1, cores=1, engine="llama.cpp")  # its source: /models/cpu-model
    reconcile()
    assert Replica.objects.get().shards.get().node_id == second.pk


@pytest.mark.django_db
def test_a_local_source_a_node_does_not_hold_is_a_refusal_naming_the_path() -> None:
    node = make_node("n3", gpus=0)
    _holds(node, "/models", "/models/other.gguf")
    make_model("cpu-model", replicas=1, memory_gb=1, cores=1, engine="llama.cpp")
    reconcile()
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.PENDING
    assert "/models/cpu-model is not on node n3" in [r["message"] for r in replica.rejections]


@pytest.mark.django_db
def test_a_replica_is_not_placed_on_a_node_that_refused_to_fetch_its_weights_and_the_refusal_says_why() -> None:
    """The agent's word on each mirror version it was told to keep comes with its heartbeat: a
    version it refused (outside its model_dirs, which it then reports no weights for) keeps the
    replica pending with the agent's reason, where before it was placed and crash-looped."""
    node = make_node("vm", gpus=0)
    _holds(node, "/home/me/llmgw/var/models")
    folder = "/var/lib/llmgw/models/mirror/acme--tiny-GGUF/" + "c" * 40
    reason = f"{folder} is not inside this node's model_dirs (/home/me/llmgw/var/models)"
    sample = Node.objects.get(pk=node.pk).sample
    sample["mirror"] = [{"version": 3, "dir": folder, "state": "refused", "message": reason}]
    Node.objects.filter(pk=node.pk).update(sample=sample)
    model = make_model("tiny", replicas=1, memory_gb=1, cores=1, engine="llama.cpp")
    Model.objects.filter(pk=model.pk).update(source=folder + "/tiny-F32.gguf")
    reconcile()
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.PENDING
    assert f"node vm refused to fetch {folder}/tiny-F32.gguf: {reason}" in [r["message"] for r in replica.rejections]

    # Once it holds the file (its directory is then inside model_dirs), the replica is placed.
    _holds(Node.objects.get(pk=node.pk), "/var/lib/llmgw/models", folder + "/tiny-F32.gguf")
    sample = Node.objects.get(pk=node.pk).sample
    sample["mirror"] = [{"version": 3, "dir": folder, "state": "held"}]
    Node.objects.filter(pk=node.pk).update(sample=sample)
    reconcile()
    assert Replica.objects.get().shards.get().node_id == node.pk


@pytest.mark.django_db
def test_a_source_in_a_model_directory_whose_scan_stopped_short_is_unknown_not_refused() -> None:
    node = make_node("vm", gpus=0)
    _holds(node, "/models", "/models/other.gguf")
    sample = Node.objects.get(pk=node.pk).sample
    sample["storage"][0]["partial"] = ["/models"]
    Node.objects.filter(pk=node.pk).update(sample=sample)
    make_model("cpu-model", replicas=1, memory_gb=1, cores=1, engine="llama.cpp")
    reconcile()
    assert Replica.objects.get().shards.get().node_id == node.pk


@pytest.mark.django_db
def test_a_model_from_the_mirror_waits_for_its_node_to_say_it_holds_the_version(settings) -> None:
    """Between the model's declaration and the node's next heartbeat the node has said nothing of
    the version; a node whose model_dirs do not hold the directory never lists it. Neither is a
    reason to place the replica there and let its engine fail on a file that is not there."""
    settings.MIRROR_NODE_DIR = "/var/lib/llmgw/models/mirror"
    folder = settings.MIRROR_NODE_DIR + "/acme--tiny-GGUF/" + "c" * 40
    node = make_node("vm", gpus=0)
    _holds(node, "/home/me/llmgw/var/models")  # the mirror's directory lies outside it
    model = make_model("tiny", replicas=1, memory_gb=1, cores=1, engine="llama.cpp")
    Model.objects.filter(pk=model.pk).update(source=folder + "/tiny-F32.gguf")
    reconcile()
    replica = Replica.objects.get()
    assert replica.state == ReplicaState.PENDING
    source = folder + "/tiny-F32.gguf"
    assert f"node vm has not fetched {source} from the mirror yet" in [r["message"] for r in replica.rejections]

    sample = Node.objects.get(pk=node.pk).sample
    sample["mirror"] = [{"version": 3, "dir": folder, "state": "fetching", "message": "tiny-F32.gguf"}]
    Node.objects.filter(pk=node.pk).update(sample=sample)
    reconcile()
    replica = Replica.objects.get()
    assert f"{source} is not on node vm yet: it is fetching tiny-F32.gguf" in [r["message"] for r in replica.rejections]

    sample["mirror"] = [{"version": 3, "dir": folder, "state": "held"}]  # every file verified by the agent
    Node.objects.filter(pk=node.pk).update(sample=sample)
    reconcile()
    assert Replica.objects.get().shards.get().node_id == node.pk
