"""Where lines run (apps.batches.host): the worker's processes with Redis, the web process without it,
and a runner hosted on its own thread and gateway answering a batch the web process does not run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from apps.batches import host
from apps.batches.models import BatchLine
from tests.batches.harness import World, chat_line, db

REPO = Path(__file__).resolve().parents[2]


def resolved(data_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_"))}
    clean.update({"LLMGW_DATA_DIR": str(data_dir), "DJANGO_SETTINGS_MODULE": "llmgw.settings", **env})
    code = "from django.conf import settings; print(settings.BATCH_RUNNER)"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=clean, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "web"),
        ({"LLMGW_REDIS_URL": "redis://127.0.0.1:6379/0"}, "worker"),
        ({"LLMGW_REDIS_URL": "redis://127.0.0.1:6379/0", "LLMGW_BATCH_RUNNER": "web"}, "web"),
        ({"LLMGW_BATCH_RUNNER": "0"}, "off"),
        ({"LLMGW_REDIS_URL": "redis://127.0.0.1:6379/0", "LLMGW_BATCH_RUNNER": "1"}, "worker"),
    ],
)
def test_lines_run_in_the_worker_where_redis_shares_the_slots_and_in_web_without_it(
    tmp_path: Path, env: dict[str, str], expected: str
) -> None:
    result = resolved(tmp_path, **env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected


def test_the_worker_without_redis_is_refused_saying_why(tmp_path: Path) -> None:
    result = resolved(tmp_path, LLMGW_BATCH_RUNNER="worker")
    assert result.returncode != 0
    assert "LLMGW_BATCH_RUNNER=worker needs LLMGW_REDIS_URL" in result.stderr
    assert "could neither see nor give way" in result.stderr


def test_a_worker_process_starts_a_runner_only_when_lines_run_in_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.conf import settings

    started: list[host.RunnerHost] = []
    monkeypatch.setattr(host.RunnerHost, "start", lambda self: started.append(self))
    monkeypatch.setattr(host, "_host", None)
    monkeypatch.setattr(settings, "BATCH_RUNNER", "web")
    host._process_started()
    assert started == []
    monkeypatch.setattr(settings, "BATCH_RUNNER", "worker")
    host._process_started()
    host._process_started()  # a second signal in the same process starts no second runner
    assert len(started) == 1
    stopped: list[bool] = []
    monkeypatch.setattr(host.RunnerHost, "stop", lambda self, timeout=0: stopped.append(True))
    host._process_stopping()
    assert stopped == [True] and host._host is None


async def test_a_hosted_runner_answers_a_batch_the_web_side_does_not_run_and_gives_its_lines_back(
    world: World,
) -> None:
    await world.runner.stop()  # the web side takes files and batches only, as with LLMGW_BATCH_RUNNER=worker
    hosted = host.RunnerHost(tick_s=0.05, advance_s=0.2, retry_s=0.05)
    hosted.start()
    try:
        assert await asyncio.to_thread(hosted.started.wait, 30)
        assert hosted.failure is None
        lines = [chat_line(f"line-{i}", f"question {i}") for i in range(6)]
        file = await world.upload(lines)
        batch = await world.openai().batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await world.ended(batch.id)
        assert done.status == "completed" and done.request_counts.completed == 6
        content = (await world.openai().files.content(done.output_file_id)).content
        answers = {
            entry["custom_id"]: entry["response"]["body"]["choices"][0]["message"]["content"]
            for entry in map(json.loads, content.splitlines())
        }
        assert answers == {f"line-{i}": f"echo: question {i}" for i in range(6)}
        assert hosted.app is not world.app  # its own gateway, not the web side's
    finally:
        await asyncio.to_thread(hosted.stop)
    assert hosted.thread is not None and not hosted.thread.is_alive()
    held = await db(lambda: BatchLine.objects.exclude(lease_owner="").count())
    assert held == 0


async def test_a_hosted_runner_that_could_not_start_tries_again(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    from django.db.utils import OperationalError

    from apps.gateway.asgi import GatewayApp

    await world.runner.stop()
    real_startup = GatewayApp.startup
    tries: list[int] = []

    async def startup(self: GatewayApp) -> None:
        tries.append(1)
        if len(tries) == 1:  # as when the worker closed the process's database pool under the thread
            raise OperationalError("the pool 'pool-5' is closed")
        await real_startup(self)

    monkeypatch.setattr(GatewayApp, "startup", startup)
    hosted = host.RunnerHost(tick_s=0.05, advance_s=0.2, retry_s=0.05)
    hosted.start()
    try:
        assert await asyncio.to_thread(hosted.started.wait, 30)
        assert len(tries) == 2 and hosted.failure is None and hosted.runner is not None
        file = await world.upload([chat_line("only", "after a failed start")])
        batch = await world.openai().batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await world.ended(batch.id)
        assert done.status == "completed" and done.request_counts.completed == 1
    finally:
        await asyncio.to_thread(hosted.stop)
