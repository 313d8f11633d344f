"""bench/fabric_map.py says which targets it met, missed, or could not measure."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from bench import fabric_map


def test_a_capture_the_bench_cannot_find_is_reported_not_measured_never_met(
    monkeypatch: Any, capsys: Any, tmp_path: Path
) -> None:
    monkeypatch.setenv("LLMGW_FIXTURES_DIR", str(tmp_path))
    argv = ["fabric_map.py", "--repeats", "1", "--pods", "1", "--hosts-per-su", "2", "--no-scaling"]
    monkeypatch.setattr(sys, "argv", argv)
    fabric_map.main()
    out = capsys.readouterr().out
    title, start = out.splitlines()[:2]
    assert title.startswith("Fabric map:") and start.startswith("load average at start: ")
    assert "load average at end: " in out
    assert "target capture: not measured (ibnetdiscover/hdr-qm8790" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("targets: ") and "not measured: capture" in last
    assert "all met" not in out
