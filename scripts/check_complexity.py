"""The size of the project's functions, held where the code stays easy to change.

Outside bench/ and tests/ (and migrations):
- no function longer than MAX_LINES (from its `def` to its last line, docstring included);
- at most MAX_COMPLEX_SHARE of the functions with a cyclomatic complexity above COMPLEX, as ruff's
  C901 (mccabe) counts it. No function above 25 at all is ruff's own rule (pyproject.toml,
  `lint.mccabe`), checked by `ruff check`.

Prints the figures and every function over a limit; exits 1 when a limit is passed.

    .venv/bin/python scripts/check_complexity.py
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("apps", "llmgw", "agent")
MAX_LINES = 80
COMPLEX = 10
MAX_COMPLEX_SHARE = 0.05


def _sources() -> list[Path]:
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "migrations" not in path.parts and "static_src" not in path.parts and "node_modules" not in path.parts
    )


def _functions(paths: list[Path]) -> list[tuple[str, int]]:
    """(where, length in lines) of every function and method."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                where = f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
                found.append((where, (node.end_lineno or node.lineno) - node.lineno + 1))
    return found


def _complex(paths: list[Path]) -> list[str]:
    """ruff's C901 findings above COMPLEX, one line each."""
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff) if ruff.exists() else "ruff", "check", "--select", "C901", "--output-format", "json"]
    command += ["--config", f"lint.mccabe.max-complexity={COMPLEX}", "--exit-zero", *map(str, paths)]
    findings = json.loads(subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT).stdout)
    return [f"{Path(f['filename']).relative_to(ROOT)}:{f['location']['row']} {f['message']}" for f in findings]


def main() -> int:
    paths = _sources()
    functions = _functions(paths)
    long = sorted((f for f in functions if f[1] > MAX_LINES), key=lambda f: -f[1])
    complex_ = _complex(paths)
    share = len(complex_) / len(functions) if functions else 0.0
    print(f"{len(functions)} functions in {', '.join(PACKAGES)}")
    print(f"complexity above {COMPLEX}: {len(complex_)} ({share:.1%}; at most {MAX_COMPLEX_SHARE:.0%})")
    print(f"longer than {MAX_LINES} lines: {len(long)} (none allowed)")
    for where, lines in long:
        print(f"  {where}: {lines} lines")
    failed = bool(long) or share > MAX_COMPLEX_SHARE
    if share > MAX_COMPLEX_SHARE:
        for line in complex_:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
