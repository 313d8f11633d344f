"""The simulator's scenario checks as a scenario grows: reading one of N models (each name checked
once, in one pass) against the quadratic name check it replaced (`names.count(n)` for every
name), measured in the same run; and how long a scenario asking 10 million GPUs takes to refuse.

    .venv/bin/python bench/sim_limits.py [--sizes 1000,2000,4000,8000,16000]

Prints, for each size, the parse time and the old check's time, and each one's growth when the
size doubles (2.0 is linear, 4.0 quadratic).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TEN_MILLION_GPUS = (
    "node_types: {g: {gpus: {class: H100-80GB, count: 8}}}\n"
    "nodes: [{type: g, count: 1250000}]\n"
    "models: [{name: m, profiles: [{accelerator: H100-80GB, gpus: 8}]}]\n"
)


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
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    os.environ.setdefault("LLMGW_DATA_DIR", "/tmp/llmgw-bench-sim")
    import django

    django.setup()
    from apps.sim import scenario
    from apps.sim.limits import Limits

    limits = Limits.cli()
    previous: tuple[float, float] | None = None
    print(f"{'models':>8} {'parse s':>9} {'growth':>7} {'old check s':>12} {'growth':>7}")
    for size in (int(s) for s in args.sizes.split(",")):
        data = document(size)
        parse = timed(lambda data=data: scenario.parse(data, limits=limits), repeat=3)
        names = [m["name"] for m in data["models"]]
        old = timed(lambda names=names: sorted({n for n in names if names.count(n) > 1}))
        growth = ("", "") if previous is None else (f"{parse / previous[0]:.1f}", f"{old / previous[1]:.1f}")
        print(f"{size:>8} {parse:>9.3f} {growth[0]:>7} {old:>12.3f} {growth[1]:>7}")
        previous = (parse, old)
    refused = time.perf_counter()
    try:
        scenario.parse(TEN_MILLION_GPUS, limits=Limits.web())
    except scenario.ScenarioError as exc:
        took = time.perf_counter() - refused
        print(f"10 million GPUs refused in {took * 1e6:.0f} µs: {exc.problems[-1]}")


if __name__ == "__main__":
    main()
