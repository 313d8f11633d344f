"""`llmgw ctl nodes` and `llmgw ctl node show` against a live server: each node's engines with their
versions, through the nodes API."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.cli import main

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def ctl(live_server: Any, key_for: Any, monkeypatch: Any, tmp_path: Any) -> Any:
    """Run `llmgw ctl ARGS` as an operator; returns (exit status, what it printed)."""
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))

    def run(*args: str, capsys: Any) -> tuple[int, str]:
        status = main(["ctl", "--server", live_server.url, "--key", secret, *args])
        return status, capsys.readouterr().out

    return run


def nodes_with_engines() -> None:
    from apps.cluster.models import Node
    from tests.builders import make_node

    versioned = make_node("cpu1", engines=("llama.cpp", "vllm"))
    Node.objects.filter(pk=versioned.pk).update(
        hardware={**versioned.hardware, "engine_versions": {"llama.cpp": "b6500", "vllm": None}}
    )
    make_node("bare", engines=())
    silent = make_node("silent")
    Node.objects.filter(pk=silent.pk).update(hardware={k: v for k, v in silent.hardware.items() if k != "engines"})


def column(out: str, node: str, header: str) -> str:
    """A cell of `ctl nodes`, cut at the header's position (cells may hold spaces)."""
    lines = out.splitlines()
    start = lines[0].index(header)
    following = [lines[0].index(h) for h in lines[0].split() if lines[0].index(h) > start]
    end = min(following) if following else None
    line = next(line for line in lines[1:] if line.split()[0] == node)
    return line[start:end].strip()


def test_nodes_lists_each_nodes_engines_with_versions(ctl, capsys) -> None:
    nodes_with_engines()
    status, out = ctl("nodes", capsys=capsys)
    assert status == 0
    assert out.splitlines()[0].split() == ["NAME", "STATUS", "CPU", "MEM", "GPU", "DISK", "ENGINES", "LOCATION", "AGE"]
    assert column(out, "cpu1", "ENGINES") == "llama.cpp b6500, vllm -"
    assert column(out, "bare", "ENGINES") == "none"
    assert column(out, "silent", "ENGINES") == "-"


def test_node_show_has_an_engines_line(ctl, capsys) -> None:
    nodes_with_engines()
    for name, shown in (("cpu1", "llama.cpp b6500, vllm -"), ("bare", "none"), ("silent", "-")):
        status, out = ctl("node", "show", name, capsys=capsys)
        assert status == 0
        line = next(line for line in out.splitlines() if line.startswith("engines "))
        assert line.split(None, 1)[1].strip() == shown


def test_the_api_gives_engines_as_names_and_versions_null_where_unknown(ctl, capsys) -> None:
    nodes_with_engines()
    status, out = ctl("nodes", "--json", capsys=capsys)
    assert status == 0
    engines = {node["name"]: node["engines"] for node in json.loads(out)}
    assert engines == {
        "cpu1": [{"name": "llama.cpp", "version": "b6500"}, {"name": "vllm", "version": None}],
        "bare": [],
        "silent": None,
    }
    status, out = ctl("node", "show", "cpu1", "--json", capsys=capsys)
    assert json.loads(out)["engines"] == engines["cpu1"]
