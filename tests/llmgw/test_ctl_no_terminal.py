"""Every `llmgw ctl` command run as a script or CI runs it: no terminal attached, nothing on stdin.

Each command is run once against a live server with an administrator's key, its arguments naming
things that do not exist; whatever the server answers, the command ends with an exit status and
its own words, never a traceback or a question no one can answer.
"""

from __future__ import annotations

import argparse
import io
import logging
from typing import Any

import pytest

from llmgw.cli import build_parser, main

pytestmark = pytest.mark.django_db(transaction=True)

#: A value for each positional argument (by dest) that names nothing the server holds.
PLACEHOLDERS = {
    "domain": "rack=nothing",
    "urls": ["nothing/nothing"],
    "labels": ["role=nothing"],
    "file": None,  # a file that does not exist, under the test's tmp_path
}


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def ctl_commands() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """Every leaf command of `llmgw ctl` as its words, with its parser."""
    top = _subparsers(build_parser())
    assert top is not None
    found: list[tuple[list[str], argparse.ArgumentParser]] = []

    def walk(parser: argparse.ArgumentParser, words: list[str]) -> None:
        sub = _subparsers(parser)
        if sub is None:
            found.append((words, parser))
            return
        for name, child in sub.choices.items():
            walk(child, [*words, name])

    walk(top.choices["ctl"], [])
    return found


def _arguments(parser: argparse.ArgumentParser, missing_file: str) -> list[str]:
    words: list[str] = []
    for action in parser._actions:
        if action.dest == "help" or (action.option_strings and not action.required):
            continue
        value: Any
        if action.dest == "file":
            value = missing_file
        elif action.dest in PLACEHOLDERS:
            value = PLACEHOLDERS[action.dest]
        elif action.choices:
            value = next(iter(action.choices))
        elif action.type is int:
            value = "987654"
        else:
            value = "nothing"
        values = value if isinstance(value, list) else [value]
        words += [action.option_strings[0], *values] if action.option_strings else values
    return words


def test_every_command_is_covered() -> None:
    names = {" ".join(words) for words, _parser in ctl_commands()}
    assert {"whoami", "model delete", "model apply", "guardrails delete", "limits delete"} <= names
    assert len(names) >= 40


def test_every_ctl_command_runs_without_a_terminal(live_server, key_for, capsys, monkeypatch, tmp_path) -> None:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    # The live server runs in this process and logs each 404 to the stderr this test reads; a logging
    # handler left by an earlier test on a stream since closed prints "--- Logging error ---" with a
    # traceback there, which is the server's and not the command's: only the command's own output counts.
    monkeypatch.setattr(logging, "raiseExceptions", False)
    secret = key_for(make_user("ada@example.com", role=StaffRole.ADMIN))
    base = ["ctl", "--server", live_server.url, "--key", secret]
    missing = str(tmp_path / "missing.yaml")
    failures = []
    for words, parser in ctl_commands():
        argv = [*base, *words, *_arguments(parser, missing)]
        monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal, and nothing to read
        try:
            status = main(argv)
        except SystemExit as exc:
            if isinstance(exc.code, str):  # the command's own one-line refusal, which Python prints on stderr
                assert exc.code.startswith("llmgw ctl: ") and "\n" not in exc.code.strip(), exc.code
                continue
            failures.append(f"{' '.join(words)}: argparse refused the test's arguments ({exc.code})")
            continue
        except Exception as exc:  # the traceback a script would have met
            failures.append(f"{' '.join(words)}: {type(exc).__name__}: {exc}")
            continue
        out, err = capsys.readouterr()
        assert isinstance(status, int)
        if "Traceback" in out + err:
            failures.append(f"{' '.join(words)}: printed a traceback: {(out + err)[-600:]}")
        elif status != 0 and not err.strip():
            failures.append(f"{' '.join(words)}: exit {status} without saying why on stderr")
    assert not failures, "\n".join(failures)


def test_model_delete_with_no_terminal_names_yes(live_server, key_for, capsys, monkeypatch, tmp_path) -> None:
    from apps.accounts.choices import StaffRole
    from tests.builders import make_model
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    # The live server runs in this process and logs each 404 to the stderr this test reads; a logging
    # handler left by an earlier test on a stream since closed prints "--- Logging error ---" with a
    # traceback there, which is the server's and not the command's: only the command's own output counts.
    monkeypatch.setattr(logging, "raiseExceptions", False)
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))
    make_model("tiny")
    base = ["ctl", "--server", live_server.url, "--key", secret]
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main([*base, "model", "delete", "tiny"]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "model tiny: not deleted: deleting asks for a confirmation and no terminal is attached to answer it; "
        "add --yes to delete without asking"
    ]
    assert main([*base, "model", "show", "tiny"]) == 0  # still there
    capsys.readouterr()
    assert main([*base, "model", "delete", "tiny", "--yes"]) == 0
    assert "deleted" in capsys.readouterr().out
