"""The simulator's scenario checks as a scenario grows: reading one of N models (each name checked
once, in one pass) against the quadratic name check it replaced (`names.count(n)` for every
name), measured in the same run; and how long a scenario asking 10 million GPUs takes to refuse.

    .venv/bin/python bench/sim_limits.py [--sizes 1000,2000,4000,8000,16000]

Prints, for each size, the parse time and the old check's time, and each one's growth when the
size doubles (2.0 is linear, 4.0 quadratic); the load average at the start and the end; and the
targets as met or missed. Targets: the parse grows linearly, at most 2.5x per doubling from the
smallest size to the largest (the old check's growth is printed beside it, for comparison); the
10-million-GPU scenario is refused before anything is built, in at most 100 ms.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402

TEN_MILLION_GPUS = (
    "node_types: {g: {gpus: {class: H100-80GB, count: 8}}}\n"
    "nodes: [{type: g, count: 1250000}]\n"
    "models: [{name: m, profiles: [{accelerator: H100-80GB, gpus: 8}]}]\n"
)
GROWTH_TARGET = 2.5
REFUSAL_TARGET_MS = 100.0


def document(models: int) -> dict[str, Any]:
    return {
        "node_types": {"g": {"gpus": {"class": "L4", "count": 4}}},
        "nodes": [{"type": "g", "count": 2}],
        "models": [
            {"name": f"m{i:06d}", "min": 0, "max": 1, "profiles": [{"accelerator": "L4", "gpus": 1}]}
            for i in range(models)
        ],
    }


def timed(work: Any, repeat: int = 1) -> float:
    """The fastest of `repeat` runs (the least disturbed by whatever else the machine does)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,2000,4000,8000,16000")
    args = parser.parse_args()
    with Report(__doc__) as report:
        run(args, report)


def run(args: argparse.Namespace, report: Report) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    os.environ.setdefault("LLMGW_DATA_DIR", "/tmp/llmgw-bench-sim")
    import django

    django.setup()
    from apps.sim import scenario
    from apps.sim.limits import Limits

    limits = Limits.cli()
    previous: tuple[float, float] | None = None
    first: tuple[int, float] | None = None
    last: tuple[int, float] | None = None
    print(f"{'models':>8} {'parse s':>9} {'growth':>7} {'old check s':>12} {'growth':>7}")
    for size in (int(s) for s in args.sizes.split(",")):
        data = document(size)
        parse = timed(lambda data=data: scenario.parse(data, limits=limits), repeat=3)
        names = [m["name"] for m in data["models"]]
        old = timed(lambda names=names: sorted({n for n in names if names.count(n) > 1}))
        growth = ("", "") if previous is None else (f"{parse / previous[0]:.1f}", f"{old / previous[1]:.1f}")
        print(f"{size:>8} {parse:>9.3f} {growth[0]:>7} {old:>12.3f} {growth[1]:>7}")
        previous = (parse, old)
        first = first or (size, parse)
        last = (size, parse)
    if first is None or last is None or last[0] <= first[0]:
        report.not_measured("parse growth", "needs at least two sizes (--sizes)")
    else:
        doublings = math.log2(last[0] / first[0])
        per_doubling = (last[1] / first[1]) ** (1 / doublings)
        print(f"parse growth per doubling, {first[0]} to {last[0]} models: {per_doubling:.2f}x")
        report.target("parse growth", measured=per_doubling, limit=GROWTH_TARGET, unit="x")
    refused = time.perf_counter()
    try:
        scenario.parse(TEN_MILLION_GPUS, limits=Limits.web())
    except scenario.ScenarioError as exc:
        took = time.perf_counter() - refused
        print(f"10 million GPUs refused in {took * 1e6:.0f} µs: {exc.problems[-1]}")
        report.target("10M GPUs refused", measured=took * 1000, limit=REFUSAL_TARGET_MS, unit=" ms")
    else:
        took = time.perf_counter() - refused
        print(f"10 million GPUs NOT refused: read in {took:.1f} s")
        report.target("10M GPUs refused", measured=math.inf, limit=REFUSAL_TARGET_MS, unit=" ms")


if __name__ == "__main__":
    main()
