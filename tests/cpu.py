"""Where the suite's CPU goes, by test file: each test's CPU seconds, its own and those of the
processes it started and reaped (resource.getrusage of this process and of its children), summed
by file and printed at the end of the run, the costliest first.

The suite runs on two cores with several test processes side by side, so wall-clock durations
say little about what a file costs the others; CPU seconds do. A process a module-scoped fixture
starts counts toward the module's last test, where it is stopped; an engine that outlives its
agent and is killed by its mark (tests/processes.py) is not reaped here and does not count.
"""

from __future__ import annotations

import resource
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest

SHOWN = 15


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuByFile:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.children: dict[str, float] = defaultdict(float)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: Any, nextitem: Any) -> Iterator[None]:
        before = _cpu_seconds()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        yield
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.seconds[item.location[0]] += _cpu_seconds() - before
        self.children[item.location[0]] += (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.seconds:
            return
        total = sum(self.seconds.values())
        terminalreporter.section(f"CPU by test file: {total:.0f} s in all, the costliest {SHOWN}")
        for path, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])[:SHOWN]:
            terminalreporter.line(f"{seconds:8.1f} s  ({self.children[path]:7.1f} s in processes it started)  {path}")


def install(config: Any) -> None:
    config.pluginmanager.register(CpuByFile(), "llmgw-cpu-by-file")
