"""The Go example of docs/clients.md, built and run as written against `llmgw up` serving the real
tiny llama.cpp engine (the `plane` of test_sdk_spec), with the official openai-go and
anthropic-sdk-go modules fetched by `go get` as the page says.

Where Go is not installed the test is skipped and says so; where the Go module proxy cannot be
reached, it is skipped with go's own last line. It never passes without having run the program.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gateway.test_sdk_spec import ControlPlane, plane  # noqa: F401 (the fixture)

NO_GO = "Go is not installed: the Go example of docs/clients.md was not built or run"

DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
MODULES = ("github.com/openai/openai-go/v3", "github.com/anthropics/anthropic-sdk-go")
GO_WAIT_S = 600.0  # fetching the modules and a first build on 2 cores: a bound, never a measure


def go_example(text: str) -> str:
    """The program in the page's Go section (its only ```go block)."""
    section = text.split("\n## Go\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```go\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Go section holds one program"
    return blocks[0]


def test_the_page_has_one_go_program_using_both_sdks() -> None:
    program = go_example(DOC.read_text())
    assert program.startswith("package main\n")
    for module in MODULES:
        assert f'"{module}"' in program


def _go(args: list[str], where: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["go", *args], cwd=where, env=env, capture_output=True, text=True, timeout=GO_WAIT_S, check=False
    )


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("go") is None, reason=NO_GO)
def test_the_go_example_runs_against_llmgw(plane: ControlPlane, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "main.go").write_text(go_example(DOC.read_text()))
    env = {**os.environ, "GOPATH": str(tmp_path / "gopath"), "GOFLAGS": "-modcacherw"}
    made = _go(["mod", "init", "example.com/llmgw-clients"], tmp_path, env)
    assert made.returncode == 0, made.stderr
    fetched = _go(["get", *MODULES], tmp_path, env)
    if fetched.returncode != 0:
        last = (fetched.stderr.strip().splitlines() or ["(nothing said)"])[-1]
        if "dial tcp" in fetched.stderr or "no such host" in fetched.stderr or "proxy" in fetched.stderr:
            pytest.skip(f"the Go modules could not be fetched here: {last}")
        pytest.fail(f"go get failed: {fetched.stderr}")
    env |= {"LLMGW_SERVER": plane.url, "LLMGW_API_KEY": plane.key, "LLMGW_MODEL": "tiny"}
    ran = _go(["run", "."], tmp_path, env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = dict(line.split(": ", 1) for line in ran.stdout.splitlines() if ": " in line)
    assert "chat" in lines, ran.stdout
    assert re.match(r"req_\w+ hardware: cpu$", lines["request id"]), ran.stdout
    first_id = lines["responses"].split(" ", 1)[0]
    assert first_id.startswith("resp_"), ran.stdout
    assert lines["continued"].startswith(first_id + " "), ran.stdout  # previous_response_id was followed
    assert "messages" in lines and "stream" in lines, ran.stdout
