"""Two `llmgw beat` processes for real, on one database and broker: one acts and the other stands
by; `kill -9` of the acting one and the other takes over within two lease periods; and across
the failover no periodic task is sent twice within its interval (read from both beats' logs)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, drop_pg_database, free_port, llmgw_env, pg_database_url
from tests.e2e.production import Service, wait_for

pytestmark = [pytest.mark.e2e]

LEASE_S = 3.0
RECONCILE_S = 5.0  # settings.CELERY_BEAT_SCHEDULE["reconcile"]
SENT = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO celery.beat: Scheduler: Sending due task reconcile ", re.M
)


def sends(*beats: Service) -> list[tuple[float, str]]:
    """(when, beat) of every reconcile sent, in order."""
    found = []
    for beat in beats:
        for match in SENT.finditer(beat.log(tail=10**7)):
            # the beats' local time, as time.time() is read against it
            moment = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # noqa: DTZ007
            found.append((moment, beat.name))
    return sorted(found)


def acts(beat: Service) -> bool:
    log = beat.log(tail=10**7)
    return beat.running and log.rfind(": acting") > log.rfind("standing by")


def test_one_beat_acts_and_another_takes_over_when_it_is_killed(tmp_path: Path) -> None:
    database = pg_database_url()
    env = llmgw_env(tmp_path / "data", free_port(), LLMGW_BEAT_LEASE_SECONDS=str(LEASE_S), LLMGW_LOG_LEVEL="info")
    if database:
        env["LLMGW_DATABASE_URL"] = database
    python = [sys.executable, "-m", "llmgw"]
    beats: list[Service] = []
    try:
        subprocess.run([*python, "manage", "migrate", "-v", "0"], cwd=REPO, env=env, check=True, timeout=300)
        beats = [Service(f"beat{n}", [*python, "beat"], env, tmp_path / f"beat{n}.log").start() for n in (1, 2)]
        wait_for(lambda: sum(map(acts, beats)) == 1 and sends(*beats), "one beat to act and send", timeout=90)
        time.sleep(2 * RECONCILE_S)
        (first,) = [b for b in beats if acts(b)]
        (second,) = [b for b in beats if b is not first]
        assert "standing by (another scheduler acts)" in second.log()
        killed_at = first.kill()
        wait_for(lambda: acts(second), "the other beat to act", timeout=30)
        wait_for(lambda: [t for t, name in sends(*beats) if name == second.name], "the other beat to send", timeout=30)
        taken = [t for t, name in sends(*beats) if name == second.name]
        time.sleep(2 * RECONCILE_S)
        moments = sends(*beats)
    finally:
        for beat in beats:
            beat.stop(grace=5)
        if database:
            drop_pg_database(database)
    logs = "\n".join(b.log() for b in beats)
    # The other one sent its first reconcile within two lease periods and one interval of the kill
    # (the lease must expire, it must ask, and the task's interval since the last send must pass).
    assert taken[0] - killed_at <= 2 * LEASE_S + RECONCILE_S + 1, (taken[0] - killed_at, logs)
    gaps = [later - earlier for (earlier, _a), (later, _b) in zip(moments, moments[1:], strict=False)]
    assert gaps and min(gaps) >= RECONCILE_S - 0.5 - 0.05, (moments, logs)  # never twice in one interval
    assert {name for _t, name in moments} == {first.name, second.name}
