"""`llmgw doctor` without --config finds the agent.yaml there is: right after `llmgw up` (make up),
the local agent's <data dir>/agent/agent.yaml, which it used to refuse ("cannot read agent.yaml")."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent import cli


def _config(path: Path, root: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    config = {"server": "http://127.0.0.1:9", "state_dir": str(path.parent), "root": str(root), "model_dirs": []}
    path.write_text(yaml.safe_dump(config))
    return path


def _doctor(config: str | None = None) -> tuple[int, list[str]]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.doctor(config)
    return code, out.getvalue().splitlines()


@pytest.fixture
def here(tmp_path: Path, monkeypatch: Any) -> Path:
    """A working directory with no agent.yaml, a data directory, and no /etc/llmgw/agent.yaml."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LLMGW_AGENT_CONFIG", raising=False)
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(cli, "SYSTEM_CONFIG", str(tmp_path / "etc" / "agent.yaml"))
    (tmp_path / "root").mkdir()
    return tmp_path


def test_doctor_after_up_reads_the_local_agents_config_and_says_which(here: Path) -> None:
    local = _config(here / "data" / "agent" / "agent.yaml", here / "root")
    _code, lines = _doctor()
    assert lines[0] == f"pass  agent.yaml           {local}"
    assert not any(line.startswith("fail  agent.yaml") for line in lines)
    assert len(lines) > 1  # the node's own checks ran


def test_the_systems_config_comes_before_the_local_agents_and_a_named_one_before_both(here: Path) -> None:
    _config(here / "data" / "agent" / "agent.yaml", here / "root")
    system = _config(here / "etc" / "agent.yaml", here / "root")
    assert cli.find_config(None)[0] == str(system)
    assert cli.find_config("/elsewhere/agent.yaml")[0] == "/elsewhere/agent.yaml"
    _config(here / "agent.yaml", here / "root")
    assert cli.find_config(None)[0] == "agent.yaml"


def test_with_no_config_anywhere_doctor_says_where_it_looked(here: Path) -> None:
    code, lines = _doctor()
    assert code == 1
    assert lines == [
        f"fail  agent.yaml           none found: looked for agent.yaml, {here / 'etc' / 'agent.yaml'},"
        f" {here / 'data' / 'agent' / 'agent.yaml'} — pass --config PATH"
    ]


def test_a_named_config_that_cannot_be_read_is_still_refused_with_its_path(here: Path) -> None:
    code, lines = _doctor(str(here / "missing.yaml"))
    assert code == 1 and lines[0].startswith(f"fail  agent.yaml           {here / 'missing.yaml'}: cannot read")
