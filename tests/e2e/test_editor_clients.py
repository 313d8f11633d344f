"""The real Codex CLI and Continue CLI, set up by the console's connection scripts, against `llmgw up`.

Each client runs as a person would run it: a fresh HOME, the script fetched from
/connect/<tool>.sh and run with `sh` (the key in LLMGW_API_KEY), then turns asked
non-interactively (`codex exec` and `exec resume --last`, `cn -p` and `cn -p --resume`).
The clients are the pinned npm releases that scripts/ensure-editor-clients installs; without
npm or a reachable registry the tests are skipped with its reason.

Each client has a model of its own, the tiny random-weight llama (tests.ggufgen) with one slot,
so a slot the gateway fails to give back shows as a 503 "No capacity" on that client's next turn
(and only there). Three settings of its
llama-server make it usable by an agent that sends a 20k-token prompt:

- `--override-kv llama.context_length=...`: llama-server caps a slot's context at the trained
  context (512 in the GGUF), whatever --ctx-size says; the model's answers are gibberish anyway;
- `--grammar`: the model never picks its end-of-text token by itself, so answers would run to
  the token limit, which the gateway rightly reports as an incomplete response (Codex then
  exits 1). A grammar that ends after a few words makes it stop as a real model does, and gives
  each answer a shape the tests can recognise (lowercase words and a full stop);
- `--n-predict`: a bound in case the grammar were ever not applied.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import processes
from tests.e2e.helpers import REPO
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e

MODELS = {"codex": "tiny-codex", "continue": "tiny-continue"}
CONTEXT = 65536  # Codex's first request alone is about 20k tokens of the tiny vocabulary
GRAMMAR = 'root ::= word (" " word){0,5} "."\nword ::= [a-z]{1,8}\n'
ANSWER = re.compile(r"[a-z]{1,8}( [a-z]{1,8}){0,5}\.")
TURN_TIMEOUT_S = 120

# What the clients print when a request or its stream fails: Codex's "ERROR: unexpected status
# 503 ...", "stream disconnected before completion", "Reconnecting... 1/5", "Incomplete response
# returned"; Continue's {"status":"error","message":"401 ..."}. The model's own text is
# lowercase words only (the grammar), so capitalised markers never come from it.
FAILURE_MARKERS = [
    re.compile(r"\bERROR\b"),
    re.compile(r"\bError\b"),
    re.compile(r"\berror:"),
    re.compile(r'"status"\s*:\s*"error"'),
    re.compile(r"stream disconnected", re.I),
    re.compile(r"Reconnecting", re.I),
    re.compile(r"unexpected status", re.I),
    re.compile(r"Incomplete response", re.I),
    re.compile(r"Failed to parse", re.I),
    re.compile(r"\b(Exception|Traceback|panicked)\b"),
    re.compile(r"\bstatus\W{0,3}[45]\d\d\b", re.I),
    re.compile(
        r"\b[45]\d\d (Bad Request|Unauthorized|Forbidden|Not Found|Conflict|Unprocessable|Too Many Requests"
        r"|Internal Server Error|Bad Gateway|Service Unavailable|Gateway Timeout)"
    ),
]

# Codex: never look for updates, send analytics or feedback (the network may be closed), and
# never retry, so that a failed request fails the turn at once instead of hiding behind a retry.
CODEX_SETTINGS = [
    "check_for_update_on_startup=false",
    "analytics.enabled=false",
    "feedback.enabled=false",
    "model_providers.llmgw.request_max_retries=0",
    "model_providers.llmgw.stream_max_retries=0",
]
# Continue: no OpenTelemetry metrics, and never install an update of itself.
CONTINUE_ENV = {"CONTINUE_CLI_ENABLE_TELEMETRY": "0", "CONTINUE_METRICS_ENABLED": "0", "CONTINUE_CLI_AUTO_UPDATED": "1"}


def _llama() -> str | None:
    from tests.enginebin import llama_server_path

    path = llama_server_path()
    return str(path) if path else None


@pytest.fixture(scope="module")
def clients() -> dict[str, Path]:
    """The pinned Codex and Continue executables, installed once into the user's cache."""
    if _llama() is None:
        from tests.enginebin import missing_reason

        pytest.skip(missing_reason())
    try:
        done = subprocess.run(
            [str(REPO / "scripts" / "ensure-editor-clients")], capture_output=True, text=True, timeout=900, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.skip("scripts/ensure-editor-clients did not finish installing the clients in 15 minutes")
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        pytest.skip(lines[-1] if lines else f"scripts/ensure-editor-clients exited {done.returncode}")
    found = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return {"codex": Path(found["codex"]), "continue": Path(found["cn"])}


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory, clients: dict[str, Path]) -> Iterator[ControlPlane]:
    from tests.ggufgen import make_tiny_gguf

    tmp = tmp_path_factory.mktemp("editors")
    weights = make_tiny_gguf(tmp / "tiny.gguf")
    spec = tmp / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": name,
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 1,
                                "context_size": CONTEXT,
                                "extra_args": [
                                    "--override-kv",
                                    f"llama.context_length=int:{CONTEXT}",
                                    "--grammar",
                                    GRAMMAR,
                                    "--n-predict",
                                    "96",
                                ],
                            }
                        ],
                    }
                    for name in MODELS.values()
                ]
            }
        )
    )
    env = {
        "LLMGW_LLAMA_SERVER": _llama() or "",
        "LLMGW_GATEWAY_COLD_START_TIMEOUT": "120",
        # A full reload of the gateway's tables every second, and a change of version seen within
        # a fifth of one: every turn of an agent spans reloads.
        "LLMGW_GATEWAY_RELOAD_SECONDS": "1",
        "LLMGW_GATEWAY_REFRESH_SECONDS": "0.2",
        # A slot that is never given back answers 503 after this, well within a turn's timeout.
        "LLMGW_GATEWAY_QUEUE_TIMEOUT": "20",
    }
    with ControlPlane(tmp, extra_env=env) as running:
        assert running.ctl("model", "apply", "-f", str(spec))[0] == 0
        running.wait_for(lambda: _serves(running.url, running.key), timeout=180, what="both models served")
        try:
            yield running
        finally:
            _stop_engine(running)


def _serves(url: str, key: str) -> bool:
    """The key reaches the gateway's tables and every model has a ready replica."""
    request = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            data = json.load(response)["data"]
    except urllib.error.HTTPError:
        return False
    ready = {m["id"] for m in data if m["llmgw"]["ready_replicas"]}
    return ready >= set(MODELS.values())


def _stop_engine(plane: ControlPlane) -> None:
    """The engine outlives `llmgw up` by design (agents keep engines running): stop it here."""
    for name in MODELS.values():
        with contextlib.suppress(Exception):
            for replica in plane.api("GET", f"models/{name}")["replicas"]:
                for shard in replica["shards"]:
                    if shard["pid"]:
                        os.killpg(shard["pid"], signal.SIGKILL)


@dataclass
class Turn:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float  # shown with the output, never asserted on

    def transcript(self) -> str:
        return (
            f"$ {' '.join(self.command)[:300]}\nexit {self.returncode} after {self.seconds:.1f} s\n"
            f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-6000:]}"
        )


@dataclass
class Person:
    """One person's machine: a fresh HOME, an API key of their own, one client set up by the script."""

    tool: str  # "codex" or "continue"
    binary: Path
    home: Path
    key: str
    key_id: int
    turns: list[Turn] = field(default_factory=list)

    @property
    def project(self) -> Path:
        return self.home / "project"

    def env(self) -> dict[str, str]:
        """Nothing of the real user's environment: their keys and configuration stay out of it."""
        node = shutil.which("node")
        path = [
            str(self.binary.parent),
            *([str(Path(node).parent)] if node else []),
            "/usr/local/bin",
            "/usr/bin",
            "/bin",
        ]
        env = {
            "PATH": os.pathsep.join(dict.fromkeys(path)),
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "NO_COLOR": "1",
            "LLMGW_API_KEY": self.key,
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_CACHE_HOME": str(self.home / ".cache"),
            "XDG_DATA_HOME": str(self.home / ".local" / "share"),
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "TMPDIR": str(self.home / "tmp"),
            **processes.marks(),  # so that the session's end finds an editor left running
        }
        if self.tool == "continue":
            env.update(CONTINUE_ENV)
        return env

    def connect(self, plane: ControlPlane) -> subprocess.CompletedProcess[str]:
        """`curl -fsSL <server>/connect/<tool>.sh?model=<name> | LLMGW_API_KEY=<key> sh`, as the account page says."""
        url = f"{plane.url}/connect/{self.tool}.sh?model={MODELS[self.tool]}"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert response.status == 200
            script = response.read().decode()
        (self.home / f"{self.tool}.sh").write_text(script)
        return subprocess.run(
            ["sh"], input=script, env=self.env(), cwd=self.home, capture_output=True, text=True, timeout=60, check=False
        )

    def command(self, prompt: str) -> list[str]:
        resume = bool(self.turns)
        if self.tool == "codex":
            settings = [word for setting in CODEX_SETTINGS for word in ("-c", setting)]
            return [
                str(self.binary),
                "--profile",
                "llmgw",
                "--sandbox",
                "read-only",
                "--ask-for-approval",
                "never",
                *settings,
                "exec",
                "--skip-git-repo-check",
                "--color",
                "never",
                *(["resume", "--last"] if resume else []),
                prompt,
            ]
        config = self.home / ".continue" / "assistants" / "llmgw.yaml"
        return [str(self.binary), "-p", "--config", str(config), *(["--resume"] if resume else []), prompt]

    def ask(self, prompt: str) -> Turn:
        """One turn, non-interactive; the client and everything it started are stopped if it outlasts the limit."""
        command = self.command(prompt)
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            env=self.env(),
            cwd=self.project,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = process.communicate(timeout=TURN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            stderr += f"\n[killed after {TURN_TIMEOUT_S} s]"
        turn = Turn(command, process.returncode, stdout, stderr, time.monotonic() - started)
        self.turns.append(turn)
        number = len(self.turns)
        (self.home.parent / f"{self.tool}-turn{number}.txt").write_text(turn.transcript())
        return turn


@pytest.fixture
def person(request: pytest.FixtureRequest, plane: ControlPlane, clients: dict[str, Path], tmp_path: Path) -> Person:
    """A person with a key of their own (so that usage can be told apart), set up by the console's script."""
    tool: str = request.param
    created = plane.api("POST", "keys/", {"name": f"{tool} on a laptop"})
    plane.wait_for(lambda: _serves(plane.url, created["key"]), timeout=30, what="the new key in the gateway's tables")
    home = tmp_path / "home"
    for folder in ("project", "tmp", ".config", ".cache"):
        (home / folder).mkdir(parents=True)
    if tool == "continue":
        # Continue's own switch for updates, as the person would have set it in the CLI.
        (home / ".continue" / "index").mkdir(parents=True)
        (home / ".continue" / "index" / "globalContext.json").write_text(json.dumps({"autoUpdateCli": False}))
    someone = Person(tool=tool, binary=clients[tool], home=home, key=created["key"], key_id=created["id"])
    done = someone.connect(plane)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Wrote" in done.stdout
    if tool == "codex":
        assert (home / ".codex" / "config.toml").read_text().count("[model_providers.llmgw]") == 1
        assert (home / ".codex" / "llmgw.config.toml").is_file()
    else:
        assert (home / ".continue" / "assistants" / "llmgw.yaml").is_file()
        assert (home / ".continue" / ".env").read_text() == f"LLMGW_API_KEY={someone.key}\n"
    return someone


def assert_answered(plane: ControlPlane, person: Person, turn: Turn) -> None:
    """Exit 0, nothing that reads as a failed request or stream, and the model's words on stdout.

    A failure shows the client's output and what the gateway recorded for the person's key (a
    client that retries a 503 quietly until it is stopped shows only there)."""
    output = turn.stdout + "\n" + turn.stderr
    failures = [marker.pattern for marker in FAILURE_MARKERS if marker.search(output)]
    if turn.returncode != 0 or failures or not ANSWER.fullmatch(turn.stdout.strip()):
        pytest.fail(
            f"{person.tool} turn {len(person.turns)} failed {failures}\n{turn.transcript()}\n"
            f"--- the gateway's usage for this key\n{usage_of(plane, person.key_id)}",
            pytrace=False,
        )


def usage_of(plane: ControlPlane, key_id: int) -> dict[str, Any]:
    rows = plane.api("GET", "usage?group_by=key")["results"]
    return next((row for row in rows if row["group"] == key_id), {"requests": 0})


def assert_recorded(plane: ControlPlane, person: Person, at_least: int) -> None:
    """The gateway counted the turns' requests (written in batches, so waited for), none failed or refused."""

    def enough() -> dict[str, Any] | None:
        row = usage_of(plane, person.key_id)
        return row if row["requests"] >= at_least else None

    row = plane.wait_for(enough, timeout=30, what=f"{at_least} requests of {person.tool} in the usage")
    assert row["errors"] == 0 and row["refusals"] == 0, row
    assert row["requests_without_tokens"] == 0 and row["prompt_tokens"] > 0 and row["completion_tokens"] > 0, row


class TableChurn(threading.Thread):
    """Moves the gateway's table version several times a second, for as long as it runs: each API key
    made and revoked is a change of the key table that every gateway process must reload."""

    def __init__(self, plane: ControlPlane) -> None:
        super().__init__(daemon=True)
        self.plane = plane
        self.changes = 0
        self.failure: BaseException | None = None
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while not self._stop_event.is_set():
                created = self.plane.api("POST", "keys/", {"name": "churn"})
                self.plane.api("POST", f"keys/{created['id']}/revoke")
                self.changes += 2
                self._stop_event.wait(0.1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in the thread
            self.failure = exc

    def __enter__(self) -> TableChurn:
        self.start()
        # The version has moved at least once before the turn begins.
        deadline = time.monotonic() + 30
        while self.changes == 0 and self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_event.set()
        self.join(timeout=60)


# A prompt long enough that its turn lasts seconds (the tiny vocabulary is nearly a token per
# character), so that the gateway reloads its tables while the request is being answered.
LONG_PROMPT = "Read these notes, then say in one line what they are about. " + " ".join(
    f"note {i}: the gateway keeps one slot for this model and must give it back when the answer ends."
    for i in range(100)
)

CLIENTS = pytest.mark.parametrize("person", ["codex", "continue"], indirect=True)


@CLIENTS
def test_a_client_set_up_by_the_connect_script_answers_a_turn_and_a_resumed_one(
    plane: ControlPlane, person: Person
) -> None:
    assert_answered(plane, person, person.ask("Say hello in a few words."))
    assert_answered(plane, person, person.ask("Now say it again, differently."))
    assert_recorded(plane, person, at_least=2)


@CLIENTS
def test_a_turn_answered_while_the_tables_reload_gives_its_slot_back_for_the_next(
    plane: ControlPlane, person: Person
) -> None:
    assert_answered(plane, person, person.ask("Say hello in a few words."))
    with TableChurn(plane) as churn:
        during = person.ask(LONG_PROMPT)
    assert churn.failure is None, repr(churn.failure)
    assert churn.changes >= 2
    assert_answered(plane, person, during)
    # One slot: had the turn across the reloads kept it, this one would wait, then get 503 "No capacity".
    assert_answered(plane, person, person.ask("And one more short answer, please."))
    assert_recorded(plane, person, at_least=3)
