"""Fabric map: parse, analyse and serialise ibnetdiscover text, with no database.

    .venv/bin/python bench/fabric_map.py [--repeats 5] [--hosts-per-su 16] [--pods 8] [--no-scaling]

Times ``parse`` (which analyses too) plus ``to_dict`` on two inputs: the real 206-switch HDR
SuperPOD capture from the shared fixtures (found as the tests find them: ``$LLMGW_FIXTURES_DIR``,
else ``<repo>/../shared/fixtures``, else our own ``tests/agent/captured``; folder
``ibnetdiscover``), and a synthetic rail-optimised three-tier fat tree of more than 20,000
connected ports written in the same grammar by ``tests/fabrics/fattree.py``. Each figure is the
median of ``--repeats`` runs and is also given as a ratio to a baseline measured in the same run on
the same text: split it into lines and match one regular expression against each line once, which
is the least any parser must do. Then the same for fat trees from about 2,000 to 40,000 ports, to
show how the cost grows (per port it should stay flat: the analysis is linear).

The machine is shared, so the load average is printed at the start and the end, and the ratios are
what to compare between runs. Targets: the capture under 200 ms, the synthetic tree under 1.5 s;
each is reported as met, missed, or not measured (a capture that is not there is not a target met).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apps.fabrics.topology import parse, to_dict  # noqa: E402
from bench.report import Report, fixture, fixture_roots  # noqa: E402
from tests.fabrics.fattree import fat_tree  # noqa: E402

CAPTURE = "hdr-qm8790-3tier-fattree-206sw-1336ca-superpod-crlf-bom-prompt.txt"
CAPTURE_TARGET_S = 0.2
SYNTHETIC_TARGET_S = 1.5
BASELINE_RE = re.compile(r"\[(\d+)\][^\"]*\"([SHR])-([0-9a-fA-F]+)\"\[(\d+)\]")
#: Pods of the scaling series (four units of sixteen hosts with eight rails each; the first with
#: eight hosts a unit): about 2,800, 6,400, 12,700, 25,300 and 38,000 connected ports.
SCALING = ((1, 8), (2, 16), (4, 16), (8, 16), (12, 16))


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


def timed(text: str, repeats: int) -> tuple[float, float]:
    """(median seconds of parse + analyse + to_dict, median seconds of the baseline)."""
    full(text)  # warm the regex and allocator caches once
    return median_s(lambda: full(text), repeats), median_s(lambda: baseline(text), repeats)


def measure(
    report: Report, name: str, label: str, text: str, repeats: int, target_s: float, smaller: str | None = None
) -> None:
    """Time the map of `text` against its target; `smaller` says why this run's input is not the
    target's (the figure is then printed, and the target not measured)."""
    map_s, base_s = timed(text, repeats)
    counts = full(text)["counts"]
    print(f"{label}: {len(text) / 1e6:.2f} MB, {text.count(chr(10)) + 1} lines; {counts}")
    print(
        f"  parse + analyse + to_dict: median {map_s * 1000:.1f} ms of {repeats}; "
        f"baseline (split + one regex match per line) {base_s * 1000:.1f} ms; ratio {map_s / base_s:.1f}x"
    )
    if smaller:
        report.not_measured(name, f"{smaller}: {map_s * 1000:.1f} ms")
    else:
        report.target(name, measured=map_s * 1000, limit=target_s * 1000, unit=" ms")


def tree_text(pods: int, hosts_per_su: int) -> tuple[str, int, int]:
    """A synthetic fat tree's text, its hosts and its connected ports."""
    tree = fat_tree(
        pods=pods,
        sus_per_pod=4,
        hosts_per_su=hosts_per_su,
        rails=8,
        spines_per_pod=8,
        uplinks=16,
        cores_per_group=8,
    )
    return tree.text, len(tree.hosts), tree.ports


def scaling(repeats: int) -> None:
    """How the cost grows with the fabric: per port it should not."""
    print("growth (synthetic fat trees):")
    print(f"  {'ports':>7} {'hosts':>6} {'ms':>8} {'us/port':>8} {'ratio':>6}")
    for pods, hosts_per_su in SCALING:
        text, hosts, ports = tree_text(pods, hosts_per_su)
        map_s, base_s = timed(text, repeats)
        print(f"  {ports:>7} {hosts:>6} {map_s * 1000:>8.1f} {map_s / ports * 1e6:>8.1f} {map_s / base_s:>5.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--hosts-per-su", type=int, default=16)
    parser.add_argument("--no-scaling", action="store_true", help="skip the 2k-40k port series")
    args = parser.parse_args()
    with Report(__doc__) as report:
        path = fixture("ibnetdiscover", CAPTURE)
        if path is not None:
            with open(path, encoding="utf-8", errors="replace", newline="") as handle:
                capture = handle.read()
            measure(report, "capture", f"capture {CAPTURE}", capture, args.repeats, CAPTURE_TARGET_S)
        else:
            roots = ", ".join(str(root) for root in fixture_roots())
            report.not_measured("capture", f"ibnetdiscover/{CAPTURE} not found in {roots} (set LLMGW_FIXTURES_DIR)")

        started = time.perf_counter()
        text, hosts, ports = tree_text(args.pods, args.hosts_per_su)
        built_s = time.perf_counter() - started
        print(
            f"synthetic fat tree: {hosts} hosts x 8 rails, {ports} connected ports (written in {built_s * 1000:.0f} ms)"
        )
        smaller = f"{ports} ports; the target is for more than 20,000" if ports <= 20_000 else None
        measure(report, "synthetic", "synthetic fat tree", text, args.repeats, SYNTHETIC_TARGET_S, smaller)
        if not args.no_scaling:
            scaling(max(1, args.repeats // 2))


if __name__ == "__main__":
    main()
