"""ctl subcommands contributed by the apps (nodes, models, ...)."""

from __future__ import annotations

from typing import Any

__all__ = ["add_all"]


def add_all(ctl_sub: Any) -> None:
    return None
