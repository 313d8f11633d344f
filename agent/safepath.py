"""Paths built from what a remote party said, kept under their root.

A Hub names a repository, a commit and file names; the control plane names a node's directory and
the files in it; an archive names its members. Every such path is built here, by :func:`inside`,
before it is opened, written or deleted: each name given is checked on its own (no empty, ``.``
or ``..`` component, nothing absolute, no backslash, NUL or other control character, no component
longer than a file system takes), and the joined path is then resolved, symlinks included, and
must still lie under the resolved root. A path that fails raises :class:`UnsafePath`, whose text
says which rule it broke; nothing is created on the way.

The server imports this module as the agent does (it has no Django import), so both sides apply
the same rules.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["NAME_MAX", "PATH_MAX", "UnsafePath", "check_relative", "inside", "is_inside"]

#: The longest file name (one path component, in bytes of UTF-8) that Linux file systems take.
NAME_MAX = 255
#: The longest path the kernel takes in one call.
PATH_MAX = 4096

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UnsafePath(ValueError):
    """A path that would leave its root or that no file system takes; str() says why."""


def check_relative(path: str, *, what: str = "path") -> list[str]:
    """The components of `path`, a relative POSIX path given by someone else; UnsafePath when a
    component is empty, `.` or `..`, the path is absolute, or a name cannot be a file's."""
    if not isinstance(path, str) or not path:
        raise UnsafePath(f"the {what} is empty")
    if _CONTROL.search(path):
        raise UnsafePath(f"the {what} {path[:80]!r} holds a control character")
    if "\\" in path:
        raise UnsafePath(f"the {what} {path[:80]!r} holds a backslash")
    if path.startswith("/"):
        raise UnsafePath(f"the {what} {path[:80]!r} is absolute")
    parts = path.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise UnsafePath(f"the {what} {path[:80]!r} has an empty, '.' or '..' component")
        size = len(part.encode("utf-8", "surrogatepass"))
        if size > NAME_MAX:
            raise UnsafePath(f"the {what} {path[:80]!r}… has a name of {size} bytes; a file system takes {NAME_MAX}")
    return parts


def inside(root: str | os.PathLike[str], *names: str, what: str = "path") -> Path:
    """`root` joined with each relative name in `names`, resolved; UnsafePath unless every name
    passes :func:`check_relative` and the result, symlinks followed, stays under `root`."""
    base = Path(root)
    if not base.is_absolute():
        raise UnsafePath(f"the root {str(base)[:80]!r} is not absolute")
    parts = [part for name in names for part in check_relative(name, what=what)]
    joined = base.joinpath(*parts)
    size = len(str(joined).encode("utf-8", "surrogatepass"))
    if size > PATH_MAX:
        raise UnsafePath(f"the {what} is {size} bytes long; the kernel takes {PATH_MAX}")
    resolved_root = base.resolve()
    resolved = joined.resolve()
    if resolved != resolved_root and resolved_root not in resolved.parents:
        raise UnsafePath(f"the {what} {'/'.join(parts)[:80]!r} leads outside {base} (to {resolved})")
    return resolved


def is_inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Whether absolute `path`, symlinks followed, is `root` or lies under it."""
    candidate = Path(path)
    if not candidate.is_absolute() or _CONTROL.search(str(candidate)):
        return False
    resolved, base = candidate.resolve(), Path(root).resolve()
    return resolved == base or base in resolved.parents
