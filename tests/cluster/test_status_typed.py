"""A node's stored heartbeat sample read back checked (apps.cluster.samples.read_sample), and the
read sites that go through it.

A sample the agent really sends (each captured host's, as agent.main sends it) reads back as the
very object stored: nothing is copied or changed. A stored value of the wrong type (NaN, a string
where a number goes, a fraction where a whole number goes, a record without its required key) is
left out, as a key the agent did not send: unknown, never 0, and never a crash.
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from agent.messages import HeartbeatSample
from apps.cluster import held, inventory, metrics, model_views
from apps.cluster.models import Node, Shard
from apps.cluster.placement import NODE_STATUS, NodeSnapshot
from apps.cluster.samples import compile_check, read_sample
from tests.agent.test_message_types import samples  # noqa: F401 (the captured hosts' heartbeats, a fixture)
from tests.builders import make_model, make_node, make_replica, node_sample
from tests.cluster.test_sample_reads import Read, Recording, _undeclared, _value

NAN, INF = float("nan"), float("inf")


# Real heartbeats ----------------------------------------------------------------------------


def test_every_captured_hosts_heartbeat_reads_back_as_it_was_sent(
    samples: dict[str, tuple[dict[str, Any], HeartbeatSample]],  # noqa: F811
) -> None:
    assert samples
    for host, (_hardware, sample) in samples.items():
        stored = json.loads(json.dumps(sample))  # as the row gives it back
        assert read_sample(stored) is stored, host  # nothing copied
        assert stored == json.loads(json.dumps(sample)), host  # nothing changed
        assert read_sample(sample) is sample, host


def test_the_builders_sample_reads_back_as_it_is() -> None:
    sample = node_sample(gpus=8)
    assert read_sample(sample) is sample


# Bad values ---------------------------------------------------------------------------------


def gpu(**figures: Any) -> dict[str, Any]:
    return {"index": 0, "gpu_class": "H100-80GB", "power_draw_w": 120.5, **figures}


@pytest.mark.parametrize(
    ("sample", "read"),
    [
        # Numbers: NaN, infinities, strings, booleans and lists are not numbers.
        ({"cpu_utilization_pct": NAN, "cpus": 8}, {"cpus": 8}),
        ({"cpu_utilization_pct": INF}, {}),
        ({"cpu_utilization_pct": -INF}, {}),
        ({"cpu_utilization_pct": "12.5"}, {}),
        ({"cpu_utilization_pct": True}, {}),
        ({"cpu_utilization_pct": [12.5]}, {}),
        ({"cpu_utilization_pct": 12}, {"cpu_utilization_pct": 12}),  # a whole number is a number
        # Whole numbers: not a fraction, not a string, not a boolean.
        ({"cpus": 8.5}, {}),
        ({"cpus": "8"}, {}),
        ({"cpus": False}, {}),
        ({"memory_total_bytes": None}, {"memory_total_bytes": None}),  # null is allowed: unknown
        ({"taken_at": "now"}, {}),
        # A list of plain values with one bad item goes whole (the load averages' positions mean something).
        ({"load": [1.5, NAN, 1.0]}, {}),
        ({"load": "1.5 1.2 1.0"}, {}),
        ({"load": [1.5, 1.2, 1.0]}, {"load": [1.5, 1.2, 1.0]}),
        ({"warnings": ["disk", 7]}, {}),
        # A GPU's figure that is bad is left out; the GPU and its other figures stay.
        ({"gpus": [gpu(power_draw_w=NAN)]}, {"gpus": [{"index": 0, "gpu_class": "H100-80GB"}]}),
        ({"gpus": [gpu(temperature_gpu_c="hot")]}, {"gpus": [gpu()]}),
        ({"gpus": [gpu(memory_total_mib=81559.5)]}, {"gpus": [gpu()]}),
        ({"gpus": [gpu(gpu_class=80)]}, {"gpus": [{"index": 0, "power_draw_w": 120.5}]}),
        ({"gpus": [gpu(xids={"79": 2, "13": "x", "48": NAN})]}, {"gpus": [gpu(xids={"79": 2})]}),
        ({"gpus": [gpu(throttle_reasons="idle")]}, {"gpus": [gpu()]}),
        (
            {"gpus": [gpu(fabric={"state": "Completed", "clique_id": "1"})]},
            {"gpus": [gpu(fabric={"state": "Completed"})]},
        ),
        # A GPU without its index (or not an object) is left out; the others stay.
        ({"gpus": [{"gpu_class": "H100-80GB"}, gpu(index=1)]}, {"gpus": [gpu(index=1)]}),
        ({"gpus": [gpu(index="0"), gpu(index=1)]}, {"gpus": [gpu(index=1)]}),
        ({"gpus": [gpu(index=True)]}, {"gpus": []}),
        ({"gpus": ["H100", None, gpu(index=2)]}, {"gpus": [gpu(index=2)]}),
        ({"gpus": {"0": gpu()}}, {}),
        # The other records the same way: a shard without its id, a mirror entry without its state.
        ({"shards": [{"cpu_cores": 1.5}, {"shard": "r1s0", "cpu_cores": "1.5"}]}, {"shards": [{"shard": "r1s0"}]}),
        (
            {"shards": [{"shard": "r1s0", "engine": {"requests_running": 2.0, "kv_cache_usage": NAN}}]},
            {"shards": [{"shard": "r1s0", "engine": {"requests_running": 2.0}}]},
        ),
        (
            {"mirror": [{"version": 7, "dir": "/m/v7"}, {"version": None, "dir": "/m/v8", "state": "held"}]},
            {"mirror": [{"version": None, "dir": "/m/v8", "state": "held"}]},
        ),
        (
            {"storage": [{"mount_point": "/models", "free_bytes": -INF, "shared": "yes"}]},
            {"storage": [{"mount_point": "/models"}]},
        ),
        ({"storage": "/models"}, {}),
        ({"imex": {"installed": "yes", "state": "UP"}}, {}),
        ({"imex": None}, {"imex": None}),
        (
            {"ib_ports": [{"device": "mlx5_0", "port": 1, "rate_gbps": "400", "up": 1}]},
            {"ib_ports": [{"device": "mlx5_0", "port": 1}]},
        ),
        # Keys no type declares (a newer agent's) are kept as they are: no reader names them.
        ({"cpus": 8, "future": {"x": [1]}}, {"cpus": 8, "future": {"x": [1]}}),
        ({}, {}),
    ],
)
def test_a_bad_value_is_left_out_never_made_zero(sample: dict[str, Any], read: dict[str, Any]) -> None:
    before = copy.deepcopy(sample)
    assert read_sample(sample) == read
    assert repr(sample) == repr(before)  # what was stored is not changed (repr: NaN is not equal to itself)


@pytest.mark.parametrize("raw", [None, [], ["cpus"], "sample", 7, 1.5, True])
def test_what_is_not_an_object_is_no_sample(raw: object) -> None:
    assert read_sample(raw) is None


def test_only_the_records_that_needed_it_are_copied() -> None:
    good, bad = gpu(index=0), gpu(index=1, power_draw_w=NAN)
    pool = {"mount_point": "/models", "free_bytes": 1}
    sample = {"gpus": [good, bad], "storage": [pool]}
    read = read_sample(sample)
    assert read is not None and read is not sample
    assert read["gpus"][0] is good and read["gpus"][1] == {"index": 1, "gpu_class": "H100-80GB"}
    assert read["storage"] is sample["storage"]


def test_every_type_of_the_sample_has_a_check() -> None:
    """compile_check refuses a type it cannot check: a key added to agent.messages with a new kind of
    type fails here, not on the first sample that carries it."""
    compile_check(HeartbeatSample)
    with pytest.raises(TypeError):
        compile_check(int | str)
    with pytest.raises(TypeError):
        compile_check(set[int])


# The read sites -----------------------------------------------------------------------------


def test_the_node_reads_its_sample_checked() -> None:
    now = timezone.now()
    node = Node(
        sample={"cpus": "8", "memory_total_bytes": 2.5, "gpus": [{"name": "no index"}, gpu(power_draw_w=NAN)]},
        sampled_at=now,
        hardware={"cpus": 16, "memory_total_bytes": 1024},
    )
    # A bad figure of the sample is unknown: the registration's stands (before: int("8"), int(2.5)).
    assert node.cpus == 16
    assert node.memory_total_bytes == 1024
    assert node.fresh_sample(now) == node.latest_sample == {"gpus": [{"index": 0, "gpu_class": "H100-80GB"}]}
    assert Node(sample=["x"], sampled_at=now).fresh_sample(now) is None
    assert Node(sample=None, sampled_at=now).latest_sample is None


@pytest.mark.django_db
def test_a_shard_whose_engine_use_is_nan_reads_unknown() -> None:
    node = make_node("cpu1")
    replica = make_replica(make_model("small", memory_gb=4, cores=2), node)
    shard = Shard.objects.select_related("node").get(replica=replica)
    now = timezone.now()
    shard.node.sample = {"shards": [{"shard": shard.shard_id, "cpu_cores": NAN, "memory_bytes": 3 * 2**30}]}
    shard.node.sampled_at = now
    assert model_views._measured([shard], now) == (None, 3 * 2**30)  # before: (nan, ...)


@pytest.mark.django_db
def test_the_metrics_leave_out_a_card_without_an_index_and_a_figure_of_the_wrong_type(client: Client) -> None:
    sample = node_sample(gpus=1)
    sample["gpus"][0]["power_draw_w"] = "120.5"
    sample["gpus"].append({"gpu_class": "H100-80GB", "utilization_gpu_pct": 50.0})  # no index
    sample["load"] = [1.5, "high", 1.0]
    make_node("gpu1", gpus=1, sample=sample)
    text = client.get("/metrics").content.decode()
    assert 'llmgw_gpu_utilization_percent{class="H100-80GB",gpu="0",node="gpu1"' in text
    assert 'gpu="None"' not in text  # before: the card without an index was exported as GPU "None"
    assert "llmgw_gpu_power_draw_watts{" not in text
    assert "llmgw_node_load{" not in text  # before: the 1 and 15 minute loads, the 5 minute one missing


@pytest.mark.django_db
def test_the_snapshot_carries_the_nodes_status_through_its_typed_field() -> None:
    make_node("gpu1", gpus=1)
    make_node("gpu2", gpus=1, sample_age=timedelta(minutes=10))
    built = {n.name: n for n in inventory.build_inventory().nodes.values()}
    assert NODE_STATUS.get(built["gpu1"]) == "ready"
    assert NODE_STATUS.get(built["gpu2"]) == "unreachable"
    assert NODE_STATUS.get(NodeSnapshot(id=1, name="x")) is None


# What the read sites read -------------------------------------------------------------------


@pytest.mark.django_db
def test_the_metrics_power_held_time_and_fabrics_read_declared_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """As tests/cluster/test_sample_reads.py for the other readers of a stored sample: mypy does not
    see a key they read through a name (the metrics' tables of figures) or .get()."""
    from apps.fabrics import metrics as fabric_metrics
    from apps.fabrics import services as fabrics
    from apps.facility import power
    from llmgw.metrics import Exposition

    reads: set[Read] = set()
    sample = _value(HeartbeatSample, reads)
    card = Recording({**sample["gpus"][0], "index": 0, "parent": None}, "GpuFigures", reads)
    sample["gpus"].append(card)  # _value's device is a slice (its parent is set): a card as well
    row = metrics.NodeRow(1, "n1", True, False, sample, "domain")
    metrics.NodeLines(Exposition(), lambda *args: None).node(row)
    monkeypatch.setattr(fabric_metrics, "scrape_nodes", lambda: [row])
    monkeypatch.setattr(fabric_metrics, "_fabric_lines", lambda out: None)
    fabric_metrics.FabricCollector().text()
    power.slices_of(sample)
    power._measured(sample)
    held._power(sample, SimpleNamespace(gpu_indices=[0, 1], cpu_cores=1.0), {})
    held._power(sample, SimpleNamespace(gpu_indices=[], cpu_cores=1.0), {})
    monkeypatch.setattr(Node, "latest_sample", property(lambda self: sample))
    monkeypatch.setattr(Node, "fresh_sample", lambda self, now=None, max_age=None: sample)
    node = make_node("n1")
    inventory.held_weights(node)
    fabrics.node_ports(node)
    model_views._sample_shards(node, timezone.now())
    expected = {
        ("GpuFigures", "power_draw_w"),  # the metrics' table of a card's figures, power, held time
        ("GpuFigures", "share"),  # a slice's
        ("IbPortFigures", "rate_gbps"),
        ("GpuFabric", "cluster_uuid"),
        ("StoragePoolFigures", "weights"),
        ("ShardFigures", "shard"),
        ("HeartbeatSample", "cpu_package_power_w"),
    }
    assert expected <= reads
    assert _undeclared(reads) == []
