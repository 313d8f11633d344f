"""Deals the suite's slow test files (tests/e2e, tests/browser) into streams of about equal time, for
scripts/test to run side by side: the longest first, each to the stream with the least so far.

    python -m tests.lanes N     # N lines, each the files of one stream, separated by spaces

Dealt in turn by name, two streams had come out at 19 and 14 minutes (the fault tests alone take
five). COSTS are each file's seconds in one stream of a whole run on two cores (two streams and
the other tests on PostgreSQL side by side; measured again whenever the streams end far apart):
only their proportions matter. A file not listed counts as DEFAULT_S.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_S = 20
COSTS = {
    "e2e/test_faults.py": 294,
    "e2e/test_editor_clients.py": 66,
    "e2e/test_rolling.py": 61,
    "browser/test_console.py": 57,
    "browser/test_facility_page.py": 51,
    "browser/test_mirror_road.py": 45,
    "e2e/test_beat.py": 43,
    "e2e/test_connections.py": 43,
    "browser/test_layout_language.py": 42,
    "e2e/test_fabrics.py": 41,
    "e2e/test_scaling.py": 39,
    "e2e/test_gpu_time.py": 38,
    "browser/test_gateway_cors.py": 33,
    "e2e/test_storms.py": 29,
    "browser/test_chat_math.py": 29,
    "e2e/test_mirror.py": 28,
    "e2e/test_batches_up.py": 27,
    "e2e/test_models.py": 26,
    "e2e/test_fabric_map.py": 24,
    "e2e/test_up_terminal.py": 22,
    "browser/test_batches_page.py": 22,
    "browser/test_nvlink_drawing.py": 20,
    "browser/test_fabric_drawing.py": 19,
    "browser/test_people_structure.py": 18,
    "e2e/test_nodes.py": 18,
    "e2e/test_engine_install.py": 16,
    "e2e/test_quiet_web.py": 15,
    "e2e/test_fabric_test.py": 13,
    "e2e/test_guardrails_web.py": 13,
    "e2e/test_nvlink.py": 13,
    "e2e/test_revoke.py": 12,
    "e2e/test_facility_power.py": 12,
    "e2e/test_context.py": 11,
    "e2e/test_up.py": 11,
    "e2e/test_facility.py": 11,
    "e2e/test_web_workers.py": 11,
    "e2e/test_worker_restart.py": 10,
    "e2e/test_up_stop.py": 8,
    "e2e/test_onboarding.py": 8,
    "e2e/test_slices_fleet.py": 8,
    "e2e/test_python_engine_install.py": 7,
    "e2e/test_web_alone.py": 6,
    "e2e/test_desired_push.py": 5,
}


def slow_files() -> list[str]:
    """The files the lanes share, as paths from the repository's root."""
    found = sorted([*HERE.glob("e2e/test_*.py"), *HERE.glob("browser/test_*.py")])
    return [path.relative_to(HERE.parent).as_posix() for path in found]


def deal(files: list[str], lanes: int) -> list[list[str]]:
    """The files in `lanes` lanes, longest first, each to the lane with the least time so far."""
    loads = [0] * lanes
    dealt: list[list[str]] = [[] for _ in range(lanes)]
    cost = {name: COSTS.get(name.removeprefix("tests/"), DEFAULT_S) for name in files}
    for name in sorted(files, key=lambda n: (-cost[n], n)):
        lane = loads.index(min(loads))
        loads[lane] += cost[name]
        dealt[lane].append(name)
    return dealt


def main(argv: list[str]) -> int:
    lanes = int(argv[1]) if len(argv) > 1 else 2
    for files in deal(slow_files(), lanes):
        print(" ".join(sorted(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
