"""Fabric map: parse, analyse and serialise ibnetdiscover text, with no database.

    .venv/bin/python bench/fabric_map.py [--repeats 5] [--hosts-per-su 16] [--pods 8]

Times ``parse`` (which analyses too) plus ``to_dict`` on two inputs: the real 206-switch HDR
SuperPOD capture from the shared fixtures (``$LLMGW_FIXTURES_DIR`` or
``<repo>/../shared/fixtures``, folder ``ibnetdiscover``), and a synthetic rail-optimised
three-tier fat tree of more than 20,000 connected ports written in the same grammar by
``tests/fabrics/fattree.py``. Each figure is the median of ``--repeats`` runs and is also given
as a ratio to a baseline measured in the same run on the same text: split it into lines and
match one regular expression against each line once, which is the least any parser must do.
The machine is shared, so the ratios are what to compare between runs.
Targets: the capture under 200 ms, the synthetic tree under 1.5 s.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apps.fabrics.topology import parse, to_dict  # noqa: E402
from tests.fabrics.fattree import fat_tree  # noqa: E402

CAPTURE = "hdr-qm8790-3tier-fattree-206sw-1336ca-superpod-crlf-bom-prompt.txt"
CAPTURE_TARGET_S = 0.2
SYNTHETIC_TARGET_S = 1.5
BASELINE_RE = re.compile(r"\[(\d+)\][^\"]*\"([SHR])-([0-9a-fA-F]+)\"\[(\d+)\]")


def fixtures_root() -> Path:
    env = os.environ.get("LLMGW_FIXTURES_DIR")
    return Path(env) if env else REPO.parent / "shared" / "fixtures"


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def baseline(text: str) -> int:
    match = BASELINE_RE.match
    return sum(1 for line in text.splitlines() if match(line))


def full(text: str) -> dict[str, object]:
    return to_dict(parse(text))


def measure(label: str, text: str, repeats: int, target_s: float) -> bool:
    full(text)  # warm the regex and allocator caches once
    map_s = median_s(lambda: full(text), repeats)
    base_s = median_s(lambda: baseline(text), repeats)
    counts = full(text)["counts"]
    ok = map_s <= target_s
    print(f"{label}: {len(text) / 1e6:.2f} MB, {text.count(chr(10)) + 1} lines; {counts}")
    print(
        f"  parse + analyse + to_dict: median {map_s * 1000:.1f} ms of {repeats} "
        f"(target {target_s * 1000:.0f} ms: {'met' if ok else 'MISSED'}); "
        f"baseline (split + one regex match per line) {base_s * 1000:.1f} ms; ratio {map_s / base_s:.1f}x"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--hosts-per-su", type=int, default=16)
    args = parser.parse_args()

    results: list[bool] = []
    path = fixtures_root() / "ibnetdiscover" / CAPTURE
    if path.is_file():
        with open(path, encoding="utf-8", errors="replace", newline="") as handle:
            capture = handle.read()
        results.append(measure(f"capture {CAPTURE}", capture, args.repeats, CAPTURE_TARGET_S))
    else:
        print(f"capture {path} not found (set LLMGW_FIXTURES_DIR); skipped")

    started = time.perf_counter()
    tree = fat_tree(
        pods=args.pods,
        sus_per_pod=4,
        hosts_per_su=args.hosts_per_su,
        rails=8,
        spines_per_pod=8,
        uplinks=16,
        cores_per_group=8,
    )
    built_s = time.perf_counter() - started
    print(
        f"synthetic fat tree: {len(tree.hosts)} hosts x {tree.rails} rails, {len(tree.tiers)} switches, "
        f"{tree.cables} cables, {tree.ports} connected ports (written in {built_s * 1000:.0f} ms)"
    )
    results.append(measure("synthetic fat tree", tree.text, args.repeats, SYNTHETIC_TARGET_S))
    print(f"targets: {'all met' if all(results) else 'NOT all met'}")


if __name__ == "__main__":
    main()
