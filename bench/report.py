"""What every bench prints around its figures: the machine's load, the fixtures it found, and its
targets as met, missed or not measured.

The machine a bench runs on is shared and noisy, so a figure without the load it was measured
under says little: `Report` prints the load average when the bench starts and when it ends. A
target the bench could not measure (a capture that is not there, a phase skipped by a flag) is
reported as not measured, never as met, and the last line names every target under one of the
three words::

    with Report(__doc__) as report:
        report.target("scrape", measured=0.83, limit=1.0, unit="s")
        report.not_measured("capture", "hdr-….txt not found (set LLMGW_FIXTURES_DIR)")

Fixtures are found as the tests find them: ``$LLMGW_FIXTURES_DIR``, else ``../shared/fixtures``
beside the clone, else the project's own copies under ``tests/agent/captured``.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["MET", "MISSED", "NOT_MEASURED", "Report", "fixture", "fixture_roots", "load"]

REPO = Path(__file__).resolve().parent.parent
MET, MISSED, NOT_MEASURED = "met", "MISSED", "not measured"


def load() -> str:
    """The 1, 5 and 15 minute load averages and the CPU count, or "unknown"."""
    try:
        averages = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"
    return f"{averages} ({os.cpu_count()} CPUs)"


def fixture_roots() -> list[Path]:
    """Where fixtures are looked for, in order."""
    env = os.environ.get("LLMGW_FIXTURES_DIR")
    roots = [Path(env)] if env else [REPO.parent / "shared" / "fixtures"]
    roots.append(REPO / "tests" / "agent" / "captured")
    return roots


def fixture(folder: str, name: str) -> Path | None:
    """The fixture file `folder/name` from the first root that has it, or None."""
    for root in fixture_roots():
        path = root / folder / name
        if path.is_file():
            return path
    return None


@dataclass
class Report:
    """The load at the start and end of a bench and the verdict on each of its targets."""

    title: str | None = None
    verdicts: dict[str, str] = field(default_factory=dict)

    def __enter__(self) -> Report:
        if self.title:
            print(self.title.strip().splitlines()[0])
        print(f"load average at start: {load()}", flush=True)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        print(f"load average at end: {load()}")
        if kind is not None and not issubclass(kind, SystemExit):
            print(f"the bench stopped early: {kind.__name__}: {error}")
        print(self.summary(), flush=True)

    def target(self, name: str, *, measured: float | None, limit: float, unit: str = "", higher: bool = False) -> str:
        """Record whether `measured` is within `limit` (at most it; at least it where `higher`).

        None (or NaN: a percentile of no samples) means the figure could not be measured."""
        if measured is None or math.isnan(measured):
            return self.not_measured(name, "no figure")
        met = measured >= limit if higher else measured <= limit
        verdict = MET if met else MISSED
        sign = ">=" if higher else "<="
        print(f"target {name}: {measured:.4g}{unit} (target {sign} {limit:g}{unit}): {verdict}", flush=True)
        self.verdicts[name] = verdict
        return verdict

    def not_measured(self, name: str, why: str) -> str:
        print(f"target {name}: not measured ({why})", flush=True)
        self.verdicts[name] = NOT_MEASURED
        return NOT_MEASURED

    def summary(self) -> str:
        if not self.verdicts:
            return "targets: none measured"
        parts = []
        for verdict in (MET, MISSED, NOT_MEASURED):
            names = [name for name, got in self.verdicts.items() if got == verdict]
            if names:
                parts.append(f"{verdict}: {', '.join(names)}")
        return "targets: " + "; ".join(parts)


if __name__ == "__main__":  # pragma: no cover - a module of helpers
    sys.exit("bench/report.py is imported by the benches; run one of them")
