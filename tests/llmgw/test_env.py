from __future__ import annotations

import os
import stat

import pytest
from django.core.exceptions import ImproperlyConfigured

from llmgw import env


def test_bool_accepts_the_usual_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, expected in [("1", True), ("yes", True), ("On", True), ("0", False), ("false", False), ("", False)]:
        monkeypatch.setenv("LLMGW_X", text)
        assert env.env_bool("LLMGW_X") is expected


def test_a_malformed_value_names_the_variable_and_what_was_expected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_DEBUG", "perhaps")
    with pytest.raises(ImproperlyConfigured, match=r"LLMGW_DEBUG='perhaps': expected a boolean"):
        env.env_bool("LLMGW_DEBUG")
    monkeypatch.setenv("LLMGW_N", "ten")
    with pytest.raises(ImproperlyConfigured, match=r"LLMGW_N='ten': expected a whole number"):
        env.env_int("LLMGW_N", 1)
    with pytest.raises(ImproperlyConfigured, match=r"LLMGW_LISTEN='8000': expected host:port"):
        env.parse_listen("LLMGW_LISTEN", "8000")


def test_listen_parses_ipv4_and_ipv6() -> None:
    assert env.parse_listen("L", "0.0.0.0:9000") == ("0.0.0.0", 9000)
    assert env.parse_listen("L", "[::1]:8000") == ("::1", 8000)


def test_database_urls() -> None:
    pg = env.parse_database_url("LLMGW_DATABASE_URL", "postgres://u:p%40ss@db.example:6543/llmgw?sslmode=require")
    assert (pg.engine, pg.name, pg.user, pg.password, pg.host, pg.port) == (
        "postgresql",
        "llmgw",
        "u",
        "p@ss",
        "db.example",
        "6543",
    )
    config = pg.django(pool_size=7, pool_timeout=12.0)
    assert config["OPTIONS"] == {
        "sslmode": "require",
        "pool": {"min_size": 0, "max_size": 7, "timeout": 12.0, "max_idle": 60.0},
    }
    assert config["CONN_MAX_AGE"] == 0  # a connection goes back to the pool when its work ends
    lite = env.parse_database_url("LLMGW_DATABASE_URL", "sqlite:////tmp/x.sqlite3")
    assert lite.name == "/tmp/x.sqlite3"
    options = lite.django()["OPTIONS"]
    assert "journal_mode=WAL" in options["init_command"]  # type: ignore[index]
    assert options["transaction_mode"] == "IMMEDIATE"  # type: ignore[index]
    with pytest.raises(ImproperlyConfigured, match="LLMGW_DATABASE_URL='mysql://x/y': expected a URL"):
        env.parse_database_url("LLMGW_DATABASE_URL", "mysql://x/y")


def test_secret_key_is_generated_once_with_mode_0600(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_SECRET_KEY", raising=False)
    first = env.secret_key(tmp_path)
    assert env.secret_key(tmp_path) == first
    mode = stat.S_IMODE(os.stat(tmp_path / "secret_key").st_mode)
    assert mode == 0o600


def test_secret_can_come_from_a_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s"
    path.write_text("from-file\n")
    monkeypatch.delenv("LLMGW_SECRET_KEY", raising=False)
    monkeypatch.setenv("LLMGW_SECRET_KEY_FILE", str(path))
    assert env.env_secret("LLMGW_SECRET_KEY") == "from-file"
    monkeypatch.setenv("LLMGW_SECRET_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ImproperlyConfigured, match="LLMGW_SECRET_KEY_FILE"):
        env.env_secret("LLMGW_SECRET_KEY")
