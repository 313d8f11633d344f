"""The fleet simulator at fleet size: 10,000 captured 8 x H100 nodes, 2,000 models and a day of
events at one-minute steps, against a baseline measured in the same run (one reconciler pass
over the same store with nothing to do, times the steps).

    .venv/bin/python bench/sim.py [--nodes 10000] [--models 2000] [--hours 24] [--profile]

The node type's capture (an 8 x H100 nvidia-smi -q) is found as the tests find it
($LLMGW_FIXTURES_DIR, else ../shared/fixtures beside the clone), else in the copy the simulator
ships (apps/sim/captures). Prints the run's time, the time per step and per placement, the ratio
to the baseline, the load average at the start and the end, and the target as met or missed.
Target: the whole day at fleet size (the defaults) run in at most 60 s; a smaller run is
reported as not measured.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import Report, fixture_roots  # noqa: E402

TARGET_S = 60.0


def scenario(nodes: int, models: int, hours: int) -> dict:
    """A fleet in racks of 4 nodes on two PDUs, 32 nodes a leaf of one InfiniBand fabric; models
    of 8, 4, 2 and 1 cards, one in ten under a load that rises in the day; a day of events."""
    mix = []
    for i in range(models):
        gpus = (8, 4, 2, 1)[i % 4]
        low = 1 + i % 3
        model = {
            "name": f"m{i:04d}",
            "min": low,
            "max": low + 2,
            "class": ("standard", "critical", "opportunistic", "standard")[i % 4],
            "owner": f"team:{i % 20}",
            "profiles": [{"name": f"h100x{gpus}", "engine": "vllm", "accelerator": "H100-80GB", "gpus": gpus}],
        }
        if i % 10 == 0:
            model["load"] = {
                "replica_rps": 10,
                "points": [{"at": "0h", "rps": 5}, {"at": "9h", "rps": 25}, {"at": "18h", "rps": 8}],
            }
        mix.append(model)
    racks = nodes // 4

    def rack(number: int) -> str:  # the events' racks, within a small fleet too
        return f"r{max(1, min(number, racks)):02d}"

    return {
        "start": "2026-12-01T00:00:00Z",
        "step": "1m",
        "duration": f"{hours}h",
        "node_types": {
            "h100": {
                "nvidia_smi": "nvidia-smi-q/h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt",
                "cpus": 224,
                "memory": "2TiB",
                "idle_watts": 1800,
            }
        },
        "nodes": [
            {"type": "h100", "count": nodes, "rack": {"size": 4, "pdus": 2}, "fabric": {"name": "ib-a", "per_leaf": 32}}
        ],
        "models": mix,
        "power": {"caps": {f"rack=r{r:02d}": 40000 for r in range(1, min(racks, 200) + 1)}},
        "events": [
            {"at": "2h", "lose": {"rack": rack(12)}},
            {"at": "3h", "lose": {"count": 50}},
            {"at": "4h", "restore": {"rack": rack(12)}},
            {"at": "6h", "hold": {"rack": rack(20), "reason": "PDU swap", "drain": True}},
            {"at": "8h", "release": {"rack": rack(20)}},
            {"at": "9h", "load": {"model": "m0000", "factor": 3}},
            {"at": "10h", "cap": {"domain": f"rack={rack(30 if racks >= 30 else racks - 1)}", "watts": "20kW"}},
            {"at": "12h", "sm_failover": {"fabric": "ib-a", "outage": "5m"}},
            {"at": "14h", "set": {"model": "m0001", "min": 6}},
            {"at": "20h", "restore": {"all": True}},
        ],
        "report": {"model": "m0001"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=2_000)
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--profile", action="store_true", help="print the 25 costliest functions")
    args = parser.parse_args()
    with Report(__doc__) as report:
        seconds = run(args)
        if args.nodes < 10_000 or args.models < 2_000 or args.hours < 24:
            report.not_measured(
                "day at fleet size",
                f"this run had {args.nodes} nodes, {args.models} models, {args.hours} h ({seconds:.1f} s); "
                "the target is for 10,000 nodes, 2,000 models, 24 h",
            )
        else:
            report.target("day at fleet size", measured=seconds, limit=TARGET_S, unit=" s")


def run(args: argparse.Namespace) -> float:
    """The simulated day's time, in seconds."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    os.environ.setdefault("LLMGW_DATA_DIR", "/tmp/llmgw-bench-sim")
    import django

    django.setup()
    from apps.cluster.decisions import run_pass
    from apps.sim import run
    from apps.sim import scenario as scenarios

    built = time.perf_counter()
    parsed = scenarios.parse(scenario(args.nodes, args.models, args.hours), captures=fixture_roots()[0])
    sim = run.Simulation(parsed)
    built = time.perf_counter() - built
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    report = sim.run()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    # Baseline: the reconciler's pass over every model of the settled fleet (which decides
    # nothing), once per step: what a run that visited every model at every step would cost.
    now = parsed.start + parsed.steps * parsed.step
    sim.store.sleep = False
    quiet = time.perf_counter()
    for _ in range(20):
        run_pass(sim.store, now)
    quiet = (time.perf_counter() - quiet) / 20 * (parsed.steps + 1)
    timing = report["timing"]
    end = report["snapshots"][-1]
    fleet = report["scenario"]
    print(f"{fleet['nodes']} nodes, {fleet['gpus']} GPUs, {fleet['models']} models, ", end="")
    print(f"{parsed.steps + 1} steps, {len(parsed.events)} events")
    print(f"built in {built:.1f} s; ran in {timing['seconds']:.1f} s")
    print(f"per step {timing['per_step_ms']:.1f} ms; ", end="")
    print(f"per placement {timing['per_placement_ms']} ms ({timing['placements']} placements)")
    print(f"baseline (every model's turn at every step): {quiet:.1f} s; ", end="")
    print(f"run / baseline {timing['seconds'] / quiet:.2f}")
    print(f"at the end: {end['replicas']}, {end['gpus_stranded']} GPUs stranded, {end['preemptions']} preemptions")
    return float(timing["seconds"])


if __name__ == "__main__":
    main()
