"""The agent `llmgw up` runs on its own machine keeps what the mirror sends it where the mirror
says, so a model served from the mirror on a fresh `llmgw up` is fetched, not refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.safepath import is_inside
from llmgw.cli.local_agent import local_agent_config
from tests.e2e.helpers import REPO


def test_by_default_the_mirrors_node_directory_is_inside_the_model_directory_of_llmgw_ups_agent(
    tmp_path: Path,
) -> None:
    """Read as a fresh `llmgw up` reads its settings: only LLMGW_DATA_DIR given."""
    data = tmp_path / "data"
    script = "from django.conf import settings; print(settings.MIRROR_NODE_DIR)"
    env = {"LLMGW_DATA_DIR": str(data), "DJANGO_SETTINGS_MODULE": "llmgw.settings", "PATH": "/usr/bin:/bin"}
    answer = subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {script}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert answer.stdout.strip() == str(data.resolve() / "models" / "mirror")


@pytest.mark.django_db
def test_the_local_agent_keeps_models_in_the_data_directory_and_where_the_mirror_sends_them(
    tmp_path: Path, settings
) -> None:
    settings.MIRROR_NODE_DIR = str(tmp_path / "models" / "mirror")
    config = yaml.safe_load(local_agent_config(tmp_path, "http://127.0.0.1:1").read_text())
    assert config["model_dirs"] == [str(tmp_path / "models")]
    assert any(is_inside(Path(settings.MIRROR_NODE_DIR), d) for d in config["model_dirs"])

    settings.MIRROR_NODE_DIR = str(tmp_path / "elsewhere" / "mirror")  # LLMGW_MIRROR_NODE_DIR set by hand
    config = yaml.safe_load(local_agent_config(tmp_path, "http://127.0.0.1:1").read_text())
    assert config["model_dirs"] == [str(tmp_path / "models"), str(tmp_path / "elsewhere" / "mirror")]
