"""The alert rules in deploy/prometheus, checked by the real tools: `promtool check rules`, their unit
tests (`promtool test rules`: each alert fires on its condition, not on its neighbour), `promtool
check metrics` on what llmgw's /metrics says of a captured fleet, and Debian's Prometheus scraping a
running llmgw and evaluating every rule against it.

The tools come with Debian's `prometheus` package (.ci/run installs it); without them the tests are
skipped, saying so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.utils import timezone

from agent.engine_metrics import normalise, parse_exposition
from agent.probes.nvidia import parse_nvidia_smi_text
from agent.probes.xid import count_xids, parse_xid_lines
from agent.sampler import _gpu_dict
from tests.e2e.helpers import REPO, free_port

FIXTURES = REPO.parent / "shared" / "fixtures"
RULES = REPO / "deploy" / "prometheus" / "llmgw-alerts.yml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
RULE_TESTS = REPO / "deploy" / "prometheus" / "tests" / "llmgw-alerts.test.yml"
PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool here (apt-get install prometheus)")


def _rules() -> list[dict[str, Any]]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_alert_says_what_is_wrong_and_what_to_do() -> None:
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 80, rule["alert"]
    tested = {
        alert["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for alert in case["alert_rule_test"]
    }
    assert tested == set(names)  # each alert has its unit test


def _panel_queries() -> list[tuple[str, str]]:
    """(dashboard/panel, expr) of every panel, its variables taken as "All"."""
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                expr = target["expr"].replace("$node", ".*").replace("$model", ".*")
                found.append((f"{board['uid']}/{panel['title']}", expr))
    return found


def test_the_dashboards_are_written_from_their_panel_list_and_each_panel_has_a_query() -> None:
    checked = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "grafana_dashboards.py"), "--check"], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout
    uids = [json.loads(path.read_text())["uid"] for path in DASHBOARDS]
    assert sorted(uids) == [
        "llmgw-fabrics",
        "llmgw-fleet",
        "llmgw-gateway",
        "llmgw-gpus",
        "llmgw-models",
        "llmgw-owners",
    ]
    assert all(expr for _where, expr in _panel_queries())


@needs_promtool
def test_the_rules_pass_promtool_check_and_their_unit_tests() -> None:
    assert PROMTOOL is not None
    checked = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in checked.stdout
    tested = subprocess.run(
        [PROMTOOL, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=60
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def _captured_fleet() -> None:
    """Nodes as their agents report them from captured hardware: an H100 node whose cards are slowed
    (HW slowdown, power brake) with the XIDs of a captured kernel log, one that is gone; a model
    whose replica keeps failing; a team near its GPU quota."""
    from apps.accounts import services as accounts
    from apps.cluster.choices import NodeStatus, ReplicaState
    from apps.cluster.models import Node, Replica, Shard
    from apps.quotas.models import CapacityQuota
    from tests.builders import make_model

    report = parse_nvidia_smi_text(
        (FIXTURES / "nvidia-smi-q" / "h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt").read_text()
    )
    gpus = [_gpu_dict(gpu) for gpu in report.gpus]
    log = (FIXTURES / "xid" / "xid48-dbe-xid63-rowremap-xid94-contained.log.txt").read_text()
    counts = next(iter(count_xids(parse_xid_lines(log)).values()))
    gpus[0]["xids"] = {str(code): n for code, n in counts.items()}
    node = Node.objects.create(
        name="h100-a", status=NodeStatus.READY, sampled_at=timezone.now(), sample={"cpus": 224, "gpus": gpus}
    )
    Node.objects.create(name="gone", status=NodeStatus.UNREACHABLE)
    org = accounts.create_organization(name="Acme", actor=None)
    team = accounts.create_team(org, name="Search", actor=None)
    model = make_model("llama-70b", gpus=4)
    model.team = team
    model.save()
    ready = Replica.objects.create(
        model=model, profile=model.profiles.first(), state=ReplicaState.READY, spec={"engine": "sglang"}
    )
    Shard.objects.create(replica=ready, node=node, rank=0, port=9001, secret="s", gpu_indices=[0, 1, 2, 3])
    # Its engine's own figures, as the agent reads them from a captured SGLang page.
    page = (Path(__file__).parents[1] / "agent" / "engine_metrics" / "sglang-docs.prom").read_text()
    node.sample["shards"] = [{"shard": f"r{ready.pk}s0", "engine": normalise("sglang", parse_exposition(page))}]
    node.save(update_fields=["sample"])
    Replica.objects.create(model=model, profile=model.profiles.first(), state=ReplicaState.FAILED, failures=4)
    CapacityQuota.objects.create(team=team, gpus=4)


@needs_promtool
@pytest.mark.django_db
def test_llmgws_metrics_pass_promtool_check_metrics(client: Any) -> None:
    assert PROMTOOL is not None
    _captured_fleet()
    body = client.get("/metrics").content
    text = body.decode()
    assert 'llmgw_gpu_clock_event{class="H100-80GB",gpu="0",node="h100-a"' in text
    assert 'llmgw_capacity_quota_used{level="team",owner="acme/search",resource="gpus"} 4.0' in text
    assert 'llmgw_replica_failures{model="llama-70b"' in text and "llmgw_gateway_queue_limit 256.0" in text
    assert 'llmgw_engine_requests_waiting{engine="sglang",model="llama-70b"' in text
    assert "# TYPE llmgw_engine_time_to_first_token_seconds summary" in text
    checked = subprocess.run([PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60)
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a local Prometheus
        return json.load(response)


@pytest.mark.skipif(PROMETHEUS is None, reason="no Prometheus here (apt-get install prometheus)")
@pytest.mark.django_db(transaction=True)
def test_a_real_prometheus_scrapes_llmgw_and_evaluates_every_rule(live_server: Any, tmp_path: Path) -> None:
    assert PROMETHEUS is not None
    _captured_fleet()
    port = free_port()
    target = live_server.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "llmgw", "static_configs": [{"targets": [target]}]}],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    api = f"http://127.0.0.1:{port}/api/v1/"
    try:

        def ask(path: str) -> Any:
            deadline = time.monotonic() + 60
            while True:
                try:
                    return _get(api + path)
                except OSError:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise

        def until(check: Any, what: str) -> Any:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                found = check()
                if found:
                    return found
                time.sleep(0.5)
            pytest.fail(f"Prometheus: timed out waiting for {what}")

        until(
            lambda: any(t["health"] == "up" for t in ask("targets")["data"]["activeTargets"]), "llmgw's scrape to be up"
        )

        def evaluated() -> list[dict[str, Any]] | None:
            rules = [r for g in ask("rules")["data"]["groups"] for r in g["rules"]]
            done = len(rules) == len(_rules()) and all(r.get("lastEvaluation", "").startswith("20") for r in rules)
            return rules if done else None

        for rule in until(evaluated, "every rule to be evaluated"):
            assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        for rule in _rules():
            answer = ask("query?" + urllib.parse.urlencode({"query": rule["expr"]}))
            assert answer["status"] == "success", (rule["alert"], answer)
        # Where the fleet made data, the rules' conditions hold: the unreachable node, the failing
        # replica, the quota at its limit and the captured XIDs are pending as alerts.
        pending = until(
            lambda: (
                {a["labels"]["alertname"] for a in ask("alerts")["data"]["alerts"]}
                >= {"LlmgwNodeUnreachable", "LlmgwReplicaCrashLoop", "LlmgwCapacityQuotaNearLimit"}
                and ask("alerts")["data"]["alerts"]
            ),
            "the alerts the fleet's condition makes",
        )
        assert any(
            a["labels"]["alertname"] == "LlmgwNodeUnreachable" and a["labels"]["node"] == "gone" for a in pending
        )
        slowed = ask("query?" + urllib.parse.urlencode({"query": 'llmgw_gpu_clock_event{reason="hw_slowdown"}'}))
        assert len(slowed["data"]["result"]) == 8  # each card of the captured node
        # Every dashboard panel's query is answered; those about what the fleet has, with data.
        empty = []
        for where, expr in _panel_queries():
            answer = ask("query?" + urllib.parse.urlencode({"query": expr}))
            assert answer["status"] == "success", (where, answer)
            if not answer["data"]["result"]:
                empty.append(where)
        with_data = {
            "llmgw-fleet/Nodes up",
            "llmgw-fleet/Replicas by state",
            "llmgw-gpus/GPUs held",
            "llmgw-gpus/Temperature",
            "llmgw-gpus/Power draw of the limit",
            "llmgw-gpus/Clocks held down, by reason",
            "llmgw-models/GPUs held",
            "llmgw-models/Replica failures in a row",
            "llmgw-models/Inside the engines: requests running and waiting",
            "llmgw-models/Inside the engines: KV cache in use",
            "llmgw-owners/GPUs held now, by owner",
            # (The GPU-hours panels sample each minute: they have data from the first whole minute.)
            "llmgw-owners/Capacity quotas: held of the limit",
        }
        assert not with_data & set(empty), sorted(with_data & set(empty))
    finally:
        process.terminate()
        process.wait(timeout=30)
