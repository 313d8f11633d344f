"""The node page and the nodes list: each node's engines with their versions, the engines (shards)
running on it with what they claim and use, and an hour of each model's cores, memory and queue."""

from __future__ import annotations

import html
import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.cluster import history, reports
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Shard
from tests.builders import GB, make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def signed_in(client: Client, user: Any) -> Client:
    client.force_login(user)
    return client


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).strip()


def row(content: bytes, attribute: str, value: str) -> str:
    found = re.search(rf'<tr {attribute}="{re.escape(value)}">(.*?)</tr>', content.decode(), re.S)
    assert found is not None, f"no row {attribute}={value}"
    return found.group(1)


def cell(content: bytes, attribute: str, value: str, column: str) -> str:
    found = re.search(rf'<td data-col="{column}"[^>]*>(.*?)</td>', row(content, attribute, value), re.S)
    assert found is not None, f"no {column} cell"
    return text(found.group(1))


def engines_field(content: bytes) -> str:
    found = re.search(r'data-field="engines"[^>]*>(.*?)</dd>', content.decode(), re.S)
    assert found is not None, "no engines on the page"
    return text(found.group(1))


def set_hardware(node: Node, **values: Any) -> None:
    """Change what the node's agent said at registration, keeping the rest."""
    hardware = {**node.hardware, **values}
    for key in [k for k, v in values.items() if v is ...]:
        hardware.pop(key)
    Node.objects.filter(pk=node.pk).update(hardware=hardware)


def set_sample(node: Node, **values: Any) -> None:
    Node.objects.filter(pk=node.pk).update(sample={**(node.sample or {}), **values}, sampled_at=timezone.now())


def heartbeat(node: Node, **values: Any) -> None:
    """A heartbeat as the agent connection's writer stores it (the row, and a point of the hour)."""
    reports.record_heartbeats({node.pk: ({**(node.sample or {}), **values}, timezone.now())})


# Engines and their versions -------------------------------------------------------------------------


def test_each_engine_is_shown_with_its_version_and_a_dash_where_the_node_gave_none(client: Client, viola) -> None:
    node = make_node("cpu1", engines=("llama.cpp", "vllm"))
    set_hardware(node, engine_versions={"llama.cpp": "b6500", "vllm": None})
    signed_in(client, viola)
    assert engines_field(client.get("/nodes/cpu1/").content) == "llama.cpp b6500, vllm -"
    listing = client.get("/nodes/").content
    assert cell(listing, "data-node", "cpu1", "engines") == "llama.cpp b6500, vllm -"
    assert 'title="llama.cpp b6500, vllm -"' in row(listing, "data-node", "cpu1")  # whole when clipped


def test_engines_without_any_versions_yet_show_dashes_for_the_versions(client: Client, viola) -> None:
    make_node("cpu1", engines=("llama.cpp",))  # an agent from before it reported versions
    assert engines_field(signed_in(client, viola).get("/nodes/cpu1/").content) == "llama.cpp -"


def test_a_node_with_no_engines_says_none_and_one_that_never_said_shows_a_dash(client: Client, viola) -> None:
    make_node("bare", engines=())
    silent = make_node("silent")
    set_hardware(silent, engines=...)
    signed_in(client, viola)
    assert engines_field(client.get("/nodes/bare/").content) == "none"
    assert engines_field(client.get("/nodes/silent/").content) == "-"
    listing = client.get("/nodes/").content
    assert cell(listing, "data-node", "bare", "engines") == "none"
    assert cell(listing, "data-node", "silent", "engines") == "-"


def test_malformed_engine_reports_are_read_for_what_they_say(client: Client, viola) -> None:
    node = make_node("odd")
    set_hardware(node, engines=["vllm", 7, None, "", "vllm"], engine_versions={"vllm": 19, "sglang": ""})
    assert engines_field(signed_in(client, viola).get("/nodes/odd/").content) == "7 -, vllm 19"


# The engines running on the node ---------------------------------------------------------------------


def test_the_running_engines_show_model_replica_state_port_and_what_each_claims_and_uses(client: Client, viola) -> None:
    node = make_node("cpu1")
    small = make_model("small", memory_gb=4, cores=2)
    big = make_model("big", memory_gb=16, cores=8)
    measured = make_replica(small, node, port=20001)
    unmeasured = make_replica(big, node, state=ReplicaState.STARTING, port=20002)
    set_sample(node, shards=[{"shard": f"r{measured.pk}s0", "cpu_cores": 2.5, "memory_bytes": 3 * GB}])
    content = signed_in(client, viola).get("/nodes/cpu1/").content
    shard = f"r{measured.pk}s0"
    assert cell(content, "data-shard", shard, "model") == "small"
    assert 'href="/models/small/"' in row(content, "data-shard", shard)
    assert cell(content, "data-shard", shard, "replica") == f"#{measured.pk}"
    assert cell(content, "data-shard", shard, "state") == "ready"
    assert cell(content, "data-shard", shard, "port") == "20001"
    assert cell(content, "data-shard", shard, "gpus") == "-"
    assert cell(content, "data-shard", shard, "cpu") == "2.5 of 2.0"
    assert "Uses more cores than it claims" in row(content, "data-shard", shard)
    assert cell(content, "data-shard", shard, "memory") == "3.0 GiB of 4.0 GiB"
    # Nothing measured for the starting one: "-", never 0.
    other = f"r{unmeasured.pk}s0"
    assert cell(content, "data-shard", other, "state") == "assigned"
    assert cell(content, "data-shard", other, "cpu") == "- of 8.0"
    assert cell(content, "data-shard", other, "memory") == "- of 16.0 GiB"


LLAMA_TAIL = [
    "gguf_init_from_file: failed to open GGUF file '/data/models/tiny.gguf' (No such file or directory)",
    "llama_model_load: error loading model: llama_model_loader: failed to load model from /data/models/tiny.gguf",
    "main: exiting due to model loading error",
]


def test_an_engine_that_exited_at_start_shows_its_exit_code_and_the_last_lines_of_its_log(
    client: Client, viola
) -> None:
    node = make_node("cpu1")
    replica = make_replica(make_model("tiny", memory_gb=1, cores=1), node, state=ReplicaState.STARTING)
    shard = f"r{replica.pk}s0"
    reports.record_report(
        node.pk,
        [
            {
                "shard": shard,
                "state": "failed",
                "exit_code": 1,
                "message": "engine exited with code 1 before it was ready",
                "log_tail": LLAMA_TAIL,
            }
        ],
    )
    content = signed_in(client, viola).get("/nodes/cpu1/").content.decode()
    failure = re.search(rf'<tr data-shard-failure="{shard}">(.*?)</tr>', content, re.S)
    assert failure is not None
    shown = text(failure.group(1))
    assert "exit code 1 · engine exited with code 1 before it was ready" in shown
    assert all(line in html.unescape(failure.group(1)) for line in LLAMA_TAIL)


def test_the_node_page_shows_what_its_agent_made_of_each_mirror_version(client: Client, viola) -> None:
    node = make_node("cpu1")
    folder = "/var/lib/llmgw/models/mirror/acme--tiny-GGUF/" + "c" * 40
    reason = f"{folder} is not inside this node's model_dirs (/home/me/var/models)"
    heartbeat(
        node,
        mirror=[
            {"version": 3, "dir": folder, "state": "refused", "message": reason},
            {"version": 4, "dir": "/data/models/mirror/acme--other/" + "d" * 40, "state": "held"},
        ],
    )
    content = signed_in(client, viola).get("/nodes/cpu1/").content
    assert html.unescape(text(row(content, "data-fetch", folder))) == f"{folder} refused {reason}"
    assert "held" in text(row(content, "data-fetch", "/data/models/mirror/acme--other/" + "d" * 40))


def test_a_stale_sample_measures_nothing(client: Client, viola) -> None:
    from datetime import timedelta

    node = make_node("cpu1")
    replica = make_replica(make_model("small", memory_gb=4, cores=2), node)
    Node.objects.filter(pk=node.pk).update(
        sample={**node.sample, "shards": [{"shard": f"r{replica.pk}s0", "cpu_cores": 1.0, "memory_bytes": GB}]},
        sampled_at=timezone.now() - timedelta(minutes=5),
    )
    content = signed_in(client, viola).get("/nodes/cpu1/").content
    assert cell(content, "data-shard", f"r{replica.pk}s0", "cpu") == "- of 2.0"


def test_a_gpu_engine_names_its_cards_and_a_stopping_deleted_models_engine_says_so(client: Client, viola) -> None:
    node = make_node("gpu1", gpus=2)
    model = make_model("qwen", gpus=2)
    replica = make_replica(model, node, gpu_indices=(0, 1))
    model.deleted_at = timezone.now()
    model.save(update_fields=["deleted_at"])
    replica.state = ReplicaState.STOPPING
    replica.save(update_fields=["state"])
    content = signed_in(client, viola).get("/nodes/gpu1/").content
    shard = f"r{replica.pk}s0"
    assert cell(content, "data-shard", shard, "gpus") == "0, 1"
    assert cell(content, "data-shard", shard, "model") == "qwen deleted"
    assert 'href="/models/qwen/"' not in row(content, "data-shard", shard)
    assert cell(content, "data-shard", shard, "state") == "ready stopping"


def test_a_node_running_nothing_says_so(client: Client, viola) -> None:
    make_node("idle")
    content = signed_in(client, viola).get("/nodes/idle/").content.decode()
    assert "No engine runs on this node." in content


def test_the_htmx_refresh_carries_the_running_engines(client: Client, viola) -> None:
    node = make_node("cpu1")
    replica = make_replica(make_model("small", cores=1), node)
    body = signed_in(client, viola).get("/nodes/cpu1/", headers={"HX-Request": "true"}).content.decode().strip()
    assert body.startswith('<div id="node-live"')
    assert f'data-shard="r{replica.pk}s0"' in body


# The hour of each model --------------------------------------------------------------------------------


def charts(content: bytes) -> dict[str, str]:
    """Each chart of the page by its title."""
    return {
        text(title): svg
        for title, svg in re.findall(r"<figcaption[^>]*>(.*?)</figcaption>(<svg.*?</svg>)", content.decode(), re.S)
    }


@pytest.fixture
def queue_requests(monkeypatch: Any) -> Iterator[Any]:
    """Put `count` requests waiting for a model in the gateway: in Redis's shared queue when there is
    Redis (taken out again after the test), else in this process's own."""
    from django.conf import settings

    from apps.gateway.asgi import gateway_app
    from apps.gateway.fairness import Who
    from apps.gateway.slots import SharedSlots

    client = history.client()
    keys: list[str] = []
    queued: list[tuple[str, Any]] = []

    def put(model: str, count: int) -> None:
        if client is None:
            queue = gateway_app.admission.queue
            queued.extend((model, queue.enter(model, Who(1, 1, 1, n), 0, 1.0)[0]) for n in range(count))
            return
        key = SharedSlots(None, prefix=settings.REDIS_PREFIX)._key("waiting", model)
        keys.append(key)
        expiry = (timezone.now().timestamp() + 60) * 1000
        client.zadd(key, {f"ticket-{i}": expiry for i in range(count)})

    yield put
    if keys:
        client.delete(*keys)
    for model, ticket in queued:
        gateway_app.admission.queue.leave(model, ticket)


def test_each_models_cores_memory_and_queue_are_charted_from_the_heartbeats(
    client: Client, viola, queue_requests
) -> None:
    node = make_node("cpu1")
    replica = make_replica(make_model("small", memory_gb=4, cores=2), node)
    shard = f"r{replica.pk}s0"
    queue_requests("small", 3)
    start = timezone.now().timestamp() - 300
    for step in range(4):
        heartbeat(
            node,
            taken_at=start + step * 10,
            shards=[{"shard": shard, "cpu_cores": 1.0 + step, "memory_bytes": (step + 1) * GB}],
        )
    points = history.sample_history(node.pk)
    assert points[-1]["models"] == {"small": [2.0, 4 * GB, 4.0, 4 * GB, 3]}

    found = charts(signed_in(client, viola).get("/nodes/cpu1/").content)
    cores = found["Cores of small: used, and claimed (dashed)"]
    memory = found["Memory of small: used, and claimed (dashed)"]
    queue = found["Requests waiting for small in the gateway"]
    for svg in (cores, memory, queue):
        assert "no data" not in svg
    assert 'stroke-dasharray="4 3"' in cores and 'stroke-dasharray="4 3"' in memory
    assert ">4 GiB<" in memory  # the axis runs to the largest figure, used and claimed alike
    assert ">3<" in queue


def test_a_failed_engine_keeps_its_claim_in_the_hour_and_a_released_one_drops_to_zero(monkeypatch) -> None:
    # A process without the gateway knows its queues only through Redis.
    monkeypatch.delitem(sys.modules, "apps.gateway.asgi", raising=False)
    queued = 0 if history.client() is not None else None
    node = make_node("cpu1")
    replica = make_replica(make_model("small", memory_gb=4, cores=2), node)
    now = timezone.now().timestamp()
    heartbeat(node, taken_at=now - 30, shards=[{"shard": f"r{replica.pk}s0", "cpu_cores": 1.5, "memory_bytes": GB}])
    replica.state = ReplicaState.FAILED
    replica.save(update_fields=["state"])
    heartbeat(node, taken_at=now - 20)  # the engine exited: nothing runs, the claim is held
    Shard.objects.filter(replica=replica).delete()
    heartbeat(node, taken_at=now - 10)  # released
    heartbeat(node, taken_at=now)  # nothing to read any more
    models = [point.get("models") for point in history.sample_history(node.pk)]
    assert models[0] == {"small": [2.0, 4 * GB, 1.5, GB, queued]}
    assert models[1] == {"small": [2.0, 4 * GB, None, None, queued]}
    assert models[2] == {}
    assert models[3] is None


def test_a_node_that_never_ran_an_engine_draws_no_model_charts(client: Client, viola) -> None:
    node = make_node("idle")
    heartbeat(node, taken_at=timezone.now().timestamp())
    assert "models" not in history.sample_history(node.pk)[-1]
    found = charts(signed_in(client, viola).get("/nodes/idle/").content)
    assert not any(title.startswith(("Cores of", "Memory of", "Requests waiting")) for title in found)
