"""Replicas replaced, moved and stopped while clients stream all the while, with the real agent and
llama-server under `llmgw up`: a profile change that replaces both replicas of a model, a scale-down,
a node drain, a deletion. Every stream is read to its end and must end with its finish reason; past
the drain grace a stream ends with an error naming the reason, never a bare close; and `llmgw up`
stopped finishes the requests in flight before it stops the engines."""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.helpers import alive
from tests.fleet import HOSTS, ControlPlane, fixtures_available

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "hi"}]
# Between one client's requests: the streams overlap all the while, and leave the two cores of a
# test machine some room for the worker that runs the reconciler.
PAUSE_S = 0.05


def _spec(weights: Path, parallel: int, replicas: int = 1) -> dict[str, Any]:
    """The model at a fixed count of replicas (so the load does not add one)."""
    return {
        "models": [
            {
                "name": "tiny",
                "source": str(weights),
                "replicas": {"min": replicas, "max": replicas},
                "profiles": [
                    {
                        "name": "cpu",
                        "engine": "llama.cpp",
                        "accelerator": "cpu",
                        "memory": "512MB",
                        "cpu_cores": 0.5,
                        "parallel": parallel,
                        "context_size": 512,
                        # A request may generate past its context: a test can hold one open.
                        "extra_args": ["--context-shift"],
                    }
                ],
            }
        ]
    }


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    from tests.enginebin import llama_server_path
    from tests.ggufgen import make_tiny_gguf

    engine = llama_server_path()
    if engine is None:
        pytest.skip("no llama-server binary (run scripts/ensure-llama-server)")
    return engine, make_tiny_gguf(tmp_path / "tiny.gguf")


def _apply(plane: ControlPlane, spec: Path, content: dict[str, Any]) -> None:
    spec.write_text(yaml.safe_dump(content))
    code, _out, err = plane.ctl("model", "apply", "-f", str(spec))
    assert code == 0, err


def _ready(plane: ControlPlane) -> list[dict[str, Any]]:
    """The model's ready replicas whose engine runs (pid known)."""
    replicas = plane.api("GET", "models/tiny")["replicas"]
    return [r for r in replicas if r["state"] == "ready" and r["shards"][0]["pid"]]


def _only(plane: ControlPlane, count: int, old: frozenset[int] | set[int] = frozenset()) -> set[int] | None:
    """The ready engines' pids once there are `count` of them, none of `old`, and nothing else left
    of the model (no replica starting, pending or stopping, no roll under way)."""
    model = plane.api("GET", "models/tiny")
    ready = {r["shards"][0]["pid"] for r in model["replicas"] if r["state"] == "ready" and r["shards"][0]["pid"]}
    settled = len(model["replicas"]) == count and model["status"]["rolling"] is None
    return ready if settled and len(ready) == count and not ready & old else None


class Clients:
    """Clients that ask all the while, each in its thread: `streams` stream (read to the end, the
    finish reason noted), `whole` do not. Every outcome is "ok" or says what went wrong. Answers of
    200 tokens keep streams in flight most of the time (at 16, an engine stopped at once broke
    none in a test run; at 200 it broke one as the campaign saw)."""

    def __init__(self, client: Any, streams: int = 3, whole: int = 1, max_tokens: int = 200) -> None:
        self.client = client
        self.max_tokens = max_tokens
        self.outcomes: list[str] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(self._stream,)) for _ in range(streams)]
        self.threads += [threading.Thread(target=self._run, args=(self._whole,)) for _ in range(whole)]

    def __enter__(self) -> Clients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(timeout=120)

    def _run(self, ask: Callable[[], str]) -> None:
        while not self.done.is_set():
            try:
                self.outcomes.append(ask())
            except Exception as exc:  # noqa: BLE001 - counted; the assertion says which
                self.outcomes.append(f"{type(exc).__name__}: {exc}")
            self.done.wait(PAUSE_S)

    def _stream(self) -> str:
        finish = None
        stream = self.client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=self.max_tokens, stream=True, extra_body={"ignore_eos": True}
        )
        for chunk in stream:  # to the end: [DONE], or an error event (the SDK raises it)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        return "ok" if finish == "length" else f"the stream ended without its finish reason ({finish})"

    def _whole(self) -> str:
        answer = self.client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=self.max_tokens, extra_body={"ignore_eos": True}
        )
        return (
            "ok" if answer.choices[0].finish_reason == "length" else f"finish reason {answer.choices[0].finish_reason}"
        )

    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]

    def streamed(self, before: int) -> Callable[[], bool]:
        """A check that more than `before` answers were counted (so a step had traffic all along)."""
        return lambda: len(self.outcomes) > before


def test_streams_across_a_roll_of_both_replicas_a_scale_down_and_a_deletion_all_end_with_their_finish_reason(
    tmp_path: Path,
) -> None:
    engine, weights = _setup(tmp_path)
    spec = tmp_path / "models.yaml"
    with ControlPlane(tmp_path, extra_env={"LLMGW_LLAMA_SERVER": str(engine)}) as plane:
        _apply(plane, spec, _spec(weights, parallel=2, replicas=2))
        first = plane.wait_for(lambda: _only(plane, 2), timeout=120, what="two replicas ready")
        client = openai.OpenAI(base_url=plane.url + "/v1", api_key=plane.key, max_retries=0, timeout=60)
        with Clients(client) as clients:
            # A profile change: each replica is replaced in its place (the model is at its maximum).
            _apply(plane, spec, _spec(weights, parallel=3, replicas=2))
            rolled = plane.wait_for(lambda: _only(plane, 2, first), timeout=180, what="both replicas replaced")
            counted = len(clients.outcomes)
            plane.wait_for(clients.streamed(counted), what="answers after the roll")
            # Scaled down: the newest replica stops, once the streams it holds have ended.
            code, _out, err = plane.ctl("model", "target", "tiny", "--min", "1", "--max", "1")
            assert code == 0, err
            kept = plane.wait_for(lambda: _only(plane, 1), timeout=120, what="one replica left")
            counted = len(clients.outcomes)
            plane.wait_for(clients.streamed(counted), what="answers after the scale-down")
        assert clients.outcomes and clients.failures() == [], clients.failures()[:5]
        for pid in first | (rolled - kept):
            plane.wait_for(lambda pid=pid: not alive(pid) or None, timeout=60, what=f"engine {pid} to stop")
        (second,) = kept
        command = Path(f"/proc/{second}/cmdline").read_bytes().split(b"\0")
        assert command[command.index(b"--parallel") + 1] == b"3"

        # Deleted: no route serves it from the next request on, and its engine stops.
        assert plane.ctl("model", "delete", "tiny", "--yes")[0] == 0
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
        plane.wait_for(lambda: not alive(second) or None, timeout=60, what="the deleted model's engine to stop")
        usage = plane.api("GET", "usage?group_by=model")
        assert any(row.get("group") == "tiny" for row in usage["results"])  # its history stays


def _endless(plane: ControlPlane, out: list[Any]) -> None:
    """Stream 10 million tokens (endless here), read as bytes as fast as they come (so the client
    never lags behind the engine), noting the first bytes, then the stream's last event."""
    body = {"model": "tiny", "messages": HI, "max_tokens": 10**7, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        plane.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            tail = b""
            while block := response.read1(1 << 16):
                if not out:
                    out.append("chunk")
                tail = (tail + block)[-4096:]
        events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: ")]
        out.append(json.loads(events[-1][6:]) if events and events[-1] != b"data: [DONE]" else "[DONE]")
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out.append(exc)


def _finite(client: Any, out: list[Any]) -> None:
    """Stream 2,000 tokens, noting the first chunk, then the finish reason (or the error)."""
    try:
        stream = client.chat.completions.create(
            model="tiny", messages=HI, max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        for chunk in stream:
            if not out:
                out.append("chunk")
            if chunk.choices and chunk.choices[0].finish_reason:
                out.append(chunk.choices[0].finish_reason)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out.append(exc)


def _reading(*work: tuple[Callable[..., None], Any, list[Any]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(client, out)) for target, client, out in work]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.skipif(not fixtures_available(), reason="the shared fixtures are not here")
def test_streams_across_a_node_drain_end_with_their_finish_reason_past_the_grace_with_why_and_llmgw_up_stops_last(
    tmp_path: Path,
) -> None:
    engine, weights = _setup(tmp_path)
    spec = tmp_path / "models.yaml"
    env = {"LLMGW_LLAMA_SERVER": str(engine), "LLMGW_DRAIN_GRACE_SECONDS": "6"}
    with ControlPlane(tmp_path, extra_env=env) as plane:
        plane.add_agent("cpu2", HOSTS["cpu"], settings={"engines": {"llama.cpp": str(engine)}})
        plane.wait_for(lambda: plane.node("cpu2").get("status") == "ready", what="cpu2 ready")
        _apply(plane, spec, _spec(weights, parallel=2))
        (first,) = plane.wait_for(lambda: _only(plane, 1), timeout=120, what="tiny ready")
        (replica,) = _ready(plane)
        drained = replica["shards"][0]["node"]
        client = openai.OpenAI(base_url=plane.url + "/v1", api_key=plane.key, max_retries=0, timeout=60)

        # A node drain: the replica is started on the other node, then this one drains and stops.
        with Clients(client) as clients:
            code, _out, err = plane.ctl("node", "drain", drained)
            assert code == 0, err
            (second,) = plane.wait_for(lambda: _only(plane, 1, {first}), timeout=180, what="the replica to move")
            counted = len(clients.outcomes)
            plane.wait_for(clients.streamed(counted), what="answers after the move")
        assert clients.outcomes and clients.failures() == [], clients.failures()[:5]
        (replica,) = _ready(plane)
        node = replica["shards"][0]["node"]
        assert node != drained
        plane.wait_for(lambda: not alive(first) or None, timeout=60, what="the drained engine to stop")
        assert plane.node(drained)["drain"]["left"] == 0

        # Its new node drained too, with a grace of 2 s and no room elsewhere (forced): the stream
        # it holds is cut off 2 s later, and says so.
        held: list[Any] = []
        (reader,) = _reading((_endless, plane, held))
        plane.wait_for(lambda: held, what="the endless stream's first chunk")
        code, _out, err = plane.ctl("node", "drain", node, "--grace", "2", "--force")
        assert code == 0, err
        reader.join(timeout=60)
        assert held[-1]["error"]["message"] == (
            f"the replica r{replica['id']} was stopped: its drain grace of 2 s ran out (its node is being drained)"
        ), held[-1:]
        plane.wait_for(lambda: not alive(second) or None, timeout=60, what="the drained engine to stop")
        local = drained if node == "cpu2" else node  # the node of llmgw up's own agent
        assert plane.ctl("node", "uncordon", local)[0] == 0
        (third,) = plane.wait_for(lambda: _only(plane, 1, {second}), timeout=120, what="tiny ready again")

        # llmgw up stopped: web takes no new request and answers those in flight (a short stream to its
        # end, an endless one until the drain grace is over, with an error saying so); then the engines go.
        short: list[Any] = []
        cut: list[Any] = []
        readers = _reading((_finite, client, short), (_endless, plane, cut))
        plane.wait_for(lambda: short and cut, what="both streams' first chunks")
        assert plane.running is not None
        plane.running.process.send_signal(signal.SIGTERM)
        for thread in readers:
            thread.join(timeout=60)
        assert short == ["chunk", "length"], short
        assert cut[-1]["error"]["message"] == (
            "the gateway was stopped: its drain grace of 6 s ran out (this llmgw web process is stopping)"
        ), cut[-1:]
        assert plane.running.process.wait(timeout=60) == 0
        assert not alive(third)
