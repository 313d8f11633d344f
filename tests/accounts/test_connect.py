"""Connecting an editor: the account page's keys and settings, and the install scripts run for real.

The scripts are fetched through the test client and run with `sh -s` in a temporary HOME, as
`curl … | LLMGW_API_KEY=… sh` would run them, against configuration files that already exist.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from django.test import Client

from apps.accounts import editors
from apps.accounts.models import ApiKey, AuditEvent
from apps.catalog.models import Model

pytestmark = pytest.mark.django_db

SERVER = "https://llm.example.com"
KEY = "llmgw_" + "k3y-Of_the-test" * 3
SECRET_PATTERN = re.compile(r"llmgw_[A-Za-z0-9_-]{20,}")


@pytest.fixture(autouse=True)
def _public_url(settings: Any) -> None:
    settings.PUBLIC_URL = SERVER


@pytest.fixture
def models(db: Any) -> list[str]:
    names = ["qwen3-32b", "gemma-3-27b"]
    for name in names:
        Model.objects.create(name=name)
    return sorted(names)


def script(client: Client, tool: str, model: str | None = None) -> str:
    response = client.get(f"/connect/{tool}.sh", {"model": model} if model else {})
    assert response.status_code == 200, response.content[:500]
    return response.content.decode()


def run(
    text: str, home: Path, key: str | None = KEY, awk: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run a script as `… | LLMGW_API_KEY=key sh` would, in and with HOME pointing at `home`."""
    path = os.environ["PATH"]
    if awk is not None:
        # Put the chosen awk first on PATH, so the script runs with it.
        bin_dir = home.parent / f"bin-{awk}"
        bin_dir.mkdir(exist_ok=True)
        link = bin_dir / "awk"
        if not link.exists():
            link.symlink_to(shutil.which(awk) or awk)
        path = f"{bin_dir}{os.pathsep}{path}"
    environment = {"PATH": path, "HOME": str(home), **env}
    if key is not None:
        environment["LLMGW_API_KEY"] = key
    return subprocess.run(
        ["sh", "-s"], input=text, env=environment, cwd=home, capture_output=True, text=True, timeout=30, check=False
    )


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# The account page ----------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["continue", "codex", "cline"])
def test_the_account_page_makes_a_key_for_each_tool_with_the_server_and_model(
    client: Client, bob, models, tool: str
) -> None:
    client.force_login(bob)
    response = client.post("/account/", {"tool": tool, "model": "qwen3-32b"})
    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    key = ApiKey.objects.get(user=bob)
    assert re.fullmatch(rf"{editors.TOOLS[tool].label} \(\d{{4}}-\d\d-\d\d\)", key.name)
    assert (key.project, key.allowed_models, key.is_session_key) == (None, [], False)
    assert AuditEvent.objects.filter(action="api_key.create", actor=bob).count() == 1

    page = response.content.decode()
    shown = re.search(r'data-connection="(\w+)"(.*?)</section>', page, re.S)
    assert shown and shown.group(1) == tool
    block = shown.group(2)
    secret = re.search(r"data-secret>(llmgw_[^<]+)<", block).group(1)
    assert key.prefix == secret[: len(key.prefix)]
    assert f"{SERVER}/v1" in block
    assert "qwen3-32b" in block
    if tool == "continue":
        assert "~/.continue/assistants/llmgw.yaml" in block
        assert f"LLMGW_API_KEY={secret}" in block
    elif tool == "codex":
        assert "[model_providers.llmgw]" in block
        assert "wire_api = &quot;responses&quot;" in block
        assert "~/.codex/llmgw.config.toml" in block
        assert "codex --profile llmgw" in block
    else:
        assert "OpenAI Compatible" in block
        assert f'<code id="cline-field-3">{secret}</code>' in block
    if tool in editors.SCRIPT_TOOLS:
        command = re.search(r"data-command>(.*?)</pre>", block, re.S).group(1)
        assert command.startswith(f"curl -fsSL &#x27;{SERVER}/connect/{tool}.sh?model=qwen3-32b&#x27; | ")
        assert command.endswith(f"LLMGW_API_KEY={secret} sh")
    else:
        assert "data-command" not in block

    again = client.get("/account/").content.decode()
    assert secret not in again


def test_the_one_line_command_fetches_a_script_this_server_serves(client: Client, bob, models) -> None:
    client.force_login(bob)
    page = client.post("/account/", {"tool": "codex", "model": "gemma-3-27b"}).content.decode()
    command = re.search(r"data-command>(.*?)</pre>", page, re.S).group(1).replace("&#x27;", "'")
    words = shlex.split(command)
    assert words[:2] == ["curl", "-fsSL"]
    url = urlsplit(words[2])
    assert f"{url.scheme}://{url.netloc}" == SERVER
    assert "model=gemma-3-27b" in script(Client(), "codex", "gemma-3-27b")
    assert Client().get(f"{url.path}?{url.query}").status_code == 200


def test_the_first_model_is_chosen_until_the_person_picks_another(client: Client, bob, models) -> None:
    client.force_login(bob)
    page = client.get("/account/").content.decode()
    assert page.count('<option value="gemma-3-27b" selected>') == 3
    page = client.post("/account/", {"tool": "cline", "model": "qwen3-32b"}).content.decode()
    assert page.count('<option value="qwen3-32b" selected>') == 3


def test_without_a_public_url_the_address_is_the_one_the_browser_used(
    client: Client, bob, models, settings: Any
) -> None:
    settings.PUBLIC_URL = ""
    client.force_login(bob)
    page = client.post("/account/", {"tool": "cline", "model": "qwen3-32b"}).content.decode()
    assert '<code id="cline-field-2">http://testserver/v1</code>' in page
    assert 'base_url = "http://testserver/v1"' in Client().get("/connect/codex.sh").content.decode()


@pytest.mark.parametrize(
    "data",
    [
        {"tool": "continue", "model": "no-such-model"},
        {"tool": "continue", "model": ""},
        {"tool": "emacs", "model": "qwen3-32b"},
    ],
)
def test_a_bad_choice_makes_no_key(client: Client, bob, models, data: dict[str, str]) -> None:
    client.force_login(bob)
    response = client.post("/account/", data)
    assert response.status_code == 200
    assert b"data-connection" not in response.content
    assert not ApiKey.objects.exists()
    if data["tool"] == "continue":
        assert b'data-error="model"' in response.content


def test_with_no_model_declared_the_page_says_so_and_makes_no_key(client: Client, bob) -> None:
    client.force_login(bob)
    page = client.get("/account/").content.decode()
    assert "No model is declared on this gateway yet" in page
    assert client.post("/account/", {"tool": "codex", "model": "anything"}).status_code == 200
    assert not ApiKey.objects.exists()
    assert Client().get("/connect/codex.sh").status_code == 404


def test_the_account_page_is_for_people_who_signed_in(client: Client, models) -> None:
    assert client.get("/account/")["Location"].startswith("/login/")
    assert client.post("/account/", {"tool": "codex", "model": "qwen3-32b"}).status_code == 302
    assert not ApiKey.objects.exists()


# The scripts, as served -------------------------------------------------------------------


@pytest.mark.parametrize("tool", editors.SCRIPT_TOOLS)
def test_a_script_is_served_without_a_session_and_holds_no_secret(
    client: Client, bob, models, key_for, tool: str
) -> None:
    secret = key_for(bob)
    response = client.get(f"/connect/{tool}.sh", {"model": "qwen3-32b"})
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    text = response.content.decode()
    assert text.startswith("#!/bin/sh\n")
    assert f"{SERVER}/v1" in text
    assert "qwen3-32b" in text
    assert secret not in text
    assert not SECRET_PATTERN.search(text)
    assert "set -eu" in text


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/connect/codex.sh?model=no-such-model", 404),
        ("/connect/continue.sh?model=qwen3-32b%0Aecho", 404),
        ("/connect/cline.sh", 404),
        ("/connect/bash.sh", 404),
    ],
)
def test_a_script_for_an_unknown_model_or_tool_is_not_found(client: Client, models, path: str, status: int) -> None:
    assert client.get(path).status_code == status


def test_without_a_model_the_script_uses_the_first(client: Client, models) -> None:
    assert 'model = "gemma-3-27b"' in script(client, "codex")


def test_a_script_is_only_read(client: Client, models) -> None:
    assert client.post("/connect/codex.sh").status_code == 405


def test_a_translation_is_only_ever_text_to_the_shell(
    client: Client, models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hostile = 'LLMGW_API_KEY\'ı boş: "$(touch pwned)" `touch pwned` $HOME \\ %(account)s'
    monkeypatch.setattr(editors, "_", lambda message: hostile if message == editors.NO_KEY else message)
    home = tmp_path / "home"
    home.mkdir()
    completed = run(script(client, "codex"), home, key="")
    assert completed.returncode != 0
    assert (
        'LLMGW_API_KEY\'ı boş: "$(touch pwned)" `touch pwned` $HOME \\ https://llm.example.com/account/'
        in completed.stderr
    )
    assert not list(tmp_path.rglob("pwned"))


def test_a_translation_with_a_wrong_placeholder_falls_back_to_english(
    client: Client, models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(editors, "_", lambda message: "%(nope)s" if message == editors.NO_KEY else message)
    completed = run(script(client, "continue"), tmp_path, key="")
    assert "LLMGW_API_KEY is empty, so nothing was changed." in completed.stderr


# Running the Continue script --------------------------------------------------------------


def test_continue_writes_its_own_assistant_and_leaves_config_yaml_alone(client: Client, models, tmp_path: Path) -> None:
    home = tmp_path / "home"
    continue_dir = home / ".continue"
    (continue_dir / "assistants").mkdir(parents=True)
    config = b"name: Mine\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: local\n    provider: ollama\n"
    (continue_dir / "config.yaml").write_bytes(config)
    old_assistant = b"name: llmgw\nversion: 0.0.1\nschema: v1\nmodels: []\n"
    (continue_dir / "assistants" / "llmgw.yaml").write_bytes(old_assistant)
    (continue_dir / "assistants" / "other.yaml").write_bytes(b"name: other\n")
    (continue_dir / ".env").write_bytes(b"OPENAI_API_KEY=sk-1\nLLMGW_API_KEY=llmgw_old\n")

    completed = run(script(client, "continue", "qwen3-32b"), home)
    assert completed.returncode == 0, completed.stderr

    assert (continue_dir / "config.yaml").read_bytes() == config
    assert (continue_dir / "assistants" / "other.yaml").read_bytes() == b"name: other\n"
    backups = sorted((continue_dir / "assistants").glob("llmgw.yaml.bak.*"))
    assert len(backups) == 1
    assert backups[0].read_bytes() == old_assistant
    assistant = yaml.safe_load((continue_dir / "assistants" / "llmgw.yaml").read_text())
    assert (assistant["name"], assistant["schema"]) == ("llmgw", "v1")
    [model] = assistant["models"]
    assert model["provider"] == "openai"
    assert model["apiBase"] == f"{SERVER}/v1"
    assert model["model"] == "qwen3-32b"
    assert model["apiKey"] == "${{ secrets.LLMGW_API_KEY }}"
    assert set(model["roles"]) >= {"chat", "edit", "apply"}
    assert (continue_dir / ".env").read_text() == f"OPENAI_API_KEY=sk-1\nLLMGW_API_KEY={KEY}\n"
    assert (continue_dir / ".env").stat().st_mode & 0o077 == 0
    assert KEY not in (continue_dir / "assistants" / "llmgw.yaml").read_text()

    before = snapshot(home)
    again = run(script(client, "continue", "qwen3-32b"), home)
    assert again.returncode == 0, again.stderr
    assert snapshot(home) == before, "running it twice changes nothing"


def test_continue_makes_its_folder_when_there_is_none(client: Client, models, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    completed = run(script(client, "continue"), home)
    assert completed.returncode == 0, completed.stderr
    assert sorted(snapshot(home)) == [".continue/.env", ".continue/assistants/llmgw.yaml"]
    assert "bak" not in completed.stdout + completed.stderr


def test_continue_follows_continue_global_dir(client: Client, models, tmp_path: Path) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "continue"
    home.mkdir()
    completed = run(script(client, "continue"), home, CONTINUE_GLOBAL_DIR=str(elsewhere))
    assert completed.returncode == 0, completed.stderr
    assert (elsewhere / "assistants" / "llmgw.yaml").exists()
    assert snapshot(home) == {}


# Running the Codex script -----------------------------------------------------------------

CODEX_CONFIG = """\
# My Codex settings
model = "o3"
approval_policy = "on-request"

[model_providers.openrouter]
name = "OpenRouter"
base_url = "https://openrouter.ai/api/v1"
env_key = "OPENROUTER_API_KEY"
wire_api = "responses"

[model_providers.llmgw]
name = "llmgw (old)"
base_url = "http://old.example/v1"
env_key = "OLD_KEY"

[model_providers.llmgw.http_headers]
X-Old = "1"

[mcp_servers.docs]
command = "npx"
args = [
  "-y",
  "docs-server",
]

[profiles.llmgw]
model = "old-model"
model_provider = "llmgw"

[profiles.llmgw2]
model = "keep-me"

[model_providers.llmgw2]
name = "Not ours"
base_url = "https://llmgw2.example/v1"
"""
# The lines the script must keep, in order: everything but the old llmgw tables.
CODEX_KEPT = [
    line for index, line in enumerate(CODEX_CONFIG.splitlines()) if not (10 <= index <= 17 or 25 <= index <= 28)
]


@pytest.mark.parametrize("awk", ["gawk", "mawk"])
def test_codex_replaces_only_the_llmgw_tables_and_keeps_the_default_model(
    client: Client, models, tmp_path: Path, awk: str
) -> None:
    if shutil.which(awk) is None:
        pytest.skip(f"{awk} is not installed")
    assert CODEX_KEPT[10] == "[mcp_servers.docs]" and CODEX_KEPT[15] == "]"
    home = tmp_path / "home"
    codex = home / ".codex"
    codex.mkdir(parents=True)
    (codex / "config.toml").write_text(CODEX_CONFIG)
    (codex / "llmgw.config.toml").write_text('model = "old-model"\n')
    (codex / "config.toml").chmod(0o644)

    completed = run(script(client, "codex", "qwen3-32b"), home, awk=awk)
    assert completed.returncode == 0, completed.stderr

    backups = sorted(codex.glob("config.toml.bak.*"))
    assert len(backups) == 1
    assert backups[0].read_text() == CODEX_CONFIG
    assert len(list(codex.glob("llmgw.config.toml.bak.*"))) == 1
    text = (codex / "config.toml").read_text()
    assert (codex / "config.toml").stat().st_mode & 0o777 == 0o644
    assert text.count("[model_providers.llmgw]") == 1
    assert "[profiles.llmgw]" not in text
    assert "old.example" not in text and "X-Old" not in text
    assert text.splitlines()[: len(CODEX_KEPT)] == CODEX_KEPT

    config = tomllib.loads(text)
    assert config["model"] == "o3"
    provider = config["model_providers"]["llmgw"]
    assert provider == {
        "name": "llmgw",
        "base_url": f"{SERVER}/v1",
        "env_key": "LLMGW_API_KEY",
        "wire_api": "responses",
    }
    assert config["model_providers"]["openrouter"]["env_key"] == "OPENROUTER_API_KEY"
    assert config["model_providers"]["llmgw2"]["name"] == "Not ours"
    assert config["profiles"] == {"llmgw2": {"model": "keep-me"}}
    assert config["mcp_servers"]["docs"]["args"] == ["-y", "docs-server"]
    profile = tomllib.loads((codex / "llmgw.config.toml").read_text())
    assert profile == {"model": "qwen3-32b", "model_provider": "llmgw"}
    assert KEY not in text and KEY not in (codex / "llmgw.config.toml").read_text()
    assert f"export LLMGW_API_KEY={KEY}" in completed.stdout
    assert "codex --profile llmgw" in completed.stdout
    assert "[profiles.*]" in completed.stdout  # llmgw2 is still a legacy table, and Codex is told so

    before = snapshot(home)
    again = run(script(client, "codex", "qwen3-32b"), home, awk=awk)
    assert again.returncode == 0, again.stderr
    assert snapshot(home) == before, "running it twice changes nothing"


def test_codex_starts_a_config_when_there_is_none(client: Client, models, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    completed = run(script(client, "codex", "qwen3-32b"), home)
    assert completed.returncode == 0, completed.stderr
    config = tomllib.loads((home / ".codex" / "config.toml").read_text())
    assert config == {
        "model_providers": {
            "llmgw": {"name": "llmgw", "base_url": f"{SERVER}/v1", "env_key": "LLMGW_API_KEY", "wire_api": "responses"}
        }
    }
    assert sorted(snapshot(home)) == [".codex/config.toml", ".codex/llmgw.config.toml"]


def test_codex_with_another_model_replaces_the_profile_only(client: Client, models, tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text('model = "o3"\n')
    assert run(script(client, "codex", "qwen3-32b"), home).returncode == 0
    config = (home / ".codex" / "config.toml").read_bytes()
    completed = run(script(client, "codex", "gemma-3-27b"), home)
    assert completed.returncode == 0, completed.stderr
    assert (home / ".codex" / "config.toml").read_bytes() == config
    assert tomllib.loads((home / ".codex" / "llmgw.config.toml").read_text())["model"] == "gemma-3-27b"


def test_codex_writes_through_a_linked_config(client: Client, models, tmp_path: Path) -> None:
    home, dotfiles = tmp_path / "home", tmp_path / "dotfiles"
    (home / ".codex").mkdir(parents=True)
    dotfiles.mkdir()
    (dotfiles / "codex.toml").write_text('model = "o3"\n')
    (home / ".codex" / "config.toml").symlink_to(dotfiles / "codex.toml")
    completed = run(script(client, "codex"), home)
    assert completed.returncode == 0, completed.stderr
    assert (home / ".codex" / "config.toml").is_symlink()
    assert tomllib.loads((dotfiles / "codex.toml").read_text())["model_providers"]["llmgw"]["wire_api"] == "responses"


def test_codex_follows_codex_home(client: Client, models, tmp_path: Path) -> None:
    home, elsewhere = tmp_path / "home", tmp_path / "codex-home"
    home.mkdir()
    completed = run(script(client, "codex"), home, CODEX_HOME=str(elsewhere))
    assert completed.returncode == 0, completed.stderr
    assert (elsewhere / "config.toml").exists() and (elsewhere / "llmgw.config.toml").exists()
    assert snapshot(home) == {}


# Refusing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", editors.SCRIPT_TOOLS)
@pytest.mark.parametrize(
    ("key", "says"),
    [
        (None, "LLMGW_API_KEY is empty"),
        ("", "LLMGW_API_KEY is empty"),
        ("sk-not-ours", "does not look like an llmgw key"),
        ("llmgw_abc\nEVIL=1", "characters no llmgw key has"),
    ],
)
def test_a_missing_or_odd_key_changes_nothing(
    client: Client, models, tmp_path: Path, tool: str, key: str | None, says: str
) -> None:
    home = tmp_path / "home"
    (home / ".continue" / "assistants").mkdir(parents=True)
    (home / ".continue" / "assistants" / "llmgw.yaml").write_text("name: old\n")
    (home / ".continue" / ".env").write_text("LLMGW_API_KEY=llmgw_old\n")
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(CODEX_CONFIG)
    before, names = snapshot(home), sorted(home.rglob("*"))
    completed = run(script(client, tool), home, key=key)
    assert completed.returncode != 0
    assert says in completed.stderr
    assert snapshot(home) == before
    assert sorted(home.rglob("*")) == names
