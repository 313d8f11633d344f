"""Finding a real llama.cpp `llama-server` for the tests that run an engine.

Looked for, in order:
1. `$LLMGW_LLAMA_SERVER` (when set, only that path is used);
2. `<repo>/../shared/bin/llama-server` (the prebuilt one, see shared/bin/README.md);
3. `${XDG_CACHE_HOME:-~/.cache}/llmgw/llama-server/<version>/llama-server`, where
   `scripts/ensure-llama-server` builds it when neither of the others exists.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["LLAMA_CPP_VERSION", "cache_path", "llama_server_path", "missing_reason"]

REPO_ROOT = Path(__file__).resolve().parents[1]
#: llama.cpp commit vendored in llama-cpp-python 0.3.36, the build the tests were written against.
LLAMA_CPP_VERSION = "0c1e570"
ENV = "LLMGW_LLAMA_SERVER"


def _usable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmgw" / "llama-server" / LLAMA_CPP_VERSION / "llama-server"


def llama_server_path() -> Path | None:
    """The llama-server binary to run, or None when there is none."""
    explicit = os.environ.get(ENV)
    if explicit:
        path = Path(explicit)
        return path if _usable(path) else None
    for path in (REPO_ROOT.parent / "shared" / "bin" / "llama-server", cache_path()):
        if _usable(path):
            return path.resolve()
    return None


def missing_reason() -> str:
    """Why a test that needs llama-server is skipped, and how to get one."""
    explicit = os.environ.get(ENV)
    if explicit:
        return f"{ENV}={explicit} is not an executable file"
    return (
        f"no llama-server binary: set {ENV}, put one in {REPO_ROOT.parent / 'shared' / 'bin'}, or run "
        f"scripts/ensure-llama-server to build llama.cpp {LLAMA_CPP_VERSION} into {cache_path().parent}"
    )
