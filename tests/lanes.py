"""Deals the suite's test files into lanes of about equal time, for scripts/test to run side by side:
the longest first, each to the lane with the least so far.

    python -m tests.lanes N          # the slow files (tests/e2e, tests/browser) in N streams
    python -m tests.lanes units N    # the other files in N lanes

Each prints N lines, each the files of one lane separated by spaces.

Dealt in turn by name, two streams had come out at 19 and 14 minutes (the fault tests alone take
five). COSTS and UNIT_COSTS are each file's seconds in a whole run on two cores, all lanes side by
side: only their proportions matter.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_S = 20
COSTS = {
    "e2e/test_faults.py": 318,
    "e2e/test_editor_clients.py": 92,
    "e2e/test_rolling.py": 66,
    "browser/test_console.py": 66,
    "browser/test_facility_page.py": 63,
    "browser/test_layout_language.py": 55,
    "e2e/test_beat.py": 55,
    "e2e/test_connections.py": 50,
    "browser/test_mirror_road.py": 49,
    "e2e/test_fabrics.py": 47,
    "e2e/test_scaling.py": 43,
    "browser/test_chat_math.py": 40,
    "e2e/test_gpu_time.py": 39,
    "e2e/test_mirror.py": 37,
    "browser/test_gateway_cors.py": 36,
    "e2e/test_models.py": 35,
    "e2e/test_fabric_map.py": 35,
    "e2e/test_batches_up.py": 35,
    "e2e/test_storms.py": 30,
    "e2e/test_nodes.py": 29,
    "browser/test_fabric_drawing.py": 28,
    "e2e/test_guardrails_web.py": 26,
    "e2e/test_fabric_test.py": 22,
    "e2e/test_up_terminal.py": 20,
    "e2e/test_context.py": 20,
    "browser/test_nvlink_drawing.py": 20,
    "browser/test_people_structure.py": 18,
    "e2e/test_web_workers.py": 18,
    "e2e/test_facility_power.py": 18,
    "e2e/test_revoke.py": 18,
    "e2e/test_engine_install.py": 17,
    "e2e/test_facility.py": 17,
    "e2e/test_onboarding.py": 16,
    "browser/test_batches_page.py": 14,
    "e2e/test_up_stop.py": 13,
    "e2e/test_up.py": 13,
    "e2e/test_slices_fleet.py": 13,
    "e2e/test_desired_push.py": 13,
    "e2e/test_worker_restart.py": 12,
    "e2e/test_nvlink.py": 11,
    "e2e/test_python_engine_install.py": 11,
    "e2e/test_quiet_web.py": 10,
    "e2e/test_web_alone.py": 5,
}

# The other tests (all but tests/e2e and tests/browser), which scripts/test runs in lanes of their
# own: each file's seconds in a whole run as above, counted from its tests of 0.3 s or more, plus one
# for the many shorter ones. A file not listed counts as UNIT_DEFAULT_S.
UNIT_DEFAULT_S = 1
UNIT_COSTS = {
    "llmgw/test_api_schema.py": 135,
    "accounts/test_access.py": 80,
    "sim/test_pages.py": 61,
    "agent/test_install_pyenv.py": 28,
    "gateway/test_sdk.py": 26,
    "mirror/test_hostile_hub.py": 19,
    "agent/test_install_engines.py": 17,
    "agent/test_supervisor.py": 14,
    "gateway/test_stored_responses.py": 13,
    "gateway/test_slots.py": 13,
    "cluster/test_consumer.py": 13,
    "cluster/test_cluster_page.py": 12,
    "mirror/test_fetch.py": 12,
    "sim/test_sim.py": 11,
    "gateway/test_sdk_spec.py": 11,
    "cluster/test_engines.py": 10,
    "llmgw/test_body_limits.py": 10,
    "deploy/test_prometheus.py": 9,
    "agent/test_redirects.py": 9,
    "quotas/test_journal.py": 8,
    "batches/test_openai_sdk.py": 8,
    "mirror/test_pages.py": 7,
    "batches/test_durable.py": 7,
    "accounts/test_oidc.py": 7,
    "cluster/test_rollup.py": 7,
    "catalog/test_views.py": 7,
    "llmgw/test_admin_audit.py": 7,
    "agent/test_install_source.py": 7,
    "fabrics/test_topology.py": 6,
    "batches/test_anthropic_sdk.py": 6,
    "gateway/test_shared_slots.py": 6,
    "cluster/test_reconciler.py": 6,
    "llmgw/test_collect_static.py": 6,
    "accounts/test_signin.py": 6,
    "llmgw/test_channel_layer.py": 6,
    "batches/test_bad_input.py": 5,
    "mirror/test_lora.py": 5,
    "mirror/test_estimate.py": 5,
    "agent/test_install_fetch.py": 4,
    "gateway/test_chat_math.py": 4,
    "batches/test_host.py": 4,
    "agent/test_mirror_sync.py": 4,
    "batches/test_yield.py": 4,
    "batches/test_ownership.py": 4,
    "fabrics/test_agent_answers.py": 4,
    "llmgw/test_docs.py": 4,
    "placement/test_properties.py": 4,
    "accounts/test_shares.py": 3,
    "agent/test_parsers_mutated.py": 3,
    "gateway/test_cors.py": 3,
    "cluster/test_views.py": 3,
    "agent/test_engine_metrics.py": 3,
}


def slow_files() -> list[str]:
    """The files the streams share, as paths from the repository's root."""
    found = sorted([*HERE.glob("e2e/test_*.py"), *HERE.glob("browser/test_*.py")])
    return [path.relative_to(HERE.parent).as_posix() for path in found]


def unit_files() -> list[str]:
    """Every other test file, as paths from the repository's root."""
    slow = {HERE / "e2e", HERE / "browser"}
    found = sorted(path for path in HERE.rglob("test_*.py") if not slow & set(path.parents))
    return [path.relative_to(HERE.parent).as_posix() for path in found]


def deal(files: list[str], lanes: int, costs: dict[str, int] = COSTS, default: int = DEFAULT_S) -> list[list[str]]:
    """The files in `lanes` lanes, longest first, each to the lane with the least time so far."""
    loads = [0] * lanes
    dealt: list[list[str]] = [[] for _ in range(lanes)]
    cost = {name: costs.get(name.removeprefix("tests/"), default) for name in files}
    for name in sorted(files, key=lambda n: (-cost[n], n)):
        lane = loads.index(min(loads))
        loads[lane] += cost[name]
        dealt[lane].append(name)
    return dealt


def main(argv: list[str]) -> int:
    if argv[1:2] == ["units"]:
        dealt = deal(unit_files(), int(argv[2]) if len(argv) > 2 else 2, UNIT_COSTS, UNIT_DEFAULT_S)
    else:
        dealt = deal(slow_files(), int(argv[1]) if len(argv) > 1 else 2)
    for files in dealt:
        print(" ".join(sorted(files)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
