"""A batch under `llmgw up` with the real llama-server, through the official OpenAI SDK, while its
processes are killed: kill -9 of the worker (its Celery processes; the `llmgw worker` above them
starts them again), then kill -9 of web, which stops `llmgw up`, then `llmgw up` started again on
the same data. The batch goes on where it was, and every line is in the output file once, with one
usage record that answered it.

With Redis (how the suite's end-to-end streams run) the lines run in the worker's processes, so the
first kill cuts lines off in flight; without it they run in the web process, and the second does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.e2e.helpers import REPO, descendants
from tests.e2e.test_models import llama_server
from tests.fleet import ControlPlane

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")

LINES = 80
#: Each line generates this many tokens (ignore_eos): long enough that both kills land mid-batch.
TOKENS = 400


def commands(plane: ControlPlane) -> dict[int, list[bytes]]:
    found = {}
    for pid in plane.children():
        try:
            found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
    return found


def kill_the_worker(plane: ControlPlane) -> list[int]:
    """kill -9 the Celery worker and its pool (not the `llmgw worker` that starts them again)."""
    killed = [pid for pid, argv in commands(plane).items() if b"worker" in argv and b"--no-restart" in argv]
    assert killed, "no Celery worker process found"
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    return killed


def web_pid(plane: ControlPlane) -> int:
    (pid,) = [pid for pid, argv in commands(plane).items() if argv[1:4] == [b"-m", b"llmgw", b"web"]]
    return pid


def progress(client: object, batch_id: str) -> tuple[str, int, int]:
    batch = client.batches.retrieve(batch_id)  # type: ignore[attr-defined]
    counts = batch.request_counts
    return batch.status, (counts.completed if counts else 0), (counts.failed if counts else 0)


def wait_for_more(client: object, batch_id: str, than: int, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, done, failed = progress(client, batch_id)
        assert failed == 0, f"a line failed: {client.batches.retrieve(batch_id)}"  # type: ignore[attr-defined]
        if done > than or status == "completed":
            return done
        time.sleep(0.3)
    pytest.fail(f"the batch made no progress past {than} lines in {timeout} s")


def usage_of(plane: ControlPlane, batch_id: str) -> list[dict[str, object]]:
    """The batch's usage records, read from the control plane's database by its own manage command."""
    assert plane.running is not None
    code = (
        "import json; from apps.quotas.models import UsageRecord; "
        f"print(json.dumps(list(UsageRecord.objects.filter(batch={batch_id!r}).values('request_id', 'status'))))"
    )
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "shell", "-c", code],
        cwd=REPO,
        env=plane.running.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(llama_server() is None, reason="no llama-server binary (run scripts/ensure-llama-server)")
def test_a_batch_goes_on_through_kill_9_of_the_worker_and_of_web_and_a_restart_of_up(tmp_path: Path) -> None:
    from tests.ggufgen import make_tiny_gguf

    (tmp_path / "data" / "models").mkdir(parents=True)
    weights = make_tiny_gguf(tmp_path / "data" / "models" / "tiny.gguf")
    spec = tmp_path / "models.yaml"
    profile = {"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "512MB", "cpu_cores": 1}
    spec.write_text(yaml.safe_dump({"models": [{"name": "tiny", "source": str(weights), "profiles": [profile]}]}))
    env = {"LLMGW_LLAMA_SERVER": str(llama_server()), "LLMGW_BATCH_LEASE_SECONDS": "4"}
    lines = [
        {
            "custom_id": f"q-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"question {i}"}],
                "max_tokens": TOKENS,
                "ignore_eos": True,
            },
        }
        for i in range(LINES)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)

    first = ControlPlane(tmp_path, extra_env=env, up_args=["--keep-engines"], keep_database=True)
    with first as plane:
        assert plane.ctl("model", "apply", "-f", str(spec))[0] == 0
        plane.wait_for(lambda: plane.serves("tiny"), timeout=180, what="tiny served")
        client = openai.OpenAI(base_url=plane.url + "/v1", api_key=plane.key, max_retries=3)
        file = client.files.create(file=("questions.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")

        done = wait_for_more(client, batch.id, 1)
        assert done < LINES, "the batch ended before the worker could be killed: make its lines longer"
        killed = kill_the_worker(plane)
        plane.wait_for(
            lambda: any(b"--no-restart" in argv and pid not in killed for pid, argv in commands(plane).items()),
            timeout=60,
            what="the worker started again",
        )
        status, done, _failed = progress(client, batch.id)
        assert done < LINES, "the batch ended before web could be killed: make its lines longer"

        os.kill(web_pid(plane), signal.SIGKILL)
        assert plane.running is not None
        assert plane.running.process.wait(timeout=120) == 1  # `llmgw up` stops when one of its processes dies
        assert not [pid for pid in descendants(plane.running.process.pid) if pid != plane.running.process.pid]

        log = (tmp_path / "data" / "logs" / "up.log").read_text(errors="replace")
        hosted = "batch runner: running batch lines in this worker process" in log
        assert hosted == bool(plane.running.env.get("LLMGW_REDIS_URL")), "lines ran in the wrong process"

    with ControlPlane(tmp_path, extra_env=env, reuse=first) as again:
        client = openai.OpenAI(base_url=again.url + "/v1", api_key=first.key, max_retries=3)
        deadline = time.monotonic() + 300
        while (status := progress(client, batch.id))[0] not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, f"the batch did not end after the restart: {status}"
            time.sleep(0.5)
        ended = client.batches.retrieve(batch.id)
        assert ended.status == "completed", ended
        assert ended.request_counts.completed == LINES and ended.request_counts.failed == 0
        output = [json.loads(line) for line in client.files.content(ended.output_file_id).content.splitlines()]
        assert sorted(entry["custom_id"] for entry in output) == sorted(line["custom_id"] for line in lines)
        assert all(entry["response"]["status_code"] == 200 for entry in output)
        answered = {entry["response"]["request_id"] for entry in output}
        # The tries' tally on /metrics counts every line once, whichever process ran it (the worker's,
        # or the web process killed half way) and through the restart.
        scrape = urllib.request.urlopen(again.url + "/metrics", timeout=30).read().decode()
        succeeded = re.search(r'^llmgw_batch_lines_total\{status="succeeded"\} (\S+)$', scrape, re.M)
        assert succeeded is not None and float(succeeded.group(1)) == LINES, [
            line for line in scrape.splitlines() if line.startswith("llmgw_batch_lines")
        ]
        # A killed web process's journal of usage is written by the next one, within a while.
        deadline = time.monotonic() + 150
        while True:
            records = usage_of(again, batch.id)
            written = {str(record["request_id"]) for record in records if record["status"] == 200}
            if answered <= written or time.monotonic() > deadline:
                break
            time.sleep(2)

    # One usage record per answer the output holds; a try cut off by a kill may have its own (not 200).
    by_request = {str(record["request_id"]): record["status"] for record in records}
    assert all(by_request.get(request_id) == 200 for request_id in answered), (answered, by_request)
    assert sum(1 for status in by_request.values() if status == 200) == LINES
    # The worker keeps no database pool for Celery's clean-up after each task to close under the
    # runner's thread ("the pool 'pool-5' is closed" in its table refreshes and passes, before).
    log = (tmp_path / "data" / "logs" / "up.log").read_text(errors="replace")
    closed = [line for line in log.splitlines() if line.startswith("worker") and "pool" in line and "closed" in line]
    assert closed == [], "\n".join(closed[:10])
    where = "the worker" if hosted else "the web process"
    print(f"\nbatch of {LINES} lines run in {where}: {len(records)} usage records, killed worker processes {killed}")
