"""`llmgw ctl batch list|show|cancel` against a live server: operators see every organisation's batches,
a batch's problems by line, and cancel one; what the server refuses is printed in its words."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from apps.accounts.choices import StaffRole
from apps.batches.models import Batch
from llmgw.cli import main
from tests.batches.harness import make_batch, make_tenant
from tests.conftest import make_user

pytestmark = pytest.mark.django_db(transaction=True)


def test_operators_list_show_and_cancel_batches_of_every_organisation(
    live_server: Any, key_for: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    a, b = make_tenant("ada"), make_tenant("bert")
    problems = [{"code": "duplicate_custom_id", "message": "custom_id 'x' is on line 1 too", "line": 3, "param": None}]
    make_batch(a, "batch_a", errors=problems)
    make_batch(b, "batch_b", status="completed", succeeded=9, failed=1)
    operator = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    base = ["ctl", "--server", live_server.url, "--key", operator]

    assert main([*base, "batch", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "API", "STATUS", "DONE", "FAILED", "MODEL", "OWNER", "CREATED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"batch_a", "batch_b"}
    assert "in_progress" in rows["batch_a"] and "5/10 (50%)" in rows["batch_a"] and "Org ada" in rows["batch_a"]
    assert "10/10 (100%)" in rows["batch_b"]

    assert main([*base, "batch", "list", "--status", "completed"]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == ["batch_b"]
    assert main([*base, "batch", "list", "--org", str(a.org.pk), "--json"]) == 0
    assert '"id": "batch_a"' in (out := capsys.readouterr().out) and "batch_b" not in out

    assert main([*base, "batch", "show", "batch_a"]) == 0
    out = capsys.readouterr().out
    assert "Org ada / " in out and "ada@example.com" in out and "5/10 (50%)" in out
    assert "duplicate_custom_id" in out and "custom_id 'x' is on line 1 too" in out
    assert ["cancelled", "at", "-"] in [line.split() for line in out.splitlines()]  # not yet: a dash

    assert main([*base, "batch", "cancel", "batch_a"]) == 0
    assert capsys.readouterr().out.strip() == "batch batch_a: cancelling, 5/10 (50%) answered"
    assert Batch.objects.get(pk="batch_a").status == "cancelling"
    assert main([*base, "batch", "cancel", "batch_b"]) == 1
    assert "error 409: Cannot cancel a batch that is completed." in capsys.readouterr().err
    assert main([*base, "batch", "show", "batch_nothing"]) == 1
    assert "error 404" in capsys.readouterr().err
    assert main([*base, "batch", "list", "--status", "sideways"]) == 1
    assert "error 400" in (err := capsys.readouterr().err) and "sideways" in err


def test_a_member_is_sent_to_their_own_api(
    live_server: Any, key_for: Any, capsys: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    a = make_tenant("ada")
    make_batch(a, "batch_a")
    assert main(["ctl", "--server", live_server.url, "--key", a.secret, "batch", "list"]) == 1
    assert "error 403" in capsys.readouterr().err
