"""Reading sysfs-like trees either from a real root directory or from a ``path -> contents`` dict.

The dict form lets tests (and remote diagnostics) feed a captured tree, e.g. the output of
``grep -r . /sys/class/hwmon/*/`` turned into a dict by :func:`tree_from_grep_r`.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Callable, Mapping

__all__ = ["SysfsReader", "tree_from_grep_r"]

_PATH_CONTINUES_RE = re.compile(r"[^/\s]*/")


def _split_grep_line(line: str) -> tuple[str, str] | None:
    """Split ``path:value``.  Directory names may contain colons (``intel-rapl:0:0``), file names
    do not, so the separator is the first colon after which the path does not go on into a
    subdirectory (no ``/`` before the next blank); failing that, the first colon."""
    positions = [i for i, ch in enumerate(line) if ch == ":"]
    if not positions:
        return None
    for pos in positions:
        if not _PATH_CONTINUES_RE.match(line, pos + 1):
            return line[:pos], line[pos + 1 :]
    return line[: positions[0]], line[positions[0] + 1 :]


def tree_from_grep_r(text: str) -> dict[str, str]:
    """Turn a ``grep -r . DIR`` listing (lines ``path:value``) into ``{path: contents}``.

    Multi-line files appear as several lines with the same path and are joined with newlines.
    ``Binary file ... matches`` notices and lines without a colon are skipped.
    """
    tree: dict[str, str] = {}
    for raw in (text or "").lstrip("\ufeff").splitlines():
        line = raw.rstrip("\r")
        if not line.strip() or line.startswith(("Binary file ", "grep: ")):
            continue
        split = _split_grep_line(line)
        if split is None:
            continue
        path, value = split
        path = path.strip()
        while path.startswith("./"):
            path = path[2:]
        if not path:
            continue
        path = posixpath.normpath(path)
        if path in tree:
            tree[path] = tree[path] + "\n" + value
        else:
            tree[path] = value
    return tree


class SysfsReader:
    """``read``/``listdir``/``find_dirs`` over a real root directory or a ``{path: contents}`` dict."""

    def __init__(self, source: str | Mapping[str, str]) -> None:
        self._root: str | None = None
        self._tree: dict[str, str] = {}
        if isinstance(source, str):
            self._root = source
        else:
            self._tree = {posixpath.normpath(k.lstrip("/")): v for k, v in source.items()}

    @property
    def is_tree(self) -> bool:
        return self._root is None

    def read(self, path: str) -> str | None:
        """File contents without the trailing newline; None if missing or unreadable."""
        if self._root is None:
            value = self._tree.get(posixpath.normpath(path.lstrip("/")))
            return value.rstrip("\n") if value is not None else None
        try:
            with open(os.path.join(self._root, path.lstrip("/")), encoding="utf-8", errors="replace") as handle:
                return handle.read().rstrip("\n")
        except OSError:  # missing, EACCES (RAPL energy_uj is root-only), EIO/ENODATA from a dead sensor
            return None

    def listdir(self, path: str) -> list[str]:
        if self._root is None:
            prefix = posixpath.normpath(path.lstrip("/"))
            prefix = "" if prefix == "." else prefix + "/"
            names = {key[len(prefix) :].split("/", 1)[0] for key in self._tree if key.startswith(prefix)}
            return sorted(n for n in names if n)
        try:
            return sorted(os.listdir(os.path.join(self._root, path.lstrip("/"))))
        except OSError:
            return []

    def find_dirs(self, real_parent: str, name_matches: Callable[[str], bool]) -> list[str]:
        """Directories whose basename satisfies ``name_matches``: under ``real_parent`` for a real
        root; anywhere in the tree for the dict form (captures are rooted wherever grep ran)."""
        if self._root is not None:
            names = sorted((n for n in self.listdir(real_parent) if name_matches(n)), key=_natural_key)
            return [posixpath.join(real_parent, n) for n in names]
        dirs: set[str] = set()
        for key in self._tree:
            parts = key.split("/")
            for i in range(len(parts) - 1):
                if name_matches(parts[i]):
                    dirs.add("/".join(parts[: i + 1]))
        return sorted(dirs, key=_natural_key)


def _natural_key(text: str) -> str:
    """Sort ``hwmon10`` after ``hwmon9``."""
    return re.sub(r"\d+", lambda m: m.group(0).zfill(12), text)
