"""`llmgw ctl` against a live server."""

from __future__ import annotations

import pytest

from llmgw.cli import main
from llmgw.cli.ctl import format_table

pytestmark = pytest.mark.django_db(transaction=True)


def test_tables_print_a_dash_for_unknown() -> None:
    table = format_table(["NAME", "MEM"], [["gpu1", None], ["cpu1", 64]])
    assert table.splitlines() == ["NAME  MEM", "gpu1  -", "cpu1  64"]


def test_whoami_and_status(live_server, bob, key_for, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(bob, name="cli")
    assert main(["ctl", "--server", live_server.url, "--key", secret, "whoami"]) == 0
    out = capsys.readouterr().out
    assert "bob@example.com" in out
    assert "key cli" in out
    assert main(["ctl", "--server", live_server.url, "--key", secret, "status"]) == 0
    out = capsys.readouterr().out
    assert "nodes" in out and "database" in out


def test_the_key_can_come_from_the_config_file(live_server, bob, key_for, capsys, monkeypatch, tmp_path) -> None:
    secret = key_for(bob)
    config = tmp_path / ".config" / "llmgw" / "ctl.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(f"server: {live_server.url}\nkey: {secret}\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("LLMGW_API_KEY", raising=False)
    monkeypatch.delenv("LLMGW_SERVER", raising=False)
    assert main(["ctl", "whoami"]) == 0
    assert "bob@example.com" in capsys.readouterr().out


def test_a_revoked_key_gets_the_reason(live_server, bob, key_for, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["ctl", "--server", live_server.url, "--key", "llmgw_nothing", "whoami"]) == 1
    assert "error 401: Invalid API key." in capsys.readouterr().err


def test_an_unreachable_server_is_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["ctl", "--server", "http://127.0.0.1:1", "--key", "x", "whoami"]) == 1
    assert "cannot reach http://127.0.0.1:1" in capsys.readouterr().err


def test_node_drain_says_what_is_left_and_nodes_shows_it_draining(
    live_server, key_for, capsys, monkeypatch, tmp_path
) -> None:
    from apps.accounts.choices import StaffRole
    from apps.cluster.reconciler import reconcile
    from tests.builders import make_model, make_node
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    make_node("gpu1", gpus=1)
    make_model("m", gpus=1)
    reconcile()
    base = ["ctl", "--server", live_server.url, "--key", secret]
    assert main([*base, "node", "drain", "gpu1", "--grace", "30"]) == 0
    out = capsys.readouterr().out
    assert "node gpu1: ready,cordoned,draining" in out
    assert "draining: 1 replica(s) left" in out and "m#" in out
    assert main([*base, "nodes"]) == 0
    assert "draining" in capsys.readouterr().out


def test_model_apply_names_a_typo_with_its_path_and_dry_run_shows_the_diff(
    live_server, key_for, capsys, monkeypatch, tmp_path
) -> None:
    import yaml

    from apps.accounts.choices import StaffRole
    from apps.catalog.models import Profile
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    base = ["ctl", "--server", live_server.url, "--key", secret]
    profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}
    spec = tmp_path / "models.yaml"
    spec.write_text(yaml.safe_dump({"models": [{"name": "tiny", "source": "/models/t.gguf", "profiles": [profile]}]}))
    assert main([*base, "model", "apply", "-f", str(spec)]) == 0
    capsys.readouterr()
    typo = {k: v for k, v in profile.items() if k != "memory"} | {"memroy": "1GB"}
    spec.write_text(yaml.safe_dump({"models": [{"name": "tiny", "source": "/models/t.gguf", "profiles": [typo]}]}))
    assert main([*base, "model", "apply", "-f", str(spec)]) == 1
    err = capsys.readouterr().err
    assert "models[0].profiles[0].memroy: unknown field; did you mean memory?" in err
    assert Profile.objects.get(model__name="tiny").memory_bytes == 1024**3
    spec.write_text(
        yaml.safe_dump(
            {"models": [{"name": "tiny", "source": "/models/t.gguf", "profiles": [{**profile, "parallel": 8}]}]}
        )
    )
    assert main([*base, "model", "apply", "-f", str(spec), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model tiny: would change" in out
    assert "profiles[cpu].parallel:\n    - 4\n    + 8" in out
    assert Profile.objects.get(model__name="tiny").parallel == 4
    assert main([*base, "model", "delete", "tiny", "--yes"]) == 0
    assert "deleted" in capsys.readouterr().out


def test_models_says_under_the_table_why_a_model_does_not_run(
    live_server, key_for, capsys, monkeypatch, tmp_path
) -> None:
    """A failed engine with its exit code and the last lines of its own log, where the real reason
    is; a pending replica with the refusals placement met."""
    from apps.accounts.choices import StaffRole
    from apps.cluster import reports
    from apps.cluster.choices import ReplicaState
    from tests.builders import make_model, make_node, make_replica
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    node = make_node("vm", gpus=0)
    replica = make_replica(make_model("tiny", memory_gb=1, cores=1), node, state=ReplicaState.STARTING)
    tail = ["gguf_init_from_file: failed to open GGUF file '/m/tiny.gguf' (No such file)", "main: exiting"]
    report = {"shard": f"r{replica.pk}s0", "state": "failed", "exit_code": 1, "log_tail": tail}
    reports.record_report(node.pk, [{**report, "message": "engine exited with code 1 before it was ready"}])
    refusal = {"code": "cpu", "template": "node %(node)s has %(free)s of %(total)s CPU cores free, needs %(need)s"}
    refusal["params"] = {"node": "vm", "free": "0", "total": 2, "need": "4"}
    make_replica(make_model("big", memory_gb=1, cores=4), state=ReplicaState.PENDING, rejections=[refusal])
    assert main(["ctl", "--server", live_server.url, "--key", secret, "models"]) == 0
    out = capsys.readouterr().out.splitlines()
    failed = out.index(f"tiny#{replica.pk} failed on vm (exit code 1): engine exited with code 1 before it was ready")
    assert out[failed + 1 : failed + 3] == [f"    | {line}" for line in tail]
    assert "big: pending: node vm has 0 of 2 CPU cores free, needs 4" in out


def test_model_explain_says_where_a_running_replica_runs_then_what_one_more_would_find(
    live_server, key_for, capsys, monkeypatch, tmp_path
) -> None:
    from apps.accounts.choices import StaffRole
    from apps.cluster.models import Replica
    from apps.cluster.reconciler import reconcile
    from tests.builders import make_model, make_node
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    make_node("vm", cpus=2, memory_gb=8)
    make_model("tiny", memory_gb=1, cores=2, engine="llama.cpp")
    reconcile()
    replica = Replica.objects.get()
    assert main(["ctl", "--server", live_server.url, "--key", secret, "model", "explain", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    placed = next(line for line in out if line.startswith(f"replica {replica.pk} (starting) runs on vm ["))
    assert ": fits (score " in placed and "would be refused" not in "\n".join(out)
    following = out[out.index("one more replica:") + 1 :]
    assert following[0].endswith("fits nowhere")
    assert "  vm: node vm has 0 of 2 CPU cores free, needs 2" in following
