"""Usage records on local disk before the answer's last byte (apps/quotas/journal.py): a process
killed with SIGKILL right after appending loses nothing, its journal is settled by the next
process (each record written once, whatever was already stored); a living process's journal is
never taken for a dead one's; a writer's own closed segments are settled and removed."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from apps.quotas.journal import Journal, read_segment, settle_orphans
from apps.quotas.models import UsageRecord
from apps.quotas.usage import UsageWriter, write_missing, write_records_sync
from tests.quotas.conftest import make_key, record

KILLED = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from apps.quotas.journal import Journal
    journal = Journal(Path(sys.argv[1]))
    journal.open()
    for line in sys.stdin:
        journal.append(json.loads(line))
    os.kill(os.getpid(), signal.SIGKILL)  # at once after the last append: nothing is flushed or closed
    """
)


def as_json(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps({**r, "created_at": r["created_at"].timestamp()}) + "\n" for r in records)


@pytest.mark.django_db
def test_a_process_killed_after_appending_loses_nothing(bob: Any, tree: Any, tmp_path: Path) -> None:
    key = make_key(bob, tree.project)
    records = [record(key) for _ in range(200)]
    write_records_sync(records[:50])  # some reached the database the usual way before the kill
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, str(tmp_path)], input=as_json(records), text=True, timeout=60, check=False
    )
    assert killed.returncode == -signal.SIGKILL
    assert len(list(tmp_path.glob("*.jsonl"))) == 1 and len(list(tmp_path.glob("*.lock"))) == 1
    assert settle_orphans(tmp_path, write_missing) == 150
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == sorted(r["request_id"] for r in records)
    assert list(tmp_path.iterdir()) == []  # settled: nothing is settled twice
    assert settle_orphans(tmp_path, write_missing) == 0


@pytest.mark.django_db
def test_a_living_processs_journal_is_not_settled_by_another(bob: Any, tree: Any, tmp_path: Path) -> None:
    key = make_key(bob, tree.project)
    journal = Journal(tmp_path)
    journal.open()
    assert journal.append(record(key))
    assert settle_orphans(tmp_path, write_missing) == 0  # its lock is held (flock, another open file)
    assert UsageRecord.objects.count() == 0
    assert journal.settle(write_missing, older_than_s=0, everything=True) == 1
    journal.close()
    assert UsageRecord.objects.count() == 1 and list(tmp_path.iterdir()) == []


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    segment = tmp_path / "h-1-2.1.jsonl"
    segment.write_text('{"request_id": "a"}\n{"request_id": "b"}\n{"request_i')
    assert [r["request_id"] for r in read_segment(segment)] == ["a", "b"]


@pytest.mark.django_db(transaction=True)
def test_a_writer_whose_database_write_never_happened_settles_its_journal(bob: Any, tree: Any, tmp_path: Path) -> None:
    """The usual path loses the batch (a broker that dropped it, say): the closed segment settles it."""
    key = make_key(bob, tree.project)
    lost: list[int] = []
    writer = UsageWriter(
        write=lambda batch, touched=None: lost.append(len(batch)) or len(batch),
        interval=0.02,
        journal=Journal(tmp_path, segment_s=0.05),
        settle_after=0.0,
    )
    writer.settle_after = 0.1  # past the writer's own floor, for the test

    async def scenario() -> None:
        await writer.start()
        for _ in range(30):
            writer.emit(record(key, created_at=datetime.now(UTC) - timedelta(seconds=5)))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if await sync_to_async(UsageRecord.objects.count, thread_sensitive=False)() == 30:
                break
        await writer.stop()

    asyncio.run(scenario())
    assert sum(lost) == 30  # the usual path took them and dropped them
    assert UsageRecord.objects.count() == 30  # the journal had them
    assert list(tmp_path.iterdir()) == []


@pytest.mark.django_db
def test_the_workers_periodic_task_settles_the_journals_of_dead_processes(
    bob: Any, tree: Any, settings: Any, tmp_path: Path
) -> None:
    from apps.quotas.tasks import settle_usage_journals

    settings.DATA_DIR = tmp_path
    key = make_key(bob, tree.project)
    records = [record(key) for _ in range(5)]
    folder = tmp_path / "usage-journal"
    subprocess.run([sys.executable, "-c", KILLED, str(folder)], input=as_json(records), text=True, timeout=60)
    assert settle_usage_journals() == 5
    assert UsageRecord.objects.count() == 5
