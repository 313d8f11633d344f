"""The simulator as people reach it: the console page, the API and the cluster page's what-if
questions on the live fleet, which change nothing of it. Runs are queued by the web and run by
the worker (Celery's eager mode here) in a child process held to a memory and a time budget."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from typing import Any

import pytest
import yaml
from django.test import Client

from apps.accounts.choices import StaffRole
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Replica
from apps.sim.models import SimRun
from tests.builders import make_model, make_node
from tests.conftest import make_user
from tests.e2e.helpers import REPO
from tests.llmgw.test_csp import check_body, check_strict
from tests.sim.test_limits import TEN_MILLION_GPUS

pytestmark = pytest.mark.django_db

SCENARIO = """\
duration: 20m
node_types:
  l4: {gpus: {class: L4, count: 4}, cpus: 64, memory: 512GiB}
nodes:
  - {type: l4, count: 4, rack: {size: 2}}
models:
  - {name: chat, min: 3, max: 6, profiles: [{accelerator: L4, gpus: 2}]}
  - {name: huge, min: 1, profiles: [{accelerator: L4, gpus: 8}]}
events:
  - {at: 5m, lose: {rack: r01}}
report: {model: chat}
"""


def signed_in(role: str, email: str | None = None) -> Client:
    client = Client()
    client.force_login(make_user(email or f"{role}@example.com", role=role))
    return client


def operator_api(api: Any, key_for: Any, email: str = "op@example.com") -> Any:
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(make_user(email, role=StaffRole.OPERATOR))}")
    return api


def rss_bytes() -> int:
    """This process's resident memory now (not its peak)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


# Who may run simulations ------------------------------------------------------------------------


def test_a_viewer_is_told_who_runs_simulations_and_is_refused_in_the_console_and_the_api(
    api: Any, key_for: Any
) -> None:
    viewer = signed_in(StaffRole.VIEWER)
    page = viewer.get("/sim/").content.decode()
    assert "data-operators-only" in page and "Operators and administrators run simulations" in page
    assert 'action="/sim/runs"' not in page
    assert viewer.post("/sim/runs", {"scenario": SCENARIO}).status_code == 403
    assert viewer.post("/sim/what-if", {"rack": "r0"}).status_code == 403
    cluster = viewer.get("/cluster/").content.decode()
    assert "data-what-if=" not in cluster and "Operators and administrators ask these questions." in cluster
    mine = SimRun.objects.create(owner=make_user("op@example.com", role=StaffRole.OPERATOR), scenario=SCENARIO)
    assert viewer.get(f"/sim/runs/{mine.pk}").status_code == 403
    someone = make_user("v@example.com", role=StaffRole.VIEWER)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(someone)}")
    assert api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json").status_code == 403
    assert api.get(f"/api/v1/sim/{mine.pk}").status_code == 403
    assert SimRun.objects.count() == 1


# The console --------------------------------------------------------------------------------------


def test_an_operators_scenario_is_run_by_the_worker_and_the_page_polls_until_its_report(eager: Any) -> None:
    client = signed_in(StaffRole.OPERATOR)
    page = client.get("/sim/")
    assert page.status_code == 200 and b"node_types:" in page.content  # an example to start from
    with eager(execute=False) as commit:
        response = client.post("/sim/runs", {"scenario": SCENARIO})
    row = SimRun.objects.get()
    assert response.status_code == 302 and response["Location"] == f"/sim/runs/{row.pk}"
    assert row.state == SimRun.State.QUEUED and row.report is None  # the web answered without running it
    waiting = client.get(f"/sim/runs/{row.pk}").content.decode()
    assert "data-waiting" in waiting and 'hx-trigger="every 1s"' in waiting and "data-report" not in waiting
    for callback in commit:  # the commit: the worker takes the run
        callback()
    row.refresh_from_db()
    assert row.state == SimRun.State.DONE and row.started_at and row.finished_at
    polled = client.get(f"/sim/runs/{row.pk}", HTTP_HX_REQUEST="true")
    body = polled.content.decode()
    assert polled.status_code == 200 and "data-report" in body and "hx-trigger" not in body
    whole = client.get(f"/sim/runs/{row.pk}")
    check_body(whole, check_strict(whole, "/sim/runs/"), "/sim/runs/")
    # 4 nodes x 4 L4: chat's 3 replicas placed, "huge" (8 cards) fits no node and says why.
    # After rack r01 (two nodes) is lost, chat's three replicas fit on the two left: only huge waits.
    assert "data-end-pending>1<" in body
    pending = body[body.index("data-pending") :]
    assert "huge#" in pending and "needs 8" in pending and "<svg" in body
    assert "lose rack=r01" in body
    assert f'href="/sim/runs/{row.pk}"' in client.get("/sim/").content.decode()  # listed under the form


def test_a_wrong_scenario_says_where_and_keeps_what_was_typed() -> None:
    client = signed_in(StaffRole.OPERATOR)
    wrong = SCENARIO.replace("min: 3", "minimum: 3")
    response = client.post("/sim/runs", {"scenario": wrong})
    body = response.content.decode()
    assert response.status_code == 400 and "data-problems" in body and "data-report" not in body
    assert "models[0].minimum" in body and "min" in body  # the path, and what was meant
    assert "minimum: 3" in body  # nothing typed is lost
    assert not SimRun.objects.exists()


def test_ten_million_gpus_are_refused_at_once_with_the_numbers(api: Any, key_for: Any) -> None:
    page = signed_in(StaffRole.OPERATOR).post("/sim/runs", {"scenario": TEN_MILLION_GPUS})
    body = page.content.decode()
    assert page.status_code == 400 and "1,250,000 nodes is more than the 20,000 a run here may have" in body
    answer = operator_api(api, key_for).post("/api/v1/sim", {"scenario": TEN_MILLION_GPUS}, format="json")
    assert answer.status_code == 400
    assert answer.json()["errors"]["scenario"] == [
        "scenario.nodes: 1,250,000 nodes is more than the 20,000 a run here may have",
        "scenario.nodes: 10,000,000 GPUs is more than the 160,000 a run here may have",
    ]
    assert not SimRun.objects.exists()  # nothing was queued


# The API -------------------------------------------------------------------------------------------


def test_the_api_queues_a_scenario_and_gives_its_report_once_the_worker_ran_it(
    api: Any, key_for: Any, eager: Any
) -> None:
    operator_api(api, key_for)
    with eager(execute=False) as commit:
        queued = api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json")
    assert queued.status_code == 202, queued.content
    run = queued.json()
    assert run["state"] == "queued" and run["url"] == f"/api/v1/sim/{run['id']}" and run["report"] is None
    assert api.get(run["url"]).json()["state"] == "queued"
    for callback in commit:
        callback()
    done = api.get(run["url"])
    assert done.status_code == 200 and done.json()["state"] == "done" and done.json()["error"] == ""
    data = done.json()["report"]
    assert data["scenario"]["gpus"] == 16 and len(data["snapshots"]) == 3
    start, lost, end = data["snapshots"]
    assert lost["event"] == "lose rack=r01" and lost["nodes_ready"] == 2
    assert start["headroom"]["model"] == "chat" and [r["replica"].split("#")[0] for r in end["pending"]] == ["huge"]
    # Another operator does not see it; an administrator does.
    operator_api(api, key_for, "other@example.com")
    assert api.get(run["url"]).status_code == 404
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(make_user('a@example.com', role=StaffRole.ADMIN))}")
    assert api.get(run["url"]).json()["state"] == "done"
    wrong = api.post("/api/v1/sim", {"scenario": "duration: 1m\nnodes: [{type: nope, count: 1}]\n"}, format="json")
    assert wrong.status_code == 400
    assert wrong.json()["detail"] and any("nodes[0].type" in p for p in wrong.json()["errors"]["scenario"])
    both = api.post("/api/v1/sim", {}, format="json")
    assert both.status_code == 400 and both.json()["detail"]
    nul = api.post("/api/v1/sim", {"scenario": {**yaml.safe_load(SCENARIO), "start": "x\x00"}}, format="json")
    assert nul.status_code == 400


def test_one_person_may_have_a_few_runs_queued_and_at_most_n_run_at_once(
    api: Any, key_for: Any, eager: Any, settings: Any
) -> None:
    from apps.sim import runs

    settings.SIM_MAX_QUEUED_PER_PERSON = 2
    settings.SIM_CONCURRENT_RUNS = 1
    operator_api(api, key_for)
    with eager(execute=False):  # the commits' callbacks are left out: nothing starts
        first = api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json").json()
        assert api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json").status_code == 202
        third = api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json")
        assert third.status_code == 429
        assert third.json()["detail"] == (
            "You have 2 simulations queued or running, the most one person may have (2); wait for one to finish."
        )
        operator_api(api, key_for, "other@example.com")
        assert api.post("/api/v1/sim", {"what_if": {"kind": "node", "name": "n1"}}, format="json").status_code == 202
    # One runs (its worker busy with it): the others wait, however often the queue is looked at.
    SimRun.objects.filter(pk=first["id"]).update(state=SimRun.State.RUNNING)
    with eager(execute=True):
        assert runs.start_runs() == 0
    assert SimRun.objects.filter(state=SimRun.State.QUEUED).count() == 2
    # It ends: the next starts, and when that one ends the last.
    SimRun.objects.filter(pk=first["id"]).update(state=SimRun.State.DONE)
    with eager(execute=True):
        assert runs.start_runs() == 1
    assert not SimRun.objects.filter(state__in=[SimRun.State.QUEUED, SimRun.State.RUNNING]).exists()
    assert SimRun.objects.filter(state=SimRun.State.DONE).count() == 2  # the what-if, on no fleet, failed
    assert SimRun.objects.get(title__startswith="What if node").state == SimRun.State.FAILED


# The worker's budgets ------------------------------------------------------------------------------


def test_a_run_past_its_memory_budget_fails_with_the_reason_and_the_web_process_is_untouched(
    api: Any, key_for: Any, eager: Any, settings: Any
) -> None:
    settings.SIM_MEMORY_MB = 200
    # 5,000 models under a load of 1,000 points each: five million points to hold, far past 200 MiB.
    points = [{"at": f"{i}m", "rps": i % 7} for i in range(1000)]
    heavy = {
        "duration": "10m",
        "node_types": {"g": {"gpus": {"class": "L4", "count": 8}}},
        "nodes": [{"type": "g", "count": 10}],
        "models": [
            {
                "name": "m",
                "count": 5000,
                "min": 0,
                "max": 1,
                "profiles": [{"accelerator": "L4", "gpus": 1}],
                "load": {"replica_rps": 10, "points": points},
            }
        ],
    }
    limit, before = resource.getrlimit(resource.RLIMIT_AS), rss_bytes()
    operator_api(api, key_for)
    with eager(execute=False) as commit:
        queued = api.post("/api/v1/sim", {"scenario": heavy}, format="json")
    assert queued.status_code == 202, queued.content
    for callback in commit:
        callback()
    run = api.get(queued.json()["url"]).json()
    assert run["state"] == "failed" and run["report"] is None
    assert run["error"] == "the simulation passed its memory budget of 200 MiB"
    # It ran in a process of its own: this one is as it was.
    assert resource.getrlimit(resource.RLIMIT_AS) == limit
    assert rss_bytes() - before < 100 * 1024 * 1024


def test_a_run_past_its_time_budget_fails_with_the_reason(api: Any, key_for: Any, eager: Any, settings: Any) -> None:
    settings.SIM_SECONDS = 2
    large = {
        "duration": "1d",
        "node_types": {"g": {"gpus": {"class": "L4", "count": 8}}},
        "nodes": [{"type": "g", "count": 20000, "rack": {"size": 4, "pdus": 2}}],
        "models": [{"name": "m", "count": 2000, "min": 1, "max": 3, "profiles": [{"accelerator": "L4", "gpus": 2}]}],
    }
    operator_api(api, key_for)
    with eager(execute=True):
        queued = api.post("/api/v1/sim", {"scenario": large}, format="json")
    run = api.get(queued.json()["url"]).json()
    assert run["state"] == "failed" and run["error"] == "the simulation ran past its 2 s"


def test_a_run_whose_worker_stopped_fails_and_old_runs_are_removed(settings: Any) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from apps.sim import runs

    owner = make_user("op@example.com", role=StaffRole.OPERATOR)
    now = timezone.now()
    lost = SimRun.objects.create(
        owner=owner, state=SimRun.State.RUNNING, started_at=now - timedelta(seconds=settings.SIM_SECONDS + 600)
    )
    running = SimRun.objects.create(owner=owner, state=SimRun.State.RUNNING, started_at=now)
    old = SimRun.objects.create(owner=owner, state=SimRun.State.DONE, created_at=now - timedelta(days=2))
    runs.sweep()
    lost.refresh_from_db()
    assert lost.state == SimRun.State.FAILED and lost.error.startswith(
        "the worker running the simulation stopped before it finished (started "
    )
    assert SimRun.objects.get(pk=running.pk).state == SimRun.State.RUNNING
    assert not SimRun.objects.filter(pk=old.pk).exists()
    assert settings.CELERY_BEAT_SCHEDULE["sweep-sim-runs"]["task"] == "apps.sim.tasks.sweep_sim_runs"


# What-if questions of the live fleet ----------------------------------------------------------------


@pytest.fixture
def live() -> None:
    for i in range(6):
        make_node(f"gpu{i:02d}", gpus=8, address=f"10.0.0.{i + 1}", labels={"llmgw.io/rack": f"r{i // 3}"})
    make_model("chat", replicas=4, gpus=4)
    from apps.cluster.reconciler import reconcile

    reconcile()


def _state() -> list[Any]:
    replicas = Replica.objects.select_related("model").prefetch_related("shards__node")
    return sorted(
        (r.model.name, r.state, sorted((s.node.name, tuple(s.gpu_indices)) for s in r.shards.all())) for r in replicas
    ) + sorted((n.name, n.status, n.cordoned, n.drain_requested_at) for n in Node.objects.all())


def _asked(client: Client, eager: Any, **question: str) -> tuple[SimRun, str]:
    with eager(execute=True):
        response = client.post("/sim/what-if", question)
    assert response.status_code == 302, response.content
    row = SimRun.objects.get(pk=int(response["Location"].rsplit("/", 1)[1]))
    return row, client.get(response["Location"]).content.decode()


def test_what_if_from_the_cluster_page_runs_in_the_worker_and_changes_nothing(live: None, eager: Any) -> None:
    client = signed_in(StaffRole.OPERATOR)
    cluster = client.get("/cluster/").content.decode()
    for kind in ("node", "rack", "pdu", "model"):
        assert f'data-what-if="{kind}"' in cluster
    assert 'method="post" action="/sim/what-if"' in cluster
    before = _state()
    assert Replica.objects.filter(state=ReplicaState.PENDING).count() == 0
    row, rack = _asked(client, eager, rack="r0")
    assert row.state == SimRun.State.DONE and "What if rack r0 went away" in rack and "data-report" in rack
    assert "lose rack=r0" in rack  # three of six nodes gone: the snapshot after the event says so
    row, model = _asked(client, eager, model="chat", min="9")
    assert "What if the minimum of chat were 9" in model
    # 6 x 8 cards hold 12 replicas of 4: nine fit, and three more would still fit after.
    assert "data-end-pending>0<" in model
    row, unknown = _asked(client, eager, node="gpu99")
    assert row.state == SimRun.State.FAILED and "data-problems" in unknown and "gpu99" in unknown
    bad = client.post("/sim/what-if", {"model": "chat", "min": "lots"})
    assert bad.status_code == 400 and "whole number" in bad.content.decode()
    assert _state() == before


def test_what_if_through_the_api(live: None, api: Any, key_for: Any, eager: Any) -> None:
    operator_api(api, key_for)
    before = _state()
    with eager(execute=True):
        answer = api.post("/api/v1/sim", {"what_if": {"kind": "node", "name": "gpu00"}}, format="json")
        unknown = api.post("/api/v1/sim", {"what_if": {"kind": "rack", "name": "r9"}}, format="json")
    assert answer.status_code == 202, answer.content
    assert api.get(answer.json()["url"]).json()["report"]["snapshots"][1]["nodes_ready"] == 5
    failed = api.get(unknown.json()["url"]).json()
    assert failed["state"] == "failed" and any("r9" in p for p in failed["problems"])
    no_min = api.post("/api/v1/sim", {"what_if": {"kind": "model", "name": "chat"}}, format="json")
    assert no_min.status_code == 400 and "what_if" in no_min.json()["errors"]
    lots = api.post("/api/v1/sim", {"what_if": {"kind": "model", "name": "chat", "min": 10**9}}, format="json")
    assert lots.status_code == 400
    assert "1,000,000,000 replicas is more than the 20,000" in " ".join(lots.json()["errors"]["what_if"])
    assert _state() == before


# `llmgw sim` and the manual's examples -------------------------------------------------------------------


def test_llmgw_sim_from_cluster_starts_from_the_live_fleet(live: None, tmp_path: Any, capsys: Any) -> None:
    import json

    from llmgw.cli import main

    before = _state()
    scenario = tmp_path / "lose.yaml"
    scenario.write_text("duration: 10m\nevents:\n  - {at: 2m, lose: {rack: r1}}\nreport: {model: chat}\n")
    assert main(["sim", str(scenario), "--from-cluster", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    start, lost, _end = report["snapshots"]
    assert report["scenario"]["nodes"] == 6 and start["replicas"]["starting"] == 4  # as the database has them
    assert lost["nodes_ready"] == 3 and start["headroom"]["more_replicas"] == 8  # 48 cards, 16 held
    # Without the flag the file describes no nodes: refused, saying what is missing.
    assert main(["sim", str(scenario)]) == 2
    assert "describe at least one group of nodes" in capsys.readouterr().err
    assert _state() == before


def _manual_example(language: str) -> str:
    text = (REPO / "docs" / f"{language}sim.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example is not None
    return example.group(1)


def _llmgw_sim(path: str, cwd: Any) -> subprocess.CompletedProcess[str]:
    """`llmgw sim PATH` as the manual writes it: no flag, and no captures folder of the test's."""
    env = {k: v for k, v in os.environ.items() if k != "LLMGW_SIM_CAPTURES"}
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "sim", path], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize("language", ["", "tr/"])
def test_the_manuals_example_runs_as_written(language: str, tmp_path: Any) -> None:
    example = _manual_example(language)
    assert yaml.safe_load(example) == yaml.safe_load(_manual_example(""))
    (tmp_path / "example.yaml").write_text(example)
    done = _llmgw_sim("example.yaml", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "24 nodes, 160 GPUs, 11 models" in done.stdout and "lose: 4 nodes" in done.stdout


def test_the_shipped_small_scenario_runs_as_the_manual_says() -> None:
    assert "llmgw sim tests/sim/small.yaml" in (REPO / "docs" / "sim.md").read_text()
    done = _llmgw_sim("tests/sim/small.yaml", REPO)
    assert done.returncode == 0, done.stderr
    assert "4 nodes, 32 GPUs, 2 models" in done.stdout and "Preempted: 1 replicas" in done.stdout


def test_the_manuals_example_pasted_in_the_console_runs_as_written(eager: Any) -> None:
    client = signed_in(StaffRole.OPERATOR)
    with eager(execute=True):
        response = client.post("/sim/runs", {"scenario": _manual_example("")})
    assert response.status_code == 302, response.content
    row = SimRun.objects.get()
    assert row.state == SimRun.State.DONE, (row.error, row.problems)
    assert [s["label"] for s in row.report["snapshots"]][0] == "start" and len(row.report["snapshots"]) == 6
    assert row.report["snapshots"][0]["headroom"]["model"] == "chat"
